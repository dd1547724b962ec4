"""Host input packing (runner/engine/step_inputs.py) on a hand-built step: a decode whose token
is in flight, a decode whose token is on the host, a prefill chunk that samples and wants hidden
states, and a prefill chunk that does not sample."""

from __future__ import annotations

import numpy as np

from runner.engine.phase_timer import PhaseTimer
from runner.engine.request import Request
from runner.engine.scheduler import ScheduledRequest, SchedulerOutput
from runner.engine.step_inputs import pack_step_inputs, split_pack
from streaming.sampling_params import SamplingParams

BS = 4


def _req(slot: int, prompt: list[int], outs: list[int], blocks: list[int], **kw) -> Request:
    r = Request(f"r{slot}", prompt, SamplingParams(), **kw)
    r.output_token_ids, r.slot, r.block_ids = list(outs), slot, list(blocks)
    return r


def test_packing_of_a_mixed_step():
    inflight = _req(0, [1, 2, 3], [4], [7, 8])  # 3 + 1 known, position 4's token still on the device
    inflight.num_inflight = 1
    host = _req(1, [5, 6], [9], [3])  # sync mode: position 2's token (9) is known
    prefill = _req(2, list(range(10, 16)), [], [5, 6], hidden_state_layers=(-1, 0))
    chunk = _req(3, list(range(20, 29)), [], [1, 2, 4])
    sched = SchedulerOutput([
        ScheduledRequest(inflight, 4, 1, True, False),
        ScheduledRequest(host, 2, 1, True, False),
        ScheduledRequest(prefill, 0, 6, True, True),
        ScheduledRequest(chunk, 0, 5, False, True),
    ], num_batched_tokens=13, num_decodes=2)
    table = np.zeros((4, 8), dtype=np.int32)
    table[0, 0], table[1, 0] = 7, 3  # the blocks the running requests had before this step
    written = [1, 1, 0, 0]
    inp = pack_step_inputs(sched, table, written, BS, num_layers=2, wants_constraint=lambda r: r.slot == 1)

    assert (inp.num_tokens, inp.num_seqs, inp.num_decodes, inp.pure_decode) == (13, 4, 2, False)
    assert inp.pack.size % 2 == 0 and np.shares_memory(inp.split(inp.pack)[0], inp.pack)
    ids, pos, slot_map, seq_lens, qsl = split_pack(inp.pack, 13, 4)
    assert ids.tolist() == [0, 9, *range(10, 16), *range(20, 25)]  # row 0 comes from the device
    assert pos.tolist() == [4, 2, *range(6), *range(5)]
    assert seq_lens.tolist() == [5, 3, 6, 5] and qsl.tolist() == [0, 1, 2, 8, 13]
    assert slot_map.tolist()[:2] == [8 * BS + 0, 3 * BS + 2]
    assert slot_map.tolist()[2:8] == [5 * BS + i for i in range(4)] + [6 * BS + 0, 6 * BS + 1]
    assert (inp.dev_rows, inp.dev_slots) == ([0], [0])
    assert table[0, :2].tolist() == [7, 8] and written == [2, 1, 2, 3]  # the mirror grew / was written
    assert inp.tables.shape == (4, 2) and inp.tables[3].tolist() == [1, 2]
    assert [r.slot for r in inp.admitted] == [2, 3]
    assert inp.logits_rows == [0, 1, 7]
    s = inp.sample
    assert [r.slot for r in s.reqs] == s.slots == [0, 1, 2]
    assert s.out_index == [1, 0, -1] and s.constrained == [1]
    assert inp.capture == (0, 2) and inp.hidden_rows.tolist() == list(range(2, 8))
    assert inp.hidden_spans == [(prefill, 0, 6, 0, [1, 0])] and prefill.num_hidden_emitted == 6


def test_phase_timer_sums_per_phase_and_resets_by_a_new_list():
    t = PhaseTimer(("a", "b"))
    with t("b"):
        sum(range(1000))
    with t("b"):
        pass
    assert t.seconds[0] == 0.0 and t.seconds[1] > 0.0
    t2 = PhaseTimer(t.names, [0.0, 0.0])
    with t2("a"):
        pass
    assert t2.seconds[1] == 0.0 and t2.seconds[0] > 0.0
