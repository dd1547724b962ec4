"""The front end's garbage collector: start-up heap frozen, thresholds for bursts, pauses measured.

Why: the front end is one event loop serving every stream, so a collection pauses all of them.
When hundreds of sessions start together each allocates a few hundred container objects
(handlers, tasks, queues, buffers) that live until its utterance ends. With Python's default
thresholds (700, 10, 10) a 400-session burst runs ~100 collections, and once the start-up heap
is frozen (streaming.gc_pause.freeze_startup_heap) the oldest generation holds only what was
promoted since, so the rule that holds a full collection back until the objects promoted since
the last one reach a quarter of its survivors holds little back: full collections over all the
burst's live objects come every hundred young ones. In such a burst on the instant fake engine
(the front-end benchmark) FRONT_END_GC_THRESHOLDS cut the total collection time by about half
and the longest pause about five-fold against (700, 10, 10).

What is given up: cyclic garbage waits longer for a collection (reference counting frees
everything else at once). The oldest generation is still collected, every 100 collections of
the middle one; `omnistream_gc_pause_seconds` on /metrics shows what the collector costs.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

from prometheus_client import Histogram
from prometheus_client.core import Metric

from streaming.gc_pause import freeze_startup_heap, on_gc_pause

# gc.set_threshold: allocations (net of frees) between young collections, young collections per
# middle one, middle collections per full one
FRONT_END_GC_THRESHOLDS = (10_000, 20, 100)


def settle_heap(thresholds: tuple[int, int, int] = FRONT_END_GC_THRESHOLDS) -> None:
    """Once the front end is ready: watch its collections (GC_PAUSES; first, so the settling
    full collection is the first observation), freeze the start-up heap, set the thresholds."""
    GC_PAUSES.install()
    freeze_startup_heap()
    gc.set_threshold(*thresholds)


class GcPauses:
    """Histogram of this process's collection pauses by generation, fed by a gc callback
    (`install`, once per process) and exported by every app's /metrics (a registered collector)."""

    def __init__(self) -> None:
        self.hist = Histogram(
            "omnistream_gc_pause_seconds",
            "Garbage-collection pauses of the front end's process (every stream waits)",
            ["generation"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=None,
        )
        self._children = [self.hist.labels(generation=str(g)) for g in range(3)]
        self.callback: Callable[[str, dict], None] | None = None  # the gc callback, once installed

    def install(self) -> None:
        if self.callback is None:
            self.callback = on_gc_pause(lambda generation, dt, _: self._children[generation].observe(dt))

    def collect(self) -> Iterator[Metric]:
        return self.hist.collect()


GC_PAUSES = GcPauses()
