"""Scheduler unit tests on the CPU (no model): step composition and ordering."""

from __future__ import annotations

from runner.config import SchedulerConfig
from runner.engine.kv_cache import BlockManager
from runner.engine.request import Request
from runner.engine.scheduler import Scheduler
from streaming.sampling_params import SamplingParams


def make(max_seqs: int = 8, budget: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=256, async_scheduling=True)
    return Scheduler(cfg, BlockManager(64, 16, enable_prefix_caching=False))


def test_decodes_come_first_in_a_mixed_step():
    s = make()
    a = Request("a", list(range(1, 11)), SamplingParams(max_tokens=8))
    b = Request("b", list(range(1, 21)), SamplingParams(max_tokens=8))
    s.add(a)
    s.add(b)
    first = s.schedule()
    assert [e.req.request_id for e in first.scheduled] == ["a", "b"] and first.num_decodes == 0
    s.update_from_output(first, [5, 6])
    c = Request("c", list(range(1, 31)), SamplingParams(max_tokens=8))
    s.add(c)
    mixed = s.schedule()
    assert [e.num_tokens for e in mixed.scheduled] == [1, 1, 30]
    assert mixed.num_decodes == 2 and [e.req.request_id for e in mixed.scheduled[:2]] == ["a", "b"]
    # the stall report's line for a step
    assert mixed.describe() == "3 sequences (2 decodes, prompt chunks of 30 tokens), 32 tokens"
    assert first.describe() == "2 sequences (0 decodes, prompt chunks of 10 / 20 tokens), 30 tokens"


def test_admission_hold_groups_arrivals_under_load():
    """With >= ADMISSION_HOLD_MIN_RUNNING running, a new request waits until the oldest waiting
    one is admission_wait_ms old; below that it is admitted at once."""
    from runner.config import ADMISSION_HOLD_MIN_RUNNING

    now = [100.0]
    n = ADMISSION_HOLD_MIN_RUNNING
    cfg = SchedulerConfig(max_num_seqs=n + 8, max_num_batched_tokens=4096, max_model_len=256, admission_wait_ms=20.0)
    sched = Scheduler(cfg, BlockManager(4096, 16, False), clock=lambda: now[0])

    def arrive(i: int) -> Request:
        r = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100))
        r.arrival_time = now[0]
        sched.add(r)
        return r

    for i in range(n - 1):
        arrive(i)
    assert len(sched.schedule().scheduled) == n - 1  # below the threshold: no hold
    arrive(n - 1)
    assert sched.schedule().scheduled[-1].req.request_id == f"r{n - 1}"  # still below: admitted
    late = [arrive(n + i) for i in range(3)]
    for dt in (0.0, 0.010, 0.019):
        now[0] = late[0].arrival_time + dt
        out = sched.schedule()
        assert all(not e.new_admission for e in out.scheduled) and len(sched.waiting) == 3
    now[0] = late[0].arrival_time + 0.0201
    out = sched.schedule()
    assert [e.req for e in out.scheduled if e.new_admission] == late  # the group joins together
    assert not sched.waiting
