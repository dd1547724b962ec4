"""Code 0's repetition penalty (runner/models/csm_sampling.py Code0Penalty over a SlotState of
code 0's vocabulary) against transformers' RepetitionPenaltyLogitsProcessor on fixed logits and
histories, exactly; the history recorded per slot (padding rows touch only the scratch row),
reset when a slot is admitted again; groups untouched; SamplingParams.validate's family flag."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from runner.layers.sampler import Sampler
from runner.layers.sampling_batch import SamplingBatch
from runner.layers.slot_state import SlotState
from runner.models.csm_sampling import Code0Penalty
from streaming.sampling_params import InvalidRequest, SamplingParams

V0, S, L = 48, 4, 32
CPU = torch.device("cpu")
# slot -> the code-0 ids its request generated (repeats included: each id is penalised once)
HISTORIES = {0: [3, 3, 7, 40, 3], 1: [], 2: [5, 9, 9, 12, 0, 47], 3: [1, 2]}


def backends() -> list:
    out = ["torch"]
    try:
        import triton  # noqa: F401
        from runner.kernels import sampling as sk
    except ImportError:
        return out
    if type(sk._penalty_kernel).__name__ == "InterpretedFunction":  # CPU: Triton's interpreter
        out.append("triton")
    return out


class Keep:
    """An inner sampler that hands back the logits it got (what the window / draw would see)."""

    def __init__(self):
        self.seen: dict[int, torch.Tensor] = {}

    def __call__(self, logits, codebook, out=None):
        self.seen[codebook] = logits.clone()
        return logits.argmax(-1)


def recorded_state(backend: str) -> SlotState:
    """HISTORIES written the way the frame runner does: admitted empty, then one record() per
    frame with the row's frame index (and a padding row in every call)."""
    st = SlotState(S, V0, L, CPU, backend=backend)
    st.allocate_penalty_buffers()
    st.admit_many([(s, [], [], True) for s in range(S)])
    for n in range(max(len(h) for h in HISTORIES.values())):
        rows = [s for s, h in HISTORIES.items() if n < len(h)]
        slots = torch.tensor(rows + [-1])
        codes = torch.tensor([HISTORIES[s][n] for s in rows] + [11])
        st.record(slots, codes, torch.full_like(slots, n))
    return st


def batch(slots: list[int], penalties: list[float]) -> SamplingBatch:
    params = [SamplingParams(temperature=0.0, repetition_penalty=p) for p in penalties]
    return SamplingBatch.build(params, slots, [0] * len(slots), [0] * len(slots), [], CPU)


@pytest.mark.parametrize("backend", backends())
def test_equals_transformers_processor(backend):
    slots, penalties = [2, 0, -1, 1, 3], [1.05, 1.5, 1.0, 1.3, 0.8]  # 0.8 < 1: a reward
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(slots), V0, generator=gen) * 4  # both signs
    logits[0, 9] = 0.0  # zero: multiplied, stays 0
    st = recorded_state(backend)
    inner = Keep()
    Code0Penalty(Sampler(CPU, backend=backend), batch(slots, penalties), st, inner)(logits.clone(), 0)
    got = inner.seen[0]
    for r, (s, p) in enumerate(zip(slots, penalties)):
        hist = torch.tensor([HISTORIES.get(s, [])], dtype=torch.int64)
        want = RepetitionPenaltyLogitsProcessor(penalty=p)(hist, logits[r : r + 1].clone())[0]
        assert torch.equal(got[r], want), (r, s, p)
    assert not torch.equal(got[1], logits[1])  # the penalty did something


def test_groups_pass_through():
    st = recorded_state("torch")
    inner = Keep()
    logits = torch.randn(2, V0)
    Code0Penalty(Sampler(CPU, backend="torch"), batch([0, 2], [2.0, 2.0]), st, inner)(logits.clone(), 1)
    assert torch.equal(inner.seen[1], logits)


def test_padding_rows_write_only_the_scratch_row_and_admit_resets():
    st = recorded_state("torch")
    _, counts = st.penalty_buffers()  # [S + 1, V0]
    for s, h in HISTORIES.items():
        want = torch.bincount(torch.tensor(h, dtype=torch.int64), minlength=V0).int()
        assert torch.equal(counts[s], want), s
    # (the padding rows, code 11 at slot -1, went to the scratch row S or nowhere: no real row has an 11)
    st.admit_many([(2, [], [], True)])  # slot 2 handed to a new request
    assert not counts[2].any() and torch.equal(counts[0], torch.bincount(torch.tensor(HISTORIES[0]), minlength=V0).int())
    st.admit_many([(3, [], [4, 4, 6], True)])  # recomputing after a preemption: its generated ids
    assert counts[3, 4] == 2 and counts[3, 6] == 1 and counts[3].sum() == 3


def test_validate_lets_a_family_declare_code0_penalties():
    sp = SamplingParams(repetition_penalty=1.05)
    sp.validate(100, codes_per_frame=4, code0_penalty=True)
    with pytest.raises(InvalidRequest) as e:  # CSM: no history
        sp.validate(100, codes_per_frame=4)
    assert e.value.field == "sampling.repetition_penalty"
    for field in ("frequency_penalty", "presence_penalty"):
        with pytest.raises(InvalidRequest, match="repetition_penalty only") as e:
            SamplingParams(**{field: 0.5}).validate(100, codes_per_frame=4, code0_penalty=True)
        assert e.value.field == f"sampling.{field}"
