"""A watchdog on the engine loop: when the loop has made no progress for a while, it logs where
the loop's thread is.

Why: a stuck engine logs nothing. The operator log and the slow-step lines
(runner/engine/process.py) are written after a step returns, so a step that never returns (a GPU
kernel that does not end, a wait on the codec's stream that is never satisfied) or an output
queue nobody drains leaves the log silent while every client times out. The stack says which.
The loop pays one attribute write per iteration; an idle loop still beats every 50 ms.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)


class LoopWatchdog:
    def __init__(self, after_s: float, describe: Callable[[], str]) -> None:
        """Watches the calling thread (the loop's). `describe()` adds the loop's state to the
        report (called on the watchdog's thread: it must only read)."""
        if after_s <= 0:
            raise ValueError(f"after_s: must be > 0, got {after_s}")
        self.after_s = after_s
        self._describe = describe
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """The loop made progress (called once per iteration)."""
        self._beat = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.after_s)

    def _watch(self) -> None:
        reported = None  # the beat already reported: one report per stall
        while not self._stop.wait(self.after_s / 4):
            beat = self._beat
            stalled = time.monotonic() - beat
            if stalled <= self.after_s or beat == reported:
                continue
            reported = beat
            frame = sys._current_frames().get(self._loop_thread)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(the loop's thread has ended)\n"
            log.error("engine loop: no progress for %.0f s (%s); the loop is at:\n%s", stalled, self._describe(), where)
