"""Qwen3-TTS's code-0 repetition penalty through the real engine (CPU), against the reference's
greedy generate() with repetition_penalty 1.05 (qwen-tts's default) and 1.5
(tests/reference/qwen3_tts_golden.py `<case>_rep<P>.npz`, 24 steps: the penalty changes frames
there, the golden script checks it). The history is per request: only generated code-0 ids
count (the prompt's codes do not), a slot handed to a new request starts clean, a preempted
request recomputes it from its FrameLog rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from streaming.sampling_params import SamplingParams
from tests.engine.test_qwen3_tts_engine import GREEDY_GROUPS, cases, drive, make_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def golden(qwen3_tts_golden) -> Path:
    return qwen3_tts_golden("qwen3_tts_golden")


def penalty_cases(golden: Path, model: str) -> list[tuple[float, dict[str, np.ndarray]]]:
    """(penalty, case) of every `<case>_rep<P>` file of the model."""
    names = json.loads((golden / "manifest.json").read_text())["penalty_cases"][model]
    return [(int(n.rsplit("_rep", 1)[1]) / 100, dict(np.load(golden / model / f"{n}.npz"), groups=GREEDY_GROUPS))
            for n in names]


def check_frames(eng, got: dict, refs: list[dict]) -> None:
    """Each request's frames = the reference's (its eos frame, when it ended, beyond them)."""
    c = eng.family.config
    for i, ref in enumerate(refs):
        g = got[f"r{i}"]
        ended = g["finish"] == "stop"
        np.testing.assert_array_equal(g["frames"][: len(g["frames"]) - ended], ref["frames"], err_msg=f"r{i}")
        if ended:
            assert g["frames"][-1, 0] == c.codec.eos


def steps(golden: Path) -> int:
    return json.loads((golden / "manifest.json").read_text())["penalty_new_tokens"] - 1


@pytest.mark.parametrize("model", ["custom_voice", "ends"])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("join_every", [0, 3])
def test_greedy_frames_with_penalty_equal_the_reference(golden, model, async_scheduling, join_every):
    """Every prompt under penalties 1.05 and 1.5, batched together (rows of different penalties
    side by side, joining mid-run): frames = the reference's alone."""
    pcs = penalty_cases(golden, model)
    eng = make_engine(golden / model / "checkpoint", async_scheduling=async_scheduling)
    assert eng.code0_penalty  # what the engine's Ready tells the front end
    sps = [SamplingParams(temperature=0.0, repetition_penalty=p, max_tokens=steps(golden)) for p, _ in pcs]
    got = drive(eng, [c for _, c in pcs], sps, join_every=join_every)
    check_frames(eng, got, [c for _, c in pcs])


