"""Log Triton JIT compilations that happen after start-up.

A compile stalls the engine loop for ~0.5-2 s (every stream waits), so one during serving is a
defect to fix (a missing warm-up, an argument that should not be specialised); the log line
names the kernel and its signature.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator


def describe(kw: dict) -> str:
    """'module.kernel: key' from the arguments Triton passes its compile hooks. The key holds the
    argument types with their specialisations (divisible by 16, == 1) and the constexprs: what
    tells a second variant of a kernel from the first."""
    fn = kw.get("fn")
    return f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}: {str(kw.get('key', ''))[:600]}"


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Collect `describe` of every Triton compile while the block runs (tests and benchmarks
    that must see none after warm-up); the hook installed before, if any, still runs."""
    from triton import knobs

    old = knobs.runtime.jit_post_compile_hook
    compiled: list[str] = []

    def after(**kw) -> bool:
        compiled.append(describe(kw))
        return bool(old(**kw)) if old is not None else False

    knobs.runtime.jit_post_compile_hook = after
    try:
        yield compiled
    finally:
        knobs.runtime.jit_post_compile_hook = old


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
        log.warning("compiled Triton kernel in %.2f s after start-up: %s", dt, describe(kw))
        return False

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after
    return True
