"""A watchdog on the engine loop: when the loop has made no progress for a while, it logs where
the loop's thread is; past a second, longer limit it hands the stall to a callback (the engine
process: fail the in-flight requests and exit, so the front end starts a new engine).

Why: a stuck engine logs nothing. The operator log and the slow-step lines
(runner/engine/process.py) are written after a step returns, so a step that never returns (a GPU
kernel that does not end, a wait on the codec's stream that is never satisfied) or an output
queue nobody drains leaves the log silent while every client times out. The stack says which.
The loop pays one attribute write per iteration; an idle loop still beats every 50 ms.

The second limit exists because a step that never returns cannot be recovered inside the process
(a kernel that does not end holds the CUDA context); while it lasts every client waits for its
own timeout. The callback runs on the watchdog's thread, once per stall.
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
    def __init__(self, after_s: float, describe: Callable[[], str], give_up_s: float = 0.0,
                 give_up: Callable[[float], None] | None = None) -> None:
        """Watches the calling thread (the loop's). `describe()` adds the loop's state to the
        report (called on the watchdog's thread: it must only read). give_up(stalled_s) is
        called once a stall outlasts give_up_s (> after_s; 0: never)."""
        if after_s <= 0:
            raise ValueError(f"after_s: must be > 0, got {after_s}")
        if give_up_s and (give_up_s <= after_s or give_up is None):
            raise ValueError(f"give_up_s: must be 0 or > after_s ({after_s}) with a give_up callback, got {give_up_s}")
        self.after_s = after_s
        self.give_up_s = give_up_s
        self._give_up = give_up
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
        reported = given_up = None  # the beats already reported / given up on: once per stall
        while not self._stop.wait(self.after_s / 4):
            beat = self._beat
            stalled = time.monotonic() - beat
            if self.give_up_s and stalled > self.give_up_s and beat != given_up:
                given_up = beat
                log.error("engine loop: no progress for %.0f s, giving up (%s)", stalled, self._describe())
                self._give_up(stalled)
                continue
            if stalled <= self.after_s or beat == reported:
                continue
            reported = beat
            frame = sys._current_frames().get(self._loop_thread)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(the loop's thread has ended)\n"
            log.error("engine loop: no progress for %.0f s (%s); the loop is at:\n%s", stalled, self._describe(), where)
