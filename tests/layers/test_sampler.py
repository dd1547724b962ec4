"""Sampler and SlotState: filters against transformers' logits processors, penalties and bias
against naive references, seeded reproducibility across batch layouts, and the sampled
distribution against softmax.

The second half checks the sort-free filters against `OldSampler` (the sort-based
implementation they replaced, kept here as the reference), for both backends: 'torch' on the
CPU and 'triton' (runner/kernels/sampling.py), compiled on CUDA or under Triton's interpreter
(TRITON_INTERPRET=1, CPU tensors) without it."""

from __future__ import annotations

import math
import textwrap

from tests.support.triton_interpreter import (
    compile_offline,
    has_nvidia_backend,
    interpret_without_cuda,
)

_CUDA = interpret_without_cuda()  # before runner.kernels.sampling is imported

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from runner.kernels.gpu_info import num_sms
from runner.layers.noise import NOISE_SALTS, race_noise
from runner.layers.sampler import Sampler
from runner.layers.sampling_batch import SamplingBatch
from runner.layers.sampling_torch import TorchSampling
from runner.layers.slot_state import SlotState
from streaming.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 97  # odd, small vocabulary


def rand_logits(b: int, v: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


def seeds_for(params: list[SamplingParams], salt: int = 0) -> list[int]:
    """Race-noise seeds as the runner assigns them: the request's seed, else a (here
    deterministic) seed of its own."""
    return [p.seed if p.seed is not None else 10**6 + 7919 * i + salt for i, p in enumerate(params)]


def build(params, slots, device, extra_bias=(), counters=None, salt: int = 0) -> SamplingBatch:
    counters = [0] * len(params) if counters is None else counters
    return SamplingBatch.build(params, list(slots), seeds_for(params, salt), counters, list(extra_bias), device)


def batch_for(params: list[SamplingParams], slots=None, extra_bias=(), counters=None) -> SamplingBatch:
    return build(params, list(range(len(params))) if slots is None else slots, CPU, extra_bias, counters)


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
    ours = Sampler(CPU).process(logits.clone(), batch_for(params), fresh_state())
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
    ids = Sampler(CPU)(logits.clone(), b, fresh_state())
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
    sampler = Sampler(device)
    slots = [(3 * i + 1) % (b + 3) for i in range(b)]  # slot != row on purpose
    params = []
    for (seed, key), s in zip(layout, slots):
        st.admit(s, [key, key + 1], [], track_penalties=True)
        params.append(SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.3, seed=seed))
    out: dict[int, list[int]] = {key: [] for _, key in layout}
    for step in range(steps):
        # counter = output index; unseeded rows' noise seeds differ per layout (salt)
        batch = build(params, slots, device, counters=[step] * b, salt=17 * b)
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
    ids = Sampler(CPU)(base.expand(n, -1).clone(), b, SlotState(1, 8, 4, CPU))
    counts = torch.bincount(ids, minlength=8).double()
    assert counts[probs == 0].sum() == 0, "a filtered token was sampled"
    assert (counts / n - probs.double()).abs().max() < 0.015
    dof = int((probs > 0).sum()) - 1
    assert _chi_square(counts, probs.double(), n) < 4 * dof + 20  # far beyond p=1e-4 critical values


def test_seeded_rows_follow_the_distribution_too():
    base = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 4000
    b = batch_for([SamplingParams(seed=i) for i in range(n)], slots=[-1] * n)
    ids = Sampler(CPU)(base.expand(n, -1).clone(), b, SlotState(1, 4, 4, CPU))
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
    sampler = Sampler(CPU)
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
    b = SamplingBatch.build(params, [4, 1], [77, 3], [5, 9], [(1, 2, float("-inf"))], CPU)
    assert (b.all_greedy, b.any_penalty, b.any_top_k, b.any_top_p, b.any_min_p) == (False, True, True, True, True)
    assert b.seeds.tolist() == [77, 3] and b.counters.tolist() == [5, 9] and b.seeds.dtype == torch.int64
    assert b.temperature.dtype == torch.float32 and b.top_k.dtype == torch.int64
    assert b.slots.tolist() == [4, 1] and b.top_k.tolist() == [0, 5]
    assert b.bias_rows.tolist() == [0, 1] and b.bias_cols.tolist() == [3, 2]
    assert b.bias_vals[0] == 1.5 and math.isinf(b.bias_vals[1])
    plain = SamplingBatch.build([SamplingParams()], [0], [1], [0], [], CPU)
    assert plain.bias_vals is None and not (plain.any_penalty or plain.any_top_k)
    empty = SamplingBatch.build([], [], [], [], [], CPU)
    assert empty.temperature.shape == (0,) and empty.slots.shape == (0,)


# =========================================================================== sort-free filters
# The reference: the sort-based sampler this module used before the threshold search.


