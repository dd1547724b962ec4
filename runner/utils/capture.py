"""What every CUDA graph capture needs around it."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def no_gc_while_capturing() -> Iterator[None]:
    """Collect now, then keep Python's cyclic GC off until the captures are done. A collection
    during a capture runs the finalizers of whatever garbage it finds (an earlier engine's
    graphs, events, streams), and a CUDA call from one of those while the stream captures
    aborts the process (seen in tests/gpu/test_gpu.py, which builds engine after engine).
    torch.cuda.graph no longer collects before a capture by itself."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
