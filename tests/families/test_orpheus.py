"""The Orpheus code constraint as a window of allowed ids: the window holds exactly the allowed
ids, and sampling the window is sampling the masked full row."""

from __future__ import annotations

from tests.support.triton_interpreter import interpret_without_cuda

_CUDA = interpret_without_cuda()  # before runner.kernels.sampling is imported

import pytest
import torch

from runner.families.orpheus import OrpheusCodeConstraint
from runner.layers.sampler import Sampler
from runner.layers.sampling_batch import SamplingBatch
from runner.layers.slot_state import SlotState
from streaming.sampling_params import SamplingParams

OFFSET, CB, TPF, END, V = 40, 8, 7, 30, 120  # audio ids [40, 96); end token below them
C = OrpheusCodeConstraint(OFFSET, CB, TPF, END)


def allowed(idx: int) -> list[int]:
    k = idx % TPF
    return sorted([*range(OFFSET + k * CB, OFFSET + (k + 1) * CB)] + ([END] if k == 0 else []))


def masked(logits: torch.Tensor, out_index: list[int]) -> torch.Tensor:
    out = torch.full_like(logits, float("-inf"))
    for r, idx in enumerate(out_index):
        ok = allowed(idx)
        out[r, ok] = logits[r, ok]
    return out


def test_window_holds_exactly_the_allowed_ids():
    idx = [0, 1, 6, 7, 13, 14, 20, 3, 700]
    logits = torch.randn(len(idx), V, generator=torch.Generator().manual_seed(0))
    w = C.gather_window(logits, torch.tensor(idx))
    assert w.shape == (len(idx), C.window_width)
    ids = C.window_ids(torch.arange(C.window_width).expand(len(idx), -1).T, torch.tensor(idx)).T  # [R, W]
    for r, i in enumerate(idx):
        finite = torch.isfinite(w[r])
        assert sorted(ids[r][finite].tolist()) == allowed(i)
        assert torch.equal(w[r][finite], logits[r, ids[r][finite]])


def test_sampling_the_window_is_sampling_the_masked_row():
    """Same filtered distribution (temperature, top-k, top-p, min-p) over the same ids."""
    idx = [0, 5, 14, 9]
    params = [SamplingParams(temperature=0.6, top_p=0.8), SamplingParams(top_k=3), SamplingParams(min_p=0.2, temperature=1.3),
              SamplingParams(temperature=0.9, top_k=5, top_p=0.7)]
    logits = torch.randn(len(idx), V, generator=torch.Generator().manual_seed(1)) * 2
    batch = SamplingBatch.build(params, [0, 1, 2, 3], [1, 2, 3, 4], idx, [], "cpu")
    state = SlotState(4, V, 8, "cpu")
    full = Sampler("cpu").process(masked(logits, idx), batch, state)
    win = Sampler("cpu").process(C.gather_window(logits, torch.tensor(idx)), batch, SlotState(4, C.window_width, 8, "cpu"))
    for r, i in enumerate(idx):
        cols = torch.arange(C.window_width)
        ids = C.window_ids(cols, torch.full_like(cols, i))
        p_full = full[r].softmax(-1)
        p_win = win[r].softmax(-1)
        torch.testing.assert_close(p_win, p_full[ids])
        assert float(p_full[ids].sum()) > 1 - 1e-6  # nothing outside the window
    # and the ids a window draw maps to are allowed ones
    draws = Sampler("cpu").sample(C.gather_window(logits, torch.tensor(idx)), batch)
    for r, i in enumerate(idx):
        assert int(C.window_ids(draws[r : r + 1], torch.tensor([i]))) in allowed(i)


def test_span_logits_give_the_same_windows():
    lo, hi = C.vocab_span
    assert (lo, hi) == (END, OFFSET + TPF * CB)  # every window id, nothing beyond
    idx = [0, 1, 6, 7, 13, 14, 20, 3]
    logits = torch.randn(len(idx), V, generator=torch.Generator().manual_seed(2))
    want = C.gather_window(logits, torch.tensor(idx))
    got = C.gather_window(logits[:, lo:hi].contiguous(), torch.tensor(idx), base=lo)
    assert torch.equal(got, want)


def test_penalties_and_bias_on_the_span_equal_the_full_row():
    """What the runner does for constrained rows (penalize the span's logits only) gives the
    span's part of the penalized full row: repetition / frequency / presence penalties read the
    right state columns, bias entries inside the span land, those outside are dropped."""
    lo, hi = C.vocab_span
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25,
                             logit_bias={OFFSET + 3: 2.0, 5: -4.0}, min_tokens=3),
              SamplingParams(repetition_penalty=0.8, logit_bias={hi - 1: -1.5})]
    state = SlotState(4, V, 64, "cpu")
    state.admit(1, [OFFSET + 1, 7, END], [OFFSET + 9, OFFSET + 9, 2], track_penalties=True)
    state.admit(3, [hi - 1, 0], [OFFSET + 20], track_penalties=True)
    # min_tokens bans the stop ids (END) while out_index < 3: the runner's extra bias entries
    batch = SamplingBatch.build(params, [1, 3], [5, 6], [1, 4], [(0, END, float("-inf"))], "cpu")
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3)) * 3
    full = logits.clone()
    Sampler("cpu").penalize(full, batch, state)
    span = logits[:, lo:hi].clone()
    Sampler("cpu").penalize(span, batch, state, col0=lo)
    torch.testing.assert_close(span, full[:, lo:hi], rtol=0, atol=0)
    assert span[0, 0] == float("-inf")  # END (column 0 of the span) banned
    with pytest.raises(ValueError, match="exceed the vocabulary"):
        Sampler("cpu").penalize(torch.zeros(2, 10), batch, state, col0=V - 5)


def _triton_constraint():
    try:
        return OrpheusCodeConstraint(OFFSET, CB, TPF, END, backend="triton")
    except ImportError:
        return None


@pytest.mark.skipif(_triton_constraint() is None, reason="triton missing")
@pytest.mark.parametrize("base,end", [(0, END), (OFFSET - 2, END), (0, OFFSET + TPF * CB + 3)])
def test_triton_window_and_ids_equal_torch(base, end):
    """The kernel launches give the torch ops' windows and ids, with the end column inside the
    logits, outside them (-inf), and after the codebooks."""
    dev = torch.device("cuda" if _CUDA else "cpu")
    ref, fast = OrpheusCodeConstraint(OFFSET, CB, TPF, end), OrpheusCodeConstraint(OFFSET, CB, TPF, end, backend="triton")
    idx = torch.tensor([0, 1, 6, 7, 13, 14, 20, 3, 700])
    logits = torch.randn(len(idx), V - base, generator=torch.Generator().manual_seed(3))
    want = ref.gather_window(logits, idx, base=base)
    got = fast.gather_window(logits.to(dev), idx.to(dev), base=base)
    assert torch.equal(got.cpu(), want)
    cols = torch.tensor([0, CB - 1, CB, 3, CB, 5, 1, CB - 2, 4])
    assert torch.equal(fast.window_ids(cols.to(dev), idx.to(dev)).cpu(), ref.window_ids(cols, idx))
