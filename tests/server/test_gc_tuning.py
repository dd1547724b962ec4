"""server/gc_tuning.py: the front end's heap settling and its collection-pause histogram."""

from __future__ import annotations

import gc

import pytest

from server.gc_tuning import FRONT_END_GC_THRESHOLDS, GC_PAUSES, GcPauses, settle_heap
from server.metrics import Metrics


@pytest.fixture
def gc_state():
    old = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*old)


def test_settle_heap_freezes_the_heap_and_sets_the_thresholds(gc_state):
    settle_heap()
    assert gc.get_threshold() == FRONT_END_GC_THRESHOLDS and gc.get_freeze_count() > 0
    assert gc.callbacks.count(GC_PAUSES.callback) == 1  # the front end's pauses are watched
    settle_heap((1234, 5, 6))
    assert gc.get_threshold() == (1234, 5, 6)


def test_pauses_are_observed_per_generation_and_exported():
    pauses = GcPauses()
    pauses.install()
    pauses.install()  # idempotent: one callback
    assert gc.callbacks.count(pauses.callback) == 1
    try:
        gc.collect(1)
        gc.collect(2)
    finally:
        gc.callbacks.remove(pauses.callback)
    samples = {(s.name, s.labels.get("generation")): s.value for m in pauses.collect() for s in m.samples}
    assert samples[("omnistream_gc_pause_seconds_count", "1")] == 1
    assert samples[("omnistream_gc_pause_seconds_count", "2")] == 1
    assert samples[("omnistream_gc_pause_seconds_count", "0")] == 0
    assert samples[("omnistream_gc_pause_seconds_sum", "2")] > 0


def test_every_apps_metrics_export_the_process_pauses():
    for _ in range(2):  # one registry per app, the same process-wide histogram in each
        text = Metrics().render().decode()
        assert 'omnistream_gc_pause_seconds_count{generation="2"}' in text