class OldSampler:
    """The previous implementation, verbatim apart from the class name and the race noise
    (now runner.layers.noise.race_noise): penalties, full ascending sort for top-k / top-p,
    softmax, min-p, exponential race. Also timed by
    deploy/bench/sampler.py. Not used by the server."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, state: SlotState) -> torch.Tensor:
        self._penalize_and_bias(logits, batch, state)
        greedy_ids = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_ids
        _, probs = self._warp(logits, batch)
        sampled = self._race(probs, batch)
        return torch.where(batch.temperature == 0, greedy_ids, sampled)

    def process(self, logits: torch.Tensor, batch: SamplingBatch, state: SlotState) -> torch.Tensor:
        self._penalize_and_bias(logits, batch, state)
        if batch.all_greedy:
            return logits
        out, _ = self._warp(logits, batch)
        return out

    @staticmethod
    def _penalize_and_bias(logits: torch.Tensor, batch: SamplingBatch, state: SlotState) -> None:
        if batch.any_penalty:
            prompt_mask, counts = state.gather_penalty_rows(batch.slots)
            seen = prompt_mask | (counts > 0)
            rep = batch.repetition_penalty.unsqueeze(1)
            penalized = torch.where(logits < 0, logits * rep, logits / rep)
            logits.copy_(torch.where(seen, penalized, logits))
            counts_f = counts.to(logits.dtype)
            logits -= batch.frequency_penalty.unsqueeze(1) * counts_f
            logits -= batch.presence_penalty.unsqueeze(1) * (counts_f > 0).to(logits.dtype)
        if batch.bias_vals is not None:
            logits.index_put_((batch.bias_rows, batch.bias_cols), batch.bias_vals, accumulate=True)

    @staticmethod
    def _warp(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        v = logits.shape[1]
        temp = torch.where(batch.temperature == 0, 1.0, batch.temperature)
        logits.div_(temp.unsqueeze(1))
        if batch.any_top_k or batch.any_top_p:
            sorted_vals, sorted_idx = logits.sort(dim=-1)
            if batch.any_top_k:
                k = batch.top_k
                k = torch.where((k <= 0) | (k > v), v, k)
                kth = sorted_vals.gather(1, (v - k).unsqueeze(1))
                logits.masked_fill_(logits < kth, float("-inf"))
                sorted_vals.masked_fill_(sorted_vals < kth, float("-inf"))
            if batch.any_top_p:
                cum = sorted_vals.softmax(dim=-1).cumsum(dim=-1)
                top_p = batch.top_p.unsqueeze(1)
                drop_sorted = (cum <= 1 - top_p) & (top_p < 1)
                drop_sorted[:, -1] = False
                drop = torch.empty_like(drop_sorted).scatter_(1, sorted_idx, drop_sorted)
                logits.masked_fill_(drop, float("-inf"))
        probs = logits.softmax(dim=-1)
        if batch.any_min_p:
            thresh = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            drop = probs < thresh
            logits.masked_fill_(drop, float("-inf"))
            probs.masked_fill_(drop, 0.0)
        return logits, probs

    def _race(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        q = race_noise(batch.seeds, batch.counters, probs.shape[1])  # the current noise source
        return probs.div_(q).argmax(dim=-1)


# --------------------------------------------------------------------------- triton backend setup

KDEV = torch.device("cuda" if _CUDA else "cpu")  # where the triton backend runs
try:
    import triton  # noqa: F401

    from runner.kernels import sampling as SK
except ImportError:  # CPU CI without triton
    SK = None
if SK is not None and not _CUDA and type(SK._filter_sample_kernel).__name__ != "InterpretedFunction":
    SK = None  # imported before TRITON_INTERPRET was set: run this file on its own
needs_triton = pytest.mark.skipif(SK is None, reason="triton missing (or imported without the interpreter on CPU)")


def _patch_interpreter() -> None:
    """numpy >= 2.4 refuses int() of the 1-element arrays the Triton 3.6 interpreter passes to
    range() for runtime loop bounds; give its tensors an __index__ that reads element 0."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_omnistream_index_patch", False):
        return
    orig = interp._patch_lang_tensor

    def patch(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch
    interp._omnistream_index_patch = True


if SK is not None and not _CUDA:
    _patch_interpreter()

# Small chunks and scratch so that V of a few hundred already takes the pivot-pass path (the
# defaults need V > 8192 for it), next to the defaults.
SMALL_KERNEL_CFG = {"BLOCK_P": 32, "NP": 8, "BLOCK_S": 64, "C": 64}


@pytest.fixture
def kernel_cfg(request):
    """Tuning tables whose sampling launch configuration is the untuned one with request.param's
    fields replaced: a backend built on them (Sampler(..., tables=)) launches with it."""
    import dataclasses

    from runner.kernels.tuning import GENERIC

    return dataclasses.replace(GENERIC, sampling=dataclasses.replace(GENERIC.sampling, **request.param))


# --------------------------------------------------------------------------- cases


def kept_upper_set_of(ref_row: torch.Tensor, proc_row: torch.Tensor) -> torch.Tensor:
    """The kept set of the threshold semantics implied by a reference kept set: every token
    whose processed value is >= the smallest value the reference kept (the reference may keep
    only part of a run of ties at that value; the threshold search keeps all of it)."""
    keep = torch.isfinite(ref_row)
    return proc_row >= proc_row[keep].min()


def assert_threshold_semantics(ours: torch.Tensor, ref: torch.Tensor, scaled: torch.Tensor, exact: bool) -> None:
    """ours/ref: processed [B, V] (-inf = dropped); scaled: the logits after penalties, bias and
    temperature (what both filter). exact: no ties in the data, the kept sets must be equal."""
    for i in range(ours.shape[0]):
        mine = torch.isfinite(ours[i])
        theirs = torch.isfinite(ref[i])
        if exact:
            assert torch.equal(mine, theirs), f"row {i}: kept {int(mine.sum())} vs reference {int(theirs.sum())}"
        else:
            want = kept_upper_set_of(ref[i], scaled[i]) & torch.isfinite(scaled[i])
            assert torch.equal(mine, want), f"row {i}: kept {int(mine.sum())}, threshold semantics {int(want.sum())}"
            assert bool((theirs <= mine).all()), f"row {i}: dropped a token the reference kept"
        assert torch.equal(ours[i][mine], scaled[i][mine]), f"row {i}: kept values differ from the scaled logits"


def random_params(n: int, seed: int, vocab: int) -> list[SamplingParams]:
    g = torch.Generator().manual_seed(seed)

    def u(a: float, b: float) -> float:
        return float(torch.empty(1).uniform_(a, b, generator=g))

    params = []
    for i in range(n):
        kind = i % 6
        params.append(
            SamplingParams(
                temperature=[0.6, u(0.2, 2.0), 1.0, 0.0, u(0.5, 1.5), 0.6][kind],
                top_k=[0, int(torch.randint(1, 60, (1,), generator=g)), 0, 5, vocab + 3, 0][kind],
                top_p=[0.8, u(0.3, 1.0), u(0.05, 0.99), 0.9, 1.0, u(0.5, 0.95)][kind],
                min_p=[0.0, u(0.0, 0.3), 0.0, 0.0, u(0.0, 0.2), 0.0][kind],
            )
        )
    return params


def make_logits(kind: str, b: int, v: int, seed: int) -> tuple[torch.Tensor, bool]:
    """(logits [B, V], exact) for a named shape of logits; exact = no ties."""
    g = torch.Generator().manual_seed(seed)
    if kind == "peaked":  # a trained LM: a few tokens far above the rest
        x = torch.randn(b, v, generator=g) * 2.0
        x[:, : max(1, v // 50)] += 8.0 * torch.rand(b, max(1, v // 50), generator=g)
        return x, True
    if kind == "flat":  # random weights: the nucleus is most of the vocabulary
        return torch.randn(b, v, generator=g) * 0.02, True
    if kind == "wide":  # values over thousands: most tokens are massless after exp
        return torch.randn(b, v, generator=g) * 300.0, True
    if kind == "banned":  # runner bias: -inf on a few ids (EOS while min_tokens), some +-100
        x = torch.randn(b, v, generator=g) * 3.0
        x[:, :3] = float("-inf")
        x[:, 5] += 100.0
        x[1::2, 7] -= 100.0
        return x, True
    if kind == "ties":  # quantised: long runs of equal values at every threshold
        return torch.randint(-4, 5, (b, v), generator=g).float() * 0.25, False
    raise ValueError(kind)


KINDS = ["peaked", "flat", "wide", "banned", "ties"]


def _process_both(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], device: torch.device):
    """(ours, reference, scaled logits), all [B, V] on the CPU."""
    b = len(params)
    batch = build(params, range(b), device)
    st = SlotState(b, logits.shape[1], 4, device)
    ours = sampler.process(logits.clone().to(device), batch, st).cpu()
    cpu_batch = build(params, range(b), CPU)
    ref = OldSampler(CPU).process(logits.clone(), cpu_batch, SlotState(b, logits.shape[1], 4, CPU))
    temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params]).unsqueeze(1)
    return ours, ref, logits / temp


