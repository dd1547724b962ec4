"""What every CUDA graph capture needs around it."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch


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


def capture_stream(device: torch.device | str) -> torch.cuda.Stream:
    """A stream of its own for one set of graphs to warm up and capture on.

    Why not torch.cuda.graph's default: that is one stream per process, and a captured cuBLAS
    GEMM keeps the workspace of the stream it was captured on (PyTorch keeps one per stream).
    Graphs of two sets replayed at once on two streams (the frame step on the engine's, the
    Mimi decode on the codec's) would then share one workspace, and a split-K GEMM's semaphores
    there are clobbered by the other's: the GEMM spins forever (a CSM server at 1000 streams
    stalled so). One stream per set gives each set its own workspace; a set's graphs replay one
    at a time on one stream."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream
