"""Scheduler unit tests on the CPU (no model): step composition and ordering."""

from __future__ import annotations

from runner.config import SchedulerConfig
from runner.kv_cache import BlockManager
from runner.request import Request
from runner.sampling_params import SamplingParams
from runner.scheduler import Scheduler


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
