"""Sampler and SlotState: filters against transformers' logits processors, penalties and bias
against naive references, seeded reproducibility across batch layouts, and the sampled
distribution against softmax."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from runner.sampler import Sampler, SamplingBatch, SlotState, make_generator
from runner.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 97  # odd, small vocabulary


def rand_logits(b: int, v: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


def batch_for(params: list[SamplingParams], slots=None, generators=None, extra_bias=()) -> SamplingBatch:
    b = len(params)
    return SamplingBatch.build(
        params,
        list(range(b)) if slots is None else slots,
        [None] * b if generators is None else generators,
        list(extra_bias),
        CPU,
    )


def fresh_state(slots: int = 8, track: bool = False, max_len: int = 64) -> SlotState:
    st = SlotState(slots, V, max_len, CPU)
    if track:
        for s in range(slots):
            st.admit(s, [], [], track_penalties=True)
    return st


def hf_chain(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Reference: transformers warpers in our order (temperature, top-k, top-p, min-p) on one row."""
    x = row.unsqueeze(0).clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    if p.temperature not in (0.0, 1.0):
        x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0.0:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    return x[0]


def assert_same_filtered(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref)), "surviving token sets differ"
    keep = torch.isfinite(ref)
    torch.testing.assert_close(ours[keep], ref[keep], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- filters vs HF


@pytest.mark.parametrize(
    "field,values",
    [
        ("temperature", [0.3, 0.7, 1.0, 1.5, 2.0, 0.05]),
        ("top_k", [0, 1, 5, 40, V, 1000]),  # 0 and > V are off
        ("top_p", [1.0, 0.1, 0.5, 0.9, 0.95, 0.999]),
        ("min_p", [0.0, 0.01, 0.05, 0.2, 0.5, 1.0]),
    ],
)
def test_single_filter_matches_transformers(field, values):
    params = [SamplingParams(**{field: v}) for v in values]
    logits = rand_logits(len(params), seed=len(field))  # fixed per field (str hash is salted)
    ours = Sampler(CPU, seed=0).process(logits.clone(), batch_for(params), fresh_state())
    for i, p in enumerate(params):
        assert_same_filtered(ours[i], hf_chain(logits[i], p))


def test_filters_combined_per_row_match_transformers():
    g = torch.Generator().manual_seed(1)
    params = []
    for _ in range(16):
        params.append(
            SamplingParams(
                temperature=float(torch.empty(1).uniform_(0.2, 2.0, generator=g)),
                top_k=int(torch.randint(0, 60, (1,), generator=g)),
                top_p=float(torch.empty(1).uniform_(0.3, 1.0, generator=g)),
                min_p=float(torch.empty(1).uniform_(0.0, 0.3, generator=g)),
            )
        )
    params[3] = SamplingParams(top_p=1.0, top_k=0, min_p=0.0, temperature=0.9)  # all filters off
    logits = rand_logits(len(params), seed=2)
    ours = Sampler(CPU).process(logits.clone(), batch_for(params), fresh_state(16))
    for i, p in enumerate(params):
        assert_same_filtered(ours[i], hf_chain(logits[i], p))
        assert torch.isfinite(ours[i]).any()


def test_top_p_keeps_at_least_one_token():
    logits = torch.full((2, V), -5.0)
    logits[:, 7] = 20.0  # one token holds ~all the mass
    params = [SamplingParams(top_p=1e-6), SamplingParams(top_p=0.5, top_k=1)]
    ours = Sampler(CPU).process(logits.clone(), batch_for(params), fresh_state())
    for i in range(2):
        assert torch.isfinite(ours[i]).nonzero().flatten().tolist() == [7]


def test_repetition_penalty_matches_transformers():
    st = fresh_state(8, max_len=32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in (5, 0, 12, 3)]
    outputs = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in (4, 6, 0, 9)]
    slots = [6, 1, 3, 0]
    for s, pr in zip(slots, prompts):
        st.admit(s, pr, [], track_penalties=True)
    # Outputs are recorded on the device step by step, as the runner does.
    for step in range(max(len(o) for o in outputs)):
        rows = [(s, o[step], step) for s, o in zip(slots, outputs) if step < len(o)]
        st.record(*(torch.tensor(c) for c in zip(*rows)))
    penalties = [1.3, 0.8, 2.0, 1.1]
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    logits = rand_logits(4, seed=4)
    logits[0, :10] = 0.0  # exact zeros are left unchanged by both
    ours = Sampler(CPU).process(logits.clone(), batch_for(params, slots=slots), st)
    for i in range(4):
        ids = torch.tensor([prompts[i] + outputs[i]], dtype=torch.long)
        ref = RepetitionPenaltyLogitsProcessor(penalties[i])(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(ours[i], ref, rtol=0, atol=0)


def test_frequency_presence_and_bias_match_naive():
    st = fresh_state(4, max_len=32)
    g = torch.Generator().manual_seed(5)
    outputs = [torch.randint(0, 10, (int(n),), generator=g).tolist() for n in (7, 0, 12)]
    slots = [2, 0, 3]
    for s in slots:
        st.admit(s, [1, 2, 3], [], track_penalties=True)
    for step in range(12):
        rows = [(s, o[step], step) for s, o in zip(slots, outputs) if step < len(o)]
        st.record(*(torch.tensor(c) for c in zip(*rows)))
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.0, logit_bias={4: 2.5, 50: -3.0}),
        SamplingParams(frequency_penalty=-1.0, logit_bias={0: 1.0}),
        SamplingParams(presence_penalty=-0.7, repetition_penalty=1.2),
    ]
    extra = [(1, 0, 0.25), (2, 9, float("-inf")), (0, 4, 1.0)]  # duplicates add up
    logits = rand_logits(3, seed=6)
    ours = Sampler(CPU).process(logits.clone(), batch_for(params, slots=slots, extra_bias=extra), st)

    prompt = {1, 2, 3}
    for i, p in enumerate(params):
        ref = logits[i].tolist()
        for t in range(V):
            c = outputs[i].count(t)
            if t in prompt or c:
                ref[t] = ref[t] * p.repetition_penalty if ref[t] < 0 else ref[t] / p.repetition_penalty
            ref[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
        for t, val in p.logit_bias.items():
            ref[t] += val
        for r, t, val in extra:
            if r == i:
                ref[t] += val
        torch.testing.assert_close(ours[i], torch.tensor(ref), rtol=1e-6, atol=1e-5)
    assert ours[2, 9] == float("-inf")


# --------------------------------------------------------------------------- greedy / mixed


def test_greedy_rows_are_argmax_in_mixed_batch():
    logits = rand_logits(6, seed=7)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.0, top_p=0.2, top_k=5),  # filters do not affect greedy
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=0.0, logit_bias={11: 100.0}),
        SamplingParams(temperature=0.5, min_p=0.1),
    ]
    b = batch_for(params)
    assert not b.all_greedy
    ids = Sampler(CPU, seed=0)(logits.clone(), b, fresh_state())
    assert ids.dtype == torch.int64 and ids.shape == (6,)
    assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax() and ids[4] == 11
    top3 = set(logits[1].topk(3).indices.tolist())
    assert int(ids[1]) in top3

    all_greedy = batch_for([SamplingParams(temperature=0.0)] * 6)
    assert all_greedy.all_greedy
    torch.testing.assert_close(Sampler(CPU)(logits.clone(), all_greedy, fresh_state()), logits.argmax(-1))