# --------------------------------------------------------------------------- torch backend


def test_order_key_is_monotone_and_merges_signed_zeros():
    from runner.layers.radix_select import order_key

    tiny = torch.finfo(torch.float32).tiny
    inf = float("inf")
    vals = torch.tensor([-inf, -3.4e38, -1.0, -tiny, -1e-45, -0.0, 0.0, 1e-45, tiny, 1.0, 3.4e38, inf])
    keys = order_key(vals.clone()).tolist()
    assert keys == sorted(keys)
    assert keys[5] == keys[6] == 0  # -0.0 == +0.0
    assert len(set(keys)) == len(keys) - 1
    x = torch.randn(10_000) * torch.logspace(-30, 30, 10_000)
    k = order_key(x.clone())
    assert torch.equal(torch.argsort(x, stable=True), torch.argsort(k, stable=True))


@pytest.mark.parametrize("kind", KINDS)
def test_torch_backend_matches_old_sampler(kind):
    """Per-row random parameters on 5 shapes of logits: same kept sets (ties: the whole run at
    the threshold), kept values equal bit for bit."""
    v = 3001 if kind != "ties" else 997
    params = random_params(24, seed=KINDS.index(kind), vocab=v)
    logits, exact = make_logits(kind, len(params), v, seed=10 + KINDS.index(kind))
    ours, ref, scaled = _process_both(Sampler(CPU, backend="torch"), logits, params, CPU)
    assert_threshold_semantics(ours, ref, scaled, exact)


