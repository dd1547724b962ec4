"""Model families by the profile's `family` name; the one place a family is picked."""

from __future__ import annotations

from runner.families.base import ModelFamily
from runner.families.orpheus import OrpheusFamily
from runner.families.text import TextFamily
from streaming.profile import ModelProfile

FAMILIES: dict[str, type[ModelFamily]] = {
    OrpheusFamily.name: OrpheusFamily,
    TextFamily.name: TextFamily,
}


def family_for(profile: ModelProfile) -> ModelFamily:
    return FAMILIES[profile.family](profile)


__all__ = ["FAMILIES", "ModelFamily", "OrpheusFamily", "TextFamily", "family_for"]
