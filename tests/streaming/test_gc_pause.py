"""streaming/gc_pause.py: the start-up heap freeze and the pause hooks both processes install."""

from __future__ import annotations

import gc
import logging

from streaming.gc_pause import freeze_startup_heap, log_slow_gc


def test_freeze_startup_heap_takes_live_objects_out_of_collections():
    keep = [[i] for i in range(1000)]  # long-lived start-up objects
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(keep)
        # the collector no longer tracks them in any generation: a full collection skips them
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(k) in tracked for k in keep)
    finally:
        gc.unfreeze()


def test_slow_collections_are_logged(caplog):
    n = len(gc.callbacks)
    log_slow_gc(logging.getLogger("t"), threshold_s=0.0)
    try:
        with caplog.at_level(logging.WARNING, logger="t"):
            gc.collect()
        assert any("garbage collection of generation 2 paused the engine" in r.message for r in caplog.records)
    finally:
        del gc.callbacks[n:]
