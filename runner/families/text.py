"""A plain language model: text in, tokens (and hidden states) out; no speech, no codec."""

from __future__ import annotations

import torch

from runner.families.base import LogitsConstraint, ModelFamily


class TextFamily(ModelFamily):
    name = "text"

    def build_codec(self, device: torch.device, dtype: torch.dtype, tuning: str = "auto") -> None:
        return None

    def logits_constraint(self, backend: str) -> LogitsConstraint | None:
        return None

    def stop_token_ids(self) -> tuple[int, ...]:
        return ()
