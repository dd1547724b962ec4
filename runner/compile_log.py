"""Log Triton JIT compilations that happen after start-up.

A compile stalls the engine loop for ~0.5-2 s (every stream waits), so one during serving is a
defect to fix (a missing warm-up, an argument that should not be specialised); the log line
names the kernel and its signature.
"""

from __future__ import annotations

import logging
import threading
import time


def install(log: logging.Logger) -> bool:
    """Hook Triton's JIT (no-op without triton). Returns whether the hook is installed."""
    try:
        from triton import knobs
    except ImportError:
        return False
    started: dict[int, float] = {}

    def before(**kw) -> bool:
        started[threading.get_ident()] = time.perf_counter()
        return False  # False: compile as usual

    def after(**kw) -> bool:
        t0 = started.pop(threading.get_ident(), None)
        dt = time.perf_counter() - t0 if t0 is not None else float("nan")
        fn = kw.get("fn")
        name = f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}"
        log.warning("compiled Triton kernel %s in %.2f s after start-up: %s", name, dt, str(kw.get("repr", ""))[:400])
        return False

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after
    return True