def test_torch_backend_large_vocab_orpheus_settings():
    """V = 156940 (16-bit radix digits), Orpheus sampling (T 0.6, top-p 0.8, repetition 1.1):
    flat rows (nucleus > 100k tokens) and peaked rows. Differences from the sort-based
    reference are allowed only where the reference's own float32 cumsum cannot tell: the
    mass above the token is within 1e-5 * Z of the bound (fp64 check)."""
    v, b = 156940, 4
    params = [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1)] * b
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(b, v, generator=g)
    logits[:2] *= 0.02  # flat
    logits[2:] *= 3.0  # peaked
    logits[3, :40] += 12.0
    st = SlotState(b, v, 8, CPU)
    st_ref = SlotState(b, v, 8, CPU)
    for s in range(b):
        prompt = torch.randint(0, v, (100,), generator=g).tolist()
        st.admit(s, prompt, [], track_penalties=True)
        st_ref.admit(s, prompt, [], track_penalties=True)
    batch = batch_for(params)
    ours = Sampler(CPU, backend="torch").process(logits.clone(), batch, st)
    ref = OldSampler(CPU).process(logits.clone(), batch, st_ref)
    scaled = logits.clone()
    OldSampler._penalize_and_bias(scaled, batch, st_ref)
    scaled /= 0.6
    for i in range(b):
        mine, theirs = torch.isfinite(ours[i]), torch.isfinite(ref[i])
        assert torch.equal(ours[i][mine], scaled[i][mine])
        differ = (mine ^ theirs).nonzero().flatten()
        assert differ.numel() <= 4, f"row {i}: {differ.numel()} tokens differ"
        if differ.numel():
            y = scaled[i].double()
            e = (y - y.max()).exp()
            z = e.sum()
            for t in differ.tolist():
                above = e[y > y[t]].sum()
                assert abs(float(above / z) - 0.8) < 1e-5, f"row {i} token {t}: not a rounding tie"
        assert 1 <= int(mine.sum()) <= v
    assert int(torch.isfinite(ours[0]).sum()) > 100_000  # the flat case really is wide


def test_torch_backend_sampling_ids_equal_old_sampler():
    """Same race noise and same kept sets => the race picks the same token as the
    sort-based sampler (mixed greedy / sampling / seeded rows, penalties, bias)."""
    v, b = 2001, 32
    params = random_params(b, seed=3, vocab=v)
    params[5] = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, seed=11)
    params[9] = SamplingParams(temperature=0.9, frequency_penalty=0.5, presence_penalty=-0.3, logit_bias={3: 5.0})
    slots = list(range(b))
    st, st_ref = SlotState(b, v, 16, CPU), SlotState(b, v, 16, CPU)
    for s in slots:
        st.admit(s, [s, s + 1, 2 * s], [], track_penalties=True)
        st_ref.admit(s, [s, s + 1, 2 * s], [], track_penalties=True)
    new, old = Sampler(CPU, backend="torch"), OldSampler(CPU)
    for step in range(6):
        batch = build(params, slots, CPU, [(2, 0, float("-inf"))], counters=[step] * b)
        batch_ref = build(params, slots, CPU, [(2, 0, float("-inf"))], counters=[step] * b)
        logits = make_logits(["peaked", "flat", "banned"][step % 3], b, v, seed=100 + step)[0]
        ids = new(logits.clone(), batch, st)
        ids_ref = old(logits.clone(), batch_ref, st_ref)
        assert torch.equal(ids, ids_ref), f"step {step}"
        st.record(batch.slots, ids, torch.full((b,), step))
        st_ref.record(batch_ref.slots, ids_ref, torch.full((b,), step))


EDGE_PARAMS = [
    SamplingParams(top_p=1.0),
    SamplingParams(top_k=0),
    SamplingParams(top_k=1),
    SamplingParams(top_k=V),
    SamplingParams(top_k=V + 50),
    SamplingParams(top_k=1, top_p=0.01, min_p=1.0),
    SamplingParams(top_p=1e-6),
    SamplingParams(top_k=3, top_p=0.999, min_p=0.5, temperature=0.3),
]


def _edge_logits() -> torch.Tensor:
    x = rand_logits(len(EDGE_PARAMS), seed=21)
    return x


def _check_edges(sampler: Sampler, device: torch.device) -> None:
    logits = _edge_logits()
    ours, ref, scaled = _process_both(sampler, logits, EDGE_PARAMS, device)
    assert_threshold_semantics(ours, ref, scaled, exact=True)
    # all -inf but one: that one survives every filter and is the only possible draw
    one = torch.full((len(EDGE_PARAMS), V), float("-inf"))
    one[torch.arange(len(EDGE_PARAMS)), torch.arange(len(EDGE_PARAMS)) * 7] = torch.randn(len(EDGE_PARAMS))
    batch = build(EDGE_PARAMS, range(len(EDGE_PARAMS)), device)
    st = SlotState(len(EDGE_PARAMS), V, 4, device)
    kept = sampler.process(one.clone().to(device), batch, st).cpu()
    assert torch.equal(torch.isfinite(kept), torch.isfinite(one))
    ids = sampler(one.clone().to(device), batch, st).cpu()
    assert ids.tolist() == [7 * i for i in range(len(EDGE_PARAMS))]


def _check_ties(sampler: Sampler, device: torch.device) -> None:
    """Documented difference: a run of equal values at the threshold is kept whole, in any
    order of the row; transformers may cut it (here: the flat row and the tied top-k row)."""
    x = torch.zeros(4, V)
    x[1, :10] = 5.0  # 10 tokens tie for the top (94% of the mass); top_p 0.3 needs 4 of them
    x[2] = torch.arange(V).float().remainder(7)  # runs of 14 equal values
    x[3] = rand_logits(1, seed=3)[0]
    x[3, 20:25] = x[3].max() + 1.0  # 5 tie for the k = 3rd place (HF keeps ties for top-k too)
    params = [SamplingParams(top_p=0.5), SamplingParams(top_p=0.3), SamplingParams(top_p=0.6), SamplingParams(top_k=3)]
    ours, ref, scaled = _process_both(sampler, x, params, device)
    assert_threshold_semantics(ours, ref, scaled, exact=False)
    assert bool(torch.isfinite(ours[0]).all())  # a flat row keeps everything
    assert torch.isfinite(ours[1]).nonzero().flatten().tolist() == list(range(10))
    assert torch.isfinite(ours[3]).nonzero().flatten().tolist() == list(range(20, 25))
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    ours_p, _, _ = _process_both(sampler, x[:, perm], params, device)
    assert torch.equal(torch.isfinite(ours_p), torch.isfinite(ours)[:, perm])