# --------------------------------------------------------------------------- seeded rows


def _run_seeded(layout: list[tuple[int | None, int]], steps: int = 20, device: torch.device = CPU) -> dict[int, list[int]]:
    """layout: per batch row (seed or None, request key). Each request has its own fixed
    logits per step and a repetition penalty, so its tokens feed back through SlotState."""
    b = len(layout)
    st = SlotState(b + 3, V, steps + 1, device)
    sampler = Sampler(device, seed=len(layout) * 17)  # shared stream differs per layout
    slots = [(3 * i + 1) % (b + 3) for i in range(b)]  # slot != row on purpose
    params, gens = [], []
    for (seed, key), s in zip(layout, slots):
        st.admit(s, [key, key + 1], [], track_penalties=True)
        params.append(SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.3, seed=seed))
        gens.append(None if seed is None else make_generator(seed, device))
    out: dict[int, list[int]] = {key: [] for _, key in layout}
    batch = SamplingBatch.build(params, slots, gens, [], device)
    for step in range(steps):
        logits = torch.stack([rand_logits(1, seed=1000 * key + step, scale=1.0)[0] for _, key in layout]).to(device)
        ids = sampler(logits, batch, st)
        st.record(batch.slots, ids, torch.full((b,), step, device=device))
        for (_, key), t in zip(layout, ids.tolist()):
            out[key].append(t)
    return out


