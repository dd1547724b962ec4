"""Model families by the profile's `family` name; the one place a family is picked."""

from __future__ import annotations

from runner.families.base import ModelFamily
from runner.families.csm import CsmFamily
from runner.families.orpheus import OrpheusFamily
from runner.families.qwen3_tts import Qwen3TtsFamily
from runner.families.text import TextFamily
from streaming.profile import ModelProfile

FAMILIES: dict[str, type[ModelFamily]] = {
    CsmFamily.name: CsmFamily,
    OrpheusFamily.name: OrpheusFamily,
    Qwen3TtsFamily.name: Qwen3TtsFamily,
    TextFamily.name: TextFamily,
}


def family_for(profile: ModelProfile, model_path: str = "") -> ModelFamily:
    """The family of a model folder (model_path: read by families whose shape is in it, CSM)."""
    return FAMILIES[profile.family](profile, model_path)


__all__ = ["FAMILIES", "CsmFamily", "ModelFamily", "OrpheusFamily", "Qwen3TtsFamily", "TextFamily", "family_for"]