def test_torch_backend_edge_cases():
    _check_edges(Sampler(CPU, backend="torch"), CPU)


def test_torch_backend_ties_keep_the_whole_run():
    _check_ties(Sampler(CPU, backend="torch"), CPU)


def test_build_sets_the_finer_flags():
    b = batch_for([SamplingParams(temperature=0.7, repetition_penalty=1.1), SamplingParams(temperature=0.0)])
    assert (b.any_greedy, b.any_repetition, b.any_frequency, b.any_presence) == (True, True, False, False)
    b = batch_for([SamplingParams(frequency_penalty=0.1), SamplingParams(presence_penalty=0.2)])
    assert (b.any_greedy, b.any_repetition, b.any_frequency, b.any_presence) == (False, False, True, True)


def test_backend_choice():
    assert Sampler(CPU).backend == "torch"
    with pytest.raises(ValueError):
        Sampler(CPU, backend="cuda")


# --------------------------------------------------------------------------- triton backend


@needs_triton
@pytest.mark.parametrize("kernel_cfg", [{}, SMALL_KERNEL_CFG], indirect=True, ids=["default", "multipass"])
@pytest.mark.parametrize("kind", KINDS)
def test_triton_filter_matches_old_sampler(kind, kernel_cfg):
    v = (1501 if _CUDA else 601) if kind != "ties" else 499  # the interpreter runs ~1 ms per op
    params = random_params(12 if _CUDA else 8, seed=30 + KINDS.index(kind), vocab=v)
    logits, exact = make_logits(kind, len(params), v, seed=40 + KINDS.index(kind))
    ours, ref, scaled = _process_both(Sampler(KDEV, backend="triton", tables=kernel_cfg), logits, params, KDEV)
    assert_threshold_semantics(ours, ref, scaled, exact)


@needs_triton
@pytest.mark.parametrize("kernel_cfg", [SMALL_KERNEL_CFG], indirect=True, ids=["multipass"])
def test_triton_edge_cases_and_ties(kernel_cfg):
    _check_edges(Sampler(KDEV, backend="triton", tables=kernel_cfg), KDEV)
    _check_ties(Sampler(KDEV, backend="triton", tables=kernel_cfg), KDEV)


@needs_triton
@pytest.mark.parametrize("kernel_cfg", [SMALL_KERNEL_CFG], indirect=True, ids=["multipass"])
def test_triton_race_picks_the_torch_backend_token(kernel_cfg):
    """Given the same noise, the fused race draws the same token as the torch backend (greedy
    rows: the argmax)."""
    v, b = (700, 18) if _CUDA else (400, 12)
    params = random_params(b, seed=50, vocab=v)
    batch = build(params, range(b), KDEV)
    for kind in ["peaked", "flat", "banned"]:
        logits = make_logits(kind, b, v, seed=60)[0]
        q = torch.empty(b, v).exponential_(generator=torch.Generator().manual_seed(1))
        q[0, :] = 0.0  # zeros are clamped, never NaN
        ids = SK.filter_and_sample(logits.clone().to(KDEV), batch, q.clone().to(KDEV), kernel_cfg.sampling).cpu()
        cpu_batch = build(params, range(b), CPU)
        ref = Sampler(CPU, backend="torch")
        want = TorchSampling(CPU).filter(logits.clone(), cpu_batch, q.clone())
        want = torch.where(cpu_batch.temperature == 0, logits.argmax(-1), want)
        if not torch.equal(ids, want):
            # The GPU's exp / division differ from the CPU's in the last bits: a different winner
            # is only acceptable when its race score ties the CPU winner's to ~1e-6 and it survived.
            proc = ref.process(logits.clone(), cpu_batch, SlotState(b, v, 4, CPU))
            e = (proc - proc.amax(-1, keepdim=True)).exp()
            score = e / q.clamp(min=torch.finfo(torch.float32).tiny)
            for i in (ids != want).nonzero().flatten().tolist():
                assert torch.isfinite(proc[i, ids[i]]), (kind, i)
                assert float(score[i, ids[i]]) >= float(score[i, want[i]]) * (1 - 1e-6), (kind, i)