def test_seeded_row_same_alone_or_in_any_batch():
    alone = _run_seeded([(1234, 0)])[0]
    assert len(set(alone)) > 3  # actually sampling, not collapsing
    layouts = [
        [(None, 1), (None, 2), (1234, 0), (7, 3), (None, 4), (None, 5), (99, 6), (None, 7)],
        [(5, 3), (None, 1), (None, 2), (None, 4), (None, 5), (99, 6), (None, 7), (1234, 0)],
        [(1234, 0), (5, 3), (6, 1), (8, 2), (9, 4), (10, 5), (99, 6), (11, 7)],  # all seeded
    ]
    for layout in layouts:
        assert _run_seeded(layout)[0] == alone
    # and other seeded requests are reproducible too
    assert _run_seeded(layouts[0])[6] == _run_seeded(layouts[1])[6]
    assert _run_seeded([(4321, 0)])[0] != alone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_row_same_alone_or_in_batch_cuda():
    dev = torch.device("cuda")
    alone = _run_seeded([(1234, 0)], device=dev)[0]
    mixed = [(None, 1), (None, 2), (1234, 0), (7, 3), (None, 4), (None, 5), (99, 6), (None, 7)]
    assert _run_seeded(mixed, device=dev)[0] == alone


# --------------------------------------------------------------------------- distribution


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    keep = probs > 0
    exp = probs[keep] * n
    return float((((counts[keep] - exp) ** 2) / exp).sum())


@pytest.mark.parametrize(
    "params,expected_fn",
    [
        (SamplingParams(), lambda x: x.softmax(-1)),
        (SamplingParams(temperature=0.5), lambda x: (x / 0.5).softmax(-1)),
        (
            SamplingParams(top_k=4),
            lambda x: torch.where(x >= x.topk(4).values[-1], x, float("-inf")).softmax(-1),
        ),
    ],
)
def test_sampled_frequencies_match_softmax(params, expected_fn):
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    n = 20_000
    probs = expected_fn(base)
    b = batch_for([params] * n, slots=[-1] * n)  # padding slots: state is never touched
    ids = Sampler(CPU, seed=123)(base.expand(n, -1).clone(), b, SlotState(1, 8, 4, CPU))
    counts = torch.bincount(ids, minlength=8).double()
    assert counts[probs == 0].sum() == 0, "a filtered token was sampled"
    assert (counts / n - probs.double()).abs().max() < 0.015
    dof = int((probs > 0).sum()) - 1
    assert _chi_square(counts, probs.double(), n) < 4 * dof + 20  # far beyond p=1e-4 critical values


def test_seeded_rows_follow_the_distribution_too():
    base = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 4000
    gens = [make_generator(i, CPU) for i in range(n)]
    b = batch_for([SamplingParams(seed=i) for i in range(n)], slots=[-1] * n, generators=gens)
    ids = Sampler(CPU, seed=0)(base.expand(n, -1).clone(), b, SlotState(1, 4, 4, CPU))
    freq = torch.bincount(ids, minlength=4).double() / n
    assert (freq - base.softmax(-1).double()).abs().max() < 0.03


# --------------------------------------------------------------------------- SlotState


def test_record_updates_state_and_ignores_padding():
    st = SlotState(4, V, 8, CPU)
    st.admit(2, [5, 6], [], track_penalties=True)
    st.admit(0, [9], [], track_penalties=False)
    assert st.output_counts is not None and st.output_counts.shape == (4, V)
    before_counts = st.output_counts.clone()
    st.record(torch.tensor([2, -1, 0, -1]), torch.tensor([11, 13, 12, -1]), torch.tensor([0, 5, 0, 99]))
    st.record(torch.tensor([-1, 2]), torch.tensor([3, 11]), torch.tensor([7, 1]))
    assert st.last_token.tolist() == [12, 0, 11, 0]
    assert st.history[2, :3].tolist() == [11, 11, -1]
    assert st.history[0, :2].tolist() == [12, -1]
    assert (st.history[[1, 3]] == -1).all()
    diff = st.output_counts - before_counts
    assert diff[2, 11] == 2 and diff[0, 12] == 1 and int(diff.sum()) == 3
    assert st.prompt_mask[2, [5, 6]].all() and int(st.prompt_mask.sum()) == 2