def test_penalised_and_plain_rows_in_one_batch(golden):
    """A row without a penalty beside penalised ones keeps the unpenalised reference's frames
    (the batch's penalty is per row), and theirs stay the penalised reference's."""
    pcs = penalty_cases(golden, "custom_voice")[:4]
    plain = [dict(c, groups=GREEDY_GROUPS) for c in cases(golden, "custom_voice")]
    n_plain = len(plain[0]["frames"])
    eng = make_engine(golden / "custom_voice" / "checkpoint", async_scheduling=True)
    sps = [SamplingParams(temperature=0.0, repetition_penalty=p, max_tokens=steps(golden)) for p, _ in pcs]
    sps += [SamplingParams(temperature=0.0, max_tokens=n_plain)] * len(plain)
    reqs = [c for _, c in pcs] + plain
    got = drive(eng, reqs, sps, join_every=1)
    check_frames(eng, got, reqs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_reused_slot_starts_clean(golden, async_scheduling):
    """Two slots for eight penalised requests: each slot serves several requests in turn, and
    every request's frames are the reference's (a history left over from the slot's previous
    request would penalise other ids)."""
    pcs = penalty_cases(golden, "custom_voice")
    eng = make_engine(golden / "custom_voice" / "checkpoint", async_scheduling=async_scheduling, max_num_seqs=2)
    sps = [SamplingParams(temperature=0.0, repetition_penalty=p, max_tokens=steps(golden)) for p, _ in pcs]
    got = drive(eng, [c for _, c in pcs], sps)
    check_frames(eng, got, [c for _, c in pcs])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_requests_recompute_their_history(golden, async_scheduling):
    """A KV cache too small for all of them: preempted requests are recomputed, their code-0
    history refilled from their FrameLog rows; frames unchanged."""
    pcs = penalty_cases(golden, "custom_voice")[:4]
    eng = make_engine(golden / "custom_voice" / "checkpoint", async_scheduling=async_scheduling, num_blocks=24,
                      prefix=False)
    sps = [SamplingParams(temperature=0.0, repetition_penalty=p, max_tokens=steps(golden)) for p, _ in pcs]
    got = drive(eng, [c for _, c in pcs], sps)
    assert eng.scheduler.num_preemptions > 0
    check_frames(eng, got, [c for _, c in pcs])


def test_history_holds_generated_code0_only(golden):
    """Prompts whose codec part carries codes (code 0 in [0, num_codes), as an ICL prompt's
    reference frames do): after every step each running request's code-0 history is the
    bincount of the code 0s it generated, the prompt's never counted (the reference's
    input_ids start empty)."""
    refs = cases(golden, "custom_voice")
    eng = make_engine(golden / "custom_voice" / "checkpoint", async_scheduling=False)
    c, hist = eng.family.config, eng.runner.code0_history
    for i, ref in enumerate(refs):
        rows = ref["codec_ids"].copy()
        rows[:3, 0] = [i, i + 1, 7]  # the role positions: codes instead of nothing
        eng.add_request(f"r{i}", ref["text_ids"].tolist(), SamplingParams(temperature=0.0, repetition_penalty=1.05,
                                                                         max_tokens=6),
                        prompt_frames=rows, step_text_ids=ref["trailing_ids"].tolist(), group_sampling=GREEDY_GROUPS)
    checked = 0
    while eng.has_unfinished:
        eng.step()
        for req in eng.requests.values():
            f, n = req.frames, len(req.output_token_ids)
            if req.slot is None or n == 0:
                continue
            want = np.bincount(f.codes(f.num_prompt, f.num_prompt + n)[:, 0], minlength=c.codec_vocab_size)
            np.testing.assert_array_equal(hist.output_counts[req.slot].numpy(), want, err_msg=req.request_id)
            assert not hist.prompt_mask[req.slot].any()
            checked += 1
    assert checked >= len(refs)


def test_graph_batch_rows_penalise_and_padding_writes_no_slot(golden):
    """The frame graphs' code-0 batch (frame_graphs._GraphBatch with any_repetition on: every
    stage on, padding rows greedy with penalty 1.0 and slot -1) through the runner's code-0
    sampler and record_frames, on the CPU: its real rows draw what an eager batch of them
    draws (= argmax of transformers' penalised, windowed logits), and the padding rows touch
    no slot's history (CUDA graphs replay exactly this; tests/gpu checks graph = eager)."""
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from runner.engine.frame_graphs import _GraphBatch
    from runner.layers.sampling_batch import SamplingBatch, float_params

    eng = make_engine(golden / "custom_voice" / "checkpoint", async_scheduling=False, max_num_seqs=4)
    run, hist = eng.runner, eng.runner.code0_history
    rule = run.layout.code0
    histories = {0: [1, 1, 5, 30], 1: [7, 2]}
    hist.admit_many([(s, [], h, True) for s, h in histories.items()])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(temperature=0.0, repetition_penalty=1.05)]
    slots, counters = np.array([0, 1]), np.array([4, 2])
    gb = _GraphBatch(4, torch.device("cpu"), repetition=True)
    floats = np.array([float_params(p) for p in params], dtype=np.float32)
    gb.buf.copy_(torch.from_numpy(gb.pack(floats, np.zeros(2, np.int64), slots, np.zeros(2, np.int64), counters).copy()))
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, rule.vocab, generator=gen)
    logits[:, : rule.num_codes] = logits[:, : rule.num_codes].abs() + 2.0  # positive: divided
    for s, h in histories.items():  # a seen code on top, by a margin the 1.5 penalty (row 0) undoes
        logits[s, h[0]] = logits[s, : rule.num_codes].max() + 0.1
    drawn = run.codebook_sampler(gb.batch, None)(logits.clone(), 0)
    eager = SamplingBatch.build(params, slots.tolist(), [0, 0], counters.tolist(), [], "cpu")
    want_eager = run.codebook_sampler(eager, None)(logits[:2].clone(), 0)
    assert torch.equal(drawn[:2], want_eager)
    for r, (s, p) in enumerate(zip(slots.tolist(), params)):
        ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([histories[s]]), logits[r : r + 1].clone())[0]
        ref[rule.num_codes :] = float("-inf")  # the window (eos barred: counters >= 2 lets it through)
        ref[rule.eos] = logits[r, rule.eos] if counters[r] >= rule.min_frames else float("-inf")
        assert drawn[r] == ref.argmax(), (r, drawn[r], ref.argmax())
    assert drawn[0] != histories[0][0]  # the penalty changed row 0's draw
    before = hist.output_counts.clone()
    frames = torch.zeros(4, run.num_codebooks, dtype=torch.int64)
    frames[:, 0] = torch.tensor([3, 9, 20, 21])
    run.record_frames(frames, gb.batch)
    after = hist.output_counts
    assert after[0, 3] == before[0, 3] + 1 and after[1, 9] == before[1, 9] + 1
    assert (after - before).sum() == 2  # padding rows (20, 21 at slot -1): no slot's row
