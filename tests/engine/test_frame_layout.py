"""The frame seam's host and sampler pieces a family declares (runner/families/base.py
FrameLayout): FrameLog rows with a text column fed by StepText, the code-0 window and the
split of code 0 / groups between two samplers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.engine.request import FrameLog
from runner.families.base import StepText
from runner.families.base import Code0Rule, FrameLayout
from runner.models.csm_sampling import Code0Window, GreedyCodebooks, SplitCodebooks


def test_framelog_without_text_column_is_codes_only():
    log = FrameLog(np.arange(6).reshape(2, 3))
    log.append(np.array([7, 8, 9]))
    assert (log.width, log.num_codes) == (3, 3)
    np.testing.assert_array_equal(log.rows(0, 3), log.codes(0, 3))
    np.testing.assert_array_equal(log.last(), [7, 8, 9])


def test_framelog_fills_the_text_column_of_generated_frames():
    """Output frame n's row gets step_text.at(n): the trailing ids, then the pad; text_at gives
    the same id for a position whose frame is still in flight."""
    prompt = np.array([[-1, -1, 5], [1, 2, 6]])  # [codes K=2 | text]
    log = FrameLog(prompt, 2, StepText((10, 11), pad=99))
    for f in range(4):
        assert log.text_at(2 + f) == (10, 11, 99, 99)[f]  # known before the frame is
        log.append(np.array([f, f + 1]))
    np.testing.assert_array_equal(log.rows(0, 6)[:, 2], [5, 6, 10, 11, 99, 99])
    np.testing.assert_array_equal(log.codes(2, 6), [[0, 1], [1, 2], [2, 3], [3, 4]])
    np.testing.assert_array_equal(log.last(), [3, 4])
    for _ in range(200):  # growth keeps the rows
        log.append(np.array([0, 0]))
    np.testing.assert_array_equal(log.rows(0, 4)[:, 2], [5, 6, 10, 11])


def test_framelog_refuses_rows_of_the_wrong_width():
    with pytest.raises(ValueError, match="width 2 for 2 codes with a text column"):
        FrameLog(np.zeros((1, 2), dtype=np.int64), 2, StepText((), pad=0))
    with pytest.raises(ValueError, match="width 3 for 2 codes without"):
        FrameLog(np.zeros((1, 3), dtype=np.int64), 2)


def test_layout_row_width():
    assert FrameLayout(4, 32, 1, 2).row_width == 4
    assert FrameLayout(4, 32, 1, 2, text_column=True).row_width == 5


def test_code0_window_bars_specials_and_early_eos():
    """Code 0 (vocab 10, codes 0..5, eos 8): ids 6, 7, 9 never; eos only on rows whose frame
    counter is >= 2. Groups pass through untouched."""
    rule = Code0Rule(vocab=10, num_codes=6, eos=8, min_frames=2)
    counters = torch.tensor([0, 1, 2, 5])
    win = Code0Window(rule, counters, GreedyCodebooks())
    logits = torch.zeros(4, 10)
    logits[:, 9], logits[:, 7], logits[:, 8], logits[:, 3] = 4.0, 3.0, 2.0, 1.0
    assert win(logits.clone(), 0).tolist() == [3, 3, 8, 8]
    assert win(logits.clone(), 1).tolist() == [9] * 4
    assert win.barred.shape == (4, 10)


def test_split_codebooks_sends_groups_to_the_second_sampler():
    class Const:
        def __init__(self, v):
            self.v = v

        def __call__(self, logits, codebook, out=None):
            return torch.full((logits.shape[0],), self.v)

    split = SplitCodebooks(Const(1), Const(2))
    x = torch.zeros(3, 4)
    assert split(x, 0).tolist() == [1] * 3
    assert split(x, 1).tolist() == split(x, 3).tolist() == [2] * 3