def test_admit_resets_row_and_restores_confirmed_outputs():
    st = SlotState(3, V, 8, CPU)
    st.admit(1, [4, 4, 200, -3], [], track_penalties=True)  # out-of-vocab prompt ids ignored
    assert st.prompt_mask[1].nonzero().flatten().tolist() == [4]
    st.record(torch.tensor([1]), torch.tensor([8]), torch.tensor([0]))
    st.record(torch.tensor([1]), torch.tensor([8]), torch.tensor([1]))
    # preemption-recompute: a new admission with confirmed outputs rebuilds the row
    st.admit(1, [1, 2], [8, 9, 8], track_penalties=True)
    assert st.last_token[1] == 8
    assert st.history[1].tolist() == [8, 9, 8, -1, -1, -1, -1, -1]
    assert st.output_counts[1].nonzero().flatten().tolist() == [8, 9]
    assert st.output_counts[1, 8] == 2 and st.output_counts[1, 9] == 1
    assert st.prompt_mask[1].nonzero().flatten().tolist() == [1, 2]
    # a request without penalties reusing the slot gets a clean row
    st.admit(1, [7], [], track_penalties=False)
    assert int(st.output_counts[1].sum()) == 0 and not st.prompt_mask[1].any()
    assert (st.history[1] == -1).all() and st.last_token[1] == 7


def test_penalty_buffers_are_lazy():
    st = SlotState(2, V, 4, CPU)
    st.admit(0, [1], [], track_penalties=False)
    assert st.output_counts is None and st.prompt_mask is None
    st.record(torch.tensor([0]), torch.tensor([3]), torch.tensor([0]))  # no counts, still fine
    with pytest.raises(RuntimeError):
        Sampler(CPU).process(rand_logits(1), batch_for([SamplingParams(presence_penalty=1.0)], slots=[0]), st)


def test_penalties_read_counts_recorded_on_device():
    """Async-scheduling case: the host never learns the token, yet the next step penalizes it."""
    st = SlotState(2, V, 16, CPU)
    st.admit(1, [0], [], track_penalties=True)
    sampler = Sampler(CPU, seed=0)
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)]
    batch = batch_for(params, slots=[1])
    logits = torch.zeros(1, V)
    logits[0, 10], logits[0, 20], logits[0, 30] = 3.0, 2.5, 2.2
    seq = []
    for step in range(3):
        ids = sampler(logits.clone(), batch, st)
        st.record(batch.slots, ids, torch.full((1,), step))
        seq.append(ids)  # stays on device; no host read between steps
    assert torch.cat(seq).tolist() == [10, 20, 30]
    assert st.history[1, :3].tolist() == [10, 20, 30]


def test_build_flags_and_bias():
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 1.5}),
        SamplingParams(top_k=5, top_p=0.9, min_p=0.1, frequency_penalty=0.1, seed=3),
    ]
    gens = [None, make_generator(3, CPU)]
    b = SamplingBatch.build(params, [4, 1], gens, [(1, 2, float("-inf"))], CPU)
    assert (b.all_greedy, b.any_penalty, b.any_top_k, b.any_top_p, b.any_min_p, b.any_seeded) == (
        False, True, True, True, True, True,
    )
    assert b.temperature.dtype == torch.float32 and b.top_k.dtype == torch.int64
    assert b.slots.tolist() == [4, 1] and b.top_k.tolist() == [0, 5]
    assert b.bias_rows.tolist() == [0, 1] and b.bias_cols.tolist() == [3, 2]
    assert b.bias_vals[0] == 1.5 and math.isinf(b.bias_vals[1])
    plain = SamplingBatch.build([SamplingParams()], [0], [None], [], CPU)
    assert plain.bias_vals is None and not (plain.any_penalty or plain.any_top_k or plain.any_seeded)
    empty = SamplingBatch.build([], [], [], [], CPU)
    assert empty.temperature.shape == (0,) and empty.slots.shape == (0,)
