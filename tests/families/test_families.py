"""The model-family seam: the engine asks the family for the constraint, the stop ids and the
codec; the family answers from the profile alone."""

from __future__ import annotations

import torch

from runner.families import FAMILIES, OrpheusFamily, TextFamily, family_for
from runner.families.orpheus import OrpheusCodeConstraint
from streaming.profile import ModelProfile

CODEC = {"path": "/nowhere", "audio_token_offset": 512, "codebook_size": 64, "end_token_id": 505}


def test_registry_picks_the_profile_family():
    assert set(FAMILIES) == {"orpheus", "csm", "qwen3_tts", "text"}
    assert isinstance(family_for(ModelProfile()), OrpheusFamily)
    assert isinstance(family_for(ModelProfile(family="text", speech=None)), TextFamily)


def test_orpheus_family_answers_from_its_codec_section():
    fam = family_for(ModelProfile(codec=CODEC))
    assert fam.speaks and fam.codes_per_frame == 1
    assert fam.stop_token_ids() == (505,)
    c = fam.logits_constraint("torch")
    assert isinstance(c, OrpheusCodeConstraint)
    assert c.vocab_span == (505, 512 + 7 * 64)
    # out index 8 -> codebook slot 1: ids 576..639; the end token only at a frame boundary
    logits = torch.zeros(2, 1024)
    w = c.gather_window(logits, torch.tensor([8, 14]))
    assert torch.isinf(w[0, -1]) and w[1, -1] == 0  # 14 % 7 == 0
    assert c.window_ids(torch.tensor([3, 64]), torch.tensor([8, 14])).tolist() == [512 + 64 + 3, 505]


def test_orpheus_without_codec_and_text_family_have_no_audio():
    for fam in (family_for(ModelProfile()), family_for(ModelProfile(family="text", speech=None))):
        assert not fam.speaks
        assert fam.logits_constraint("torch") is None and fam.stop_token_ids() == ()
        assert fam.build_codec(torch.device("cpu"), torch.float32) is None


def test_families_that_sample_every_code_alike_refuse_group_sampling():
    import pytest

    from streaming.sampling_params import InvalidRequest, SamplingParams

    for fam in (family_for(ModelProfile(codec=CODEC)), family_for(ModelProfile(family="text", speech=None))):
        assert fam.check_group_sampling(None) is None
        with pytest.raises(InvalidRequest) as e:
            fam.check_group_sampling(SamplingParams())
        assert e.value.field == "group_sampling"


def test_fill_random_is_seeded_small_and_covers_every_parameter():
    from runner.families.base import fill_random_

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Embedding(100, 64))

    a, b = fill_random_(build(), torch.device("cpu")), fill_random_(build(), torch.device("cpu"))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name  # the same seed, the same weights
        assert 0.01 < pa.std().item() < 0.03, name  # N(0, 0.02): none left at its init
    c = fill_random_(build(), torch.device("cpu"), seed=1)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
