"""Garbage-collector helpers both processes use: freeze the start-up heap, watch the pauses.

The engine process freezes its heap and logs slow collections (log_slow_gc); the front end
freezes its heap and feeds a pause histogram (server/gc_tuning.py).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (modules, model wrappers, Triton and torch caches:
    ~300k objects in the engine process) out of the garbage collector's reach. They live as long
    as the process, yet each full collection scanned them all: a pause of a few hundred ms during
    which no engine step ran (an audio stall for every stream) or the front end's event loop
    stood still. Per-step garbage is young and stays cheap to collect. Called by the engine
    process and by the server once they are ready."""
    gc.collect()
    gc.freeze()


def on_gc_pause(handler: Callable[[int, float, int], None]) -> Callable[[str, dict], None]:
    """Call handler(generation, seconds paused, objects collected) after every garbage
    collection of this process; returns the gc callback (to remove it from gc.callbacks)."""
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            handler(info["generation"], time.perf_counter() - started[0], info["collected"])

    gc.callbacks.append(on_gc)
    return on_gc


def log_slow_gc(logger: logging.Logger, threshold_s: float = 0.02) -> None:
    """Log every garbage collection that pauses the loop for more than threshold_s."""

    def slow(generation: int, dt: float, collected: int) -> None:
        if dt > threshold_s:
            logger.warning("garbage collection of generation %d paused the engine %.1f ms (%d collected)",
                           generation, dt * 1e3, collected)

    on_gc_pause(slow)