@pytest.mark.gpu
@pytest.mark.skipif(SK is None or not _CUDA, reason="needs CUDA (too slow for the interpreter)")
def test_triton_large_vocab_orpheus_settings_cuda():
    """V = 156940 on the GPU with the default launch config (and 8 vs 16 warps: B <= / > the SM
    count): Orpheus rows (T 0.6, top-p 0.8, repetition 1.1) flat and peaked, plus random rows.
    The triton backend against the sort-based reference (on the GPU: its float32 cumsum there)
    and against the torch backend. Differences only at rounding ties of the cumulative mass:
    within 1e-4 of the bound in fp64 (p * the mass top-k left), or exp(y - max) within 1e-5
    of min_p."""
    v = 156940
    for b in (16, num_sms(KDEV) + 4):
        g = torch.Generator().manual_seed(b)
        params = [SamplingParams(**dict(temperature=0.6, top_p=0.8, repetition_penalty=1.1))] * 8
        params += random_params(b - 8, seed=b, vocab=v)
        logits = torch.randn(b, v, generator=g)
        logits[:4] *= 0.02  # flat
        logits[4:8] *= 3.0
        logits[6:8, :30] += 10.0  # peaked
        logits[8:] *= 2.0
        prompts = [torch.randint(0, v, (100,), generator=g).tolist() for _ in range(b)]

        def run(sampler, dev):
            st = SlotState(b, v, 8, dev)
            for s in range(b):
                st.admit(s, prompts[s], [], True)
            batch = build(params, range(b), dev)
            return sampler.process(logits.clone().to(dev), batch, st).cpu(), st, batch

        outs = {name: run(smp, KDEV)[0] for name, smp in (("triton", Sampler(KDEV, backend="triton")),
                                                           ("torch", Sampler(KDEV, backend="torch")),
                                                           ("old", OldSampler(KDEV)))}
        scaled = logits.clone()
        _, st, cpu_batch = run(Sampler(CPU, backend="torch"), CPU)
        OldSampler._penalize_and_bias(scaled, cpu_batch, st)
        scaled /= torch.where(cpu_batch.temperature == 0, 1.0, cpu_batch.temperature).unsqueeze(1)
        for i in range(b):
            mine = torch.isfinite(outs["triton"][i])
            assert torch.equal(outs["triton"][i][mine], scaled[i][mine])
            y = scaled[i].double()
            e = (y - y.max()).exp()
            k = params[i].top_k
            z = e[y >= y.topk(k).values[-1]].sum() if 0 < k < v else e.sum()
            for other in ("old", "torch"):
                differ = (mine ^ torch.isfinite(outs[other][i])).nonzero().flatten()
                assert differ.numel() <= 32, f"B={b} {other} row {i}: {differ.numel()} tokens differ"
                for t in differ.tolist():
                    gap = abs(float(e[y > y[t]].sum() / z) - params[i].top_p)  # top-p tie
                    min_p_tie = abs(float(e[t]) - params[i].min_p) < 1e-5 * params[i].min_p
                    assert gap < 1e-4 or min_p_tie, f"B={b} {other} row {i} token {t}: {gap}"


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sampling_never_syncs_with_the_host_cuda(backend):
    """No .item() / nonzero / bincount-style reads: the whole step must queue without waiting."""
    if backend == "triton" and SK is None:
        pytest.skip("triton missing")
    dev = KDEV
    b, v = 8, 5003
    params = random_params(b, seed=2, vocab=v)
    params[1] = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, frequency_penalty=0.2, seed=3)
    st = SlotState(b, v, 8, dev)
    for s in range(b):
        st.admit(s, [s, s + 7], [], track_penalties=True)
    batch = build(params, range(b), dev, [(0, 5, float("-inf"))])
    sampler = Sampler(dev, backend=backend)
    logits = torch.randn(b, v, device=dev)
    sampler(logits.clone(), batch, st)  # compile / warm up outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampler(logits.clone(), batch, st)
        sampler.process(logits.clone(), batch, st)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_triton
