"""The engine loop's watchdog (runner/engine/watchdog.py): a loop stuck past the limit gets one
report with its stack and state; a loop that beats gets none."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from runner.engine.watchdog import LoopWatchdog


def _stuck_in_a_step(seconds: float) -> None:
    time.sleep(seconds)


def _run_loop(body) -> None:
    t = threading.Thread(target=body)
    t.start()
    t.join()


def test_a_stuck_loop_is_reported_once_with_its_stack(caplog):
    caplog.set_level(logging.ERROR, logger="runner.engine.watchdog")

    def loop():
        dog = LoopWatchdog(0.2, lambda: "3 running, 0 waiting")
        dog.beat()
        _stuck_in_a_step(0.9)  # several watch periods past the limit: still one report
        dog.close()

    _run_loop(loop)
    reports = [r.getMessage() for r in caplog.records if "no progress" in r.getMessage()]
    assert len(reports) == 1, reports
    assert "_stuck_in_a_step" in reports[0] and "3 running, 0 waiting" in reports[0]


def test_a_loop_that_beats_is_not_reported(caplog):
    caplog.set_level(logging.ERROR, logger="runner.engine.watchdog")

    def loop():
        dog = LoopWatchdog(0.2, lambda: "")
        for _ in range(20):
            dog.beat()
            time.sleep(0.03)
        dog.close()

    _run_loop(loop)
    assert not [r for r in caplog.records if "no progress" in r.getMessage()]


def test_a_second_stall_is_reported_again(caplog):
    caplog.set_level(logging.ERROR, logger="runner.engine.watchdog")

    def loop():
        dog = LoopWatchdog(0.15, lambda: "")
        _stuck_in_a_step(0.4)
        dog.beat()
        _stuck_in_a_step(0.4)
        dog.close()

    _run_loop(loop)
    assert len([r for r in caplog.records if "no progress" in r.getMessage()]) == 2


def test_the_limit_must_be_positive():
    with pytest.raises(ValueError, match="after_s"):
        LoopWatchdog(0, lambda: "")


def test_a_stall_past_the_give_up_limit_is_handed_over_once_after_its_report(caplog):
    caplog.set_level(logging.ERROR, logger="runner.engine.watchdog")
    given = []

    def loop():
        dog = LoopWatchdog(0.1, lambda: "1 running", give_up_s=0.3, give_up=given.append)
        dog.beat()
        _stuck_in_a_step(0.9)  # long past the limit: still one hand-over
        dog.close()

    _run_loop(loop)
    assert len(given) == 1 and given[0] > 0.3
    messages = [r.getMessage() for r in caplog.records]
    report = next(i for i, m in enumerate(messages) if "the loop is at" in m)
    give_up = next(i for i, m in enumerate(messages) if "giving up" in m)
    assert report < give_up and "1 running" in messages[give_up]


def test_a_beating_loop_is_never_given_up_on():
    given = []

    def loop():
        dog = LoopWatchdog(0.05, lambda: "", give_up_s=0.15, give_up=given.append)
        for _ in range(20):
            dog.beat()
            time.sleep(0.03)
        dog.close()

    _run_loop(loop)
    assert not given


def test_the_give_up_limit_comes_after_the_report_and_needs_a_callback():
    with pytest.raises(ValueError, match="give_up_s"):
        LoopWatchdog(1.0, lambda: "", give_up_s=1.0, give_up=lambda s: None)
    with pytest.raises(ValueError, match="give_up_s"):
        LoopWatchdog(1.0, lambda: "", give_up_s=5.0)