def test_triton_penalties_equal_torch_bit_for_bit():
    v, b = 3001, 6
    g = torch.Generator().manual_seed(8)
    params = [
        SamplingParams(repetition_penalty=1.1),
        SamplingParams(repetition_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(presence_penalty=-1.5),
        SamplingParams(frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=3.0),
        SamplingParams(),
        SamplingParams(repetition_penalty=1.3),
    ]
    slots = [3, 0, -1, 5, 2, 1]  # padding row included
    states = []
    for dev in (CPU, KDEV):
        st = SlotState(6, v, 32, dev)
        for s in range(6):
            st.admit(s, torch.randint(0, v, (40,), generator=torch.Generator().manual_seed(s)).tolist(), [], True)
        for step in range(20):
            toks = torch.randint(0, v, (6,), generator=torch.Generator().manual_seed(100 + step))
            toks[::2] %= 50  # repeats
            st.record(torch.arange(6, device=dev), toks.to(dev), torch.full((6,), step, device=dev))
        states.append(st)
    logits = torch.randn(b, v, generator=g) * 4
    logits[:, :5] = 0.0
    outs = []
    for dev, st, backend in ((CPU, states[0], "torch"), (KDEV, states[1], "triton")):
        batch = build(params, slots, dev)
        x = logits.clone().to(dev)
        Sampler(dev, backend=backend)._penalize_and_bias(x, batch, st)
        outs.append(x.cpu())
    assert torch.equal(outs[0], outs[1])
    ref = logits.clone()
    OldSampler._penalize_and_bias(ref, build(params, slots, CPU), states[0])
    assert torch.equal(outs[0], ref)
    # a column span (the runner's constrained rows): the kernel reads the state from col0 on
    lo, hi = 1237, 2900
    for dev, st, backend in ((CPU, states[0], "torch"), (KDEV, states[1], "triton")):
        x = logits[:, lo:hi].clone().to(dev)
        Sampler(dev, backend=backend).penalize(x, build(params, slots, dev), st, col0=lo)
        assert torch.equal(x.cpu(), outs[0][:, lo:hi])


@needs_triton
def test_triton_sampler_end_to_end_matches_transformers_and_seeds():
    """The triton backend through Sampler: HF filters per row, greedy rows, seeded rows."""
    g = torch.Generator().manual_seed(1)
    params = [
        SamplingParams(
            temperature=float(torch.empty(1).uniform_(0.2, 2.0, generator=g)),
            top_k=int(torch.randint(0, 60, (1,), generator=g)),
            top_p=float(torch.empty(1).uniform_(0.3, 1.0, generator=g)),
            min_p=float(torch.empty(1).uniform_(0.0, 0.3, generator=g)),
        )
        for _ in range(10)
    ]
    logits = rand_logits(len(params), seed=2)
    batch = build(params, range(len(params)), KDEV)
    ours = Sampler(KDEV, backend="triton").process(logits.clone().to(KDEV), batch, SlotState(10, V, 4, KDEV)).cpu()
    for i, p in enumerate(params):
        assert_same_filtered(ours[i], hf_chain(logits[i], p))
    mixed = [SamplingParams(temperature=0.0), SamplingParams(top_k=3), SamplingParams(temperature=0.0, top_p=0.2)]
    b = build(mixed, [0, 1, 2], KDEV)
    x = rand_logits(3, seed=7)
    ids = Sampler(KDEV, backend="triton")(x.clone().to(KDEV), b, SlotState(3, V, 4, KDEV)).cpu()
    assert ids[0] == x[0].argmax() and ids[2] == x[2].argmax()
    assert int(ids[1]) in set(x[1].topk(3).indices.tolist())


@needs_triton
def test_triton_seeded_rows_batch_independent():
    def run(layout):
        b = len(layout)
        sampler = Sampler(KDEV, backend="triton")
        params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=s) for s, _ in layout]
        st = SlotState(b, V, 8, KDEV)
        out = []
        for step in range(5):
            batch = build(params, range(b), KDEV, counters=[step] * b, salt=b)
            logits = torch.stack([rand_logits(1, seed=1000 * key + step, scale=1.0)[0] for _, key in layout]).to(KDEV)
            out.append(sampler(logits, batch, st).cpu().tolist())
        return [row[[k for _, k in layout].index(0)] for row in out]

    alone = run([(1234, 0)])
    assert run([(None, 1), (1234, 0), (7, 3), (None, 4)]) == alone
    assert run([(5, 3), (None, 1), (1234, 0)]) == alone


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import dataclasses
    import itertools
    from runner.kernels import sampling as m
    from tests.support.triton_interpreter import compile_sm90

    def build(fn, sig, consts, warps, **opts):
        return compile_sm90(fn, sig, consts, num_warps=warps, **opts)

    cfg = dataclasses.asdict(m.DEFAULT_TUNING)
    sig = dict(y_ptr="*fp32", stride_y="i32", q_ptr="*fp32", stride_q="i32", ids_ptr="*i64", temp_ptr="*fp32",
               topk_ptr="*i64", topp_ptr="*fp32", minp_ptr="*fp32", sk_ptr="*i32", V="i32",
               has_top_k="i32", has_top_p="i32", has_min_p="i32")  # the filter flags: one variant for all
    for sample, warps in itertools.product((False, True), {cfg["num_warps"], cfg["num_warps_small"]}):
        build(m._filter_sample_kernel, sig, dict(SAMPLE=sample, BLOCK_P=cfg["BLOCK_P"], NP=cfg["NP"],
              BLOCK_S=cfg["BLOCK_S"], C=cfg["C"], MAX_PASSES=cfg["MAX_PASSES"]), warps)
    psig = dict(x_ptr="*fp32", stride_x="i32", rows_ptr="*i64", mask_ptr="*u8", stride_mask="i32", cnt_ptr="*i32",
                stride_cnt="i32", rep_ptr="*fp32", freq_ptr="*fp32", pres_ptr="*fp32", V="i32",
                has_rep="i32", has_freq="i32", has_pres="i32")
    k = build(m._penalty_kernel, psig, dict(BLOCK=m._PENALTY_BLOCK), 4, enable_fp_fusion=False)
    ptx = k.asm["ptx"]
    # bit-exact with torch: IEEE division, no contraction of x - f * c into an FMA
    assert "div.full" not in ptx and "div.approx" not in ptx and "fma.rn.f32" not in ptx
    rsig = dict(slots_ptr="*i64", tok_ptr="*i64", idx_ptr="*i64", last_ptr="*i64", hist_ptr="*i64", stride_h="i32",
                cnt_ptr="*i32", stride_c="i32", B="i32")
    for counts in (False, True):
        build(m._record_kernel, rsig, dict(HAS_COUNTS=counts, BLOCK=m._ROW_BLOCK), 4)
    wsig = dict(x_ptr="*fp32", stride_x="i32", ctr_ptr="*i64", out_ptr="*fp32", stride_o="i32", first_col="i32",
                end_col="i32", CB="i32", GROUPS="i32")
    for end in (False, True):
        build(m._code_window_kernel, wsig, dict(HAS_END=end, BLOCK=1024), 4)
    build(m._code_window_ids_kernel, dict(col_ptr="*i64", ctr_ptr="*i64", out_ptr="*i64", offset="i32", end_id="i32",
          CB="i32", GROUPS="i32", B="i32"), dict(BLOCK=m._ROW_BLOCK), 4)
    print("compiled")
    """
)


@pytest.mark.skipif(SK is None or not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_sampling_kernels_compile_for_sm90():
    """Lowering errors the interpreter cannot see, without a GPU."""
    compile_offline(_COMPILE_SCRIPT, timeout=600)


# --------------------------------------------------------------------------- race noise


def test_race_noise_is_a_keyed_exponential():
    seeds = torch.tensor([0, 1, 2**62 + 5, 1, 12345], dtype=torch.int64)
    ctrs = torch.tensor([0, 0, 3, 1, 7], dtype=torch.int64)
    q = race_noise(seeds, ctrs, 4001)
    assert q.shape == (5, 4001) and q.dtype == torch.float32
    assert bool((q > 0).all()) and bool(torch.isfinite(q).all())
    # a pure function of (seed, counter, token): same key -> same row, in any batch position
    again = race_noise(seeds.flip(0), ctrs.flip(0), 4001).flip(0)
    assert torch.equal(q, again)
    # the counter and the seed both change the row (no reuse across steps or requests)
    assert not torch.equal(q[1], q[3]) and not torch.equal(q[0], q[1])
    # Exp(1): mean 1, variance 1, P(q > 1) = 1/e; rows uncorrelated
    big = race_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096).double()
    assert abs(float(big.mean()) - 1.0) < 0.01 and abs(float(big.var()) - 1.0) < 0.03
    assert abs(float((big > 1).double().mean()) - math.exp(-1)) < 0.005
    c = torch.corrcoef(big[:8])
    assert float((c - torch.eye(8, dtype=c.dtype)).abs().max()) < 0.06


@needs_triton
def test_triton_race_noise_equals_torch():
    seeds = torch.tensor([0, 1, 2**62 + 5, 2**63 - 1, 987654321, 3], dtype=torch.int64)
    ctrs = torch.tensor([0, 5, 3, 2**31 + 9, 7, 100000], dtype=torch.int64)
    v = 5003
    out = torch.empty(6, v, device=KDEV)
    SK.race_noise(seeds.to(KDEV), ctrs.to(KDEV), out, NOISE_SALTS)
    torch.testing.assert_close(out.cpu(), race_noise(seeds, ctrs, v), rtol=1e-6, atol=0)


def test_batch_rows_are_16_byte_aligned_for_any_batch_size():
    """Triton specialises pointers on 16-byte alignment: a row view that is aligned for one
    batch size and not for another would compile a new kernel variant mid-serving."""
    for b in range(1, 10):
        batch = SamplingBatch.build([SamplingParams(top_p=0.5)] * b, list(range(b)), list(range(b)), [0] * b, [], CPU)
        for t in (batch.temperature, batch.top_p, batch.min_p, batch.repetition_penalty, batch.frequency_penalty,
                  batch.presence_penalty, batch.top_k, batch.slots, batch.seeds, batch.counters):
            assert t.data_ptr() % 16 == 0 and t.shape == (b,) and t.stride() == (1,)
        assert batch.top_p.tolist() == [0.5] * b and batch.seeds.tolist() == list(range(b))


@needs_triton
@pytest.mark.parametrize("track", [False, True])
def test_triton_record_equals_torch(track):
    """SlotState.record through one kernel launch: the same rows, history, last tokens and
    counts as the torch ops (padding rows write nothing a real slot can see)."""
    def run(backend: str, dev: torch.device) -> SlotState:
        st = SlotState(6, V, 8, dev, backend=backend)
        for s in range(6):
            st.admit(s, [1 + s, 2], [], track_penalties=track)
        for step, (slots, toks) in enumerate([([3, -1, 0, 5], [11, 13, 12, 96]), ([0, 3, -1, 5], [12, 11, 4, 0]),
                                              ([5, 4, 3, 2, 1, 0], [7, 7, 7, 7, 7, 7])]):
            idx = [step] * len(slots)
            st.record(*(torch.tensor(v, device=dev) for v in (slots, toks, idx)))
        return st

    want, got = run("torch", CPU), run("triton", KDEV)
    assert torch.equal(got.last_token.cpu(), want.last_token) and torch.equal(got.history.cpu(), want.history)
    if track:
        assert torch.equal(got.output_counts.cpu(), want.output_counts)
        assert torch.equal(got.prompt_mask.cpu(), want.prompt_mask)


def test_sampling_table_batch_equals_build():
    """The runner's per-slot table gives the batch SamplingBatch.build gives from the params,
    min_tokens' stop-id bans and logit_bias included."""
    from runner.layers.sampling_batch import SamplingTable

    params = [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1),
              SamplingParams(top_k=5, min_tokens=3, stop_token_ids=[7, 9]),
              SamplingParams(temperature=0.0, logit_bias={4: 2.5, 11: -1.0}, frequency_penalty=0.5),
              SamplingParams(min_p=0.1, presence_penalty=0.2, min_tokens=1, ignore_eos=True, stop_token_ids=[3])]
    slots, seeds, counters = [5, 0, 3, 2], [11, 12, 13, 14], [0, 2, 9, 1]
    table = SamplingTable(6, eos_token_ids=(1,))
    for sl, p, sd in zip(slots, params, seeds):
        table.set(sl, p, sd)
    got = table.batch(slots, counters, params, CPU)
    extra = [(1, t, float("-inf")) for t in (1, 7, 9)]  # row 1: 2 < min_tokens 3; row 3: 1 == min_tokens
    want = SamplingBatch.build(params, slots, seeds, counters, extra, CPU)
    for f in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
              "slots", "seeds", "counters"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    entries = lambda b: sorted(zip(b.bias_rows.tolist(), b.bias_cols.tolist(), b.bias_vals.tolist()))  # noqa: E731
    assert entries(got) == entries(want) and len(entries(got)) == 5
    for flag in ("all_greedy", "any_penalty", "any_top_k", "any_top_p", "any_min_p", "any_greedy", "any_repetition",
                 "any_frequency", "any_presence"):
        assert getattr(got, flag) == getattr(want, flag), flag
