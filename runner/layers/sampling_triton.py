"""`TritonSampling`: the sampler's device work in Triton kernels (runner/kernels/sampling.py):
penalties in one pass over the state rows, one program per row for filters and race.

Chosen once at construction by the registry (runner/layers/__init__.py); importing this module
needs `triton` (the tests run it under Triton's interpreter on CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor

from runner.kernels import sampling as kernels
from runner.kernels.tuning import SamplingTuning
from runner.layers.noise import NOISE_SALTS
from runner.layers.sampling_batch import SamplingBatch
from runner.layers.slot_state import SlotState


class TritonSampling:
    """The `SamplingBackend` of runner/layers/base.py with one launch per stage. `tuning`: the
    filter / sample kernel's launch configuration (the registry passes the device's table's;
    default: the untuned one)."""

    name = "triton"

    def __init__(self, device: torch.device, tuning: SamplingTuning = kernels.DEFAULT_TUNING) -> None:
        self.device = device
        self.tuning = tuning

    def apply_penalties(self, logits: Tensor, batch: SamplingBatch, state: SlotState, col0: int = 0) -> None:
        # one fused pass that reads the state rows in place (no [B, V] gathers)
        kernels.apply_penalties(logits, batch, state, col0)

    def race_noise(self, seeds: Tensor, counters: Tensor, out: Tensor) -> Tensor:
        return kernels.race_noise(seeds, counters, out, NOISE_SALTS)

    def filter_and_sample(self, logits: Tensor, batch: SamplingBatch, q: Tensor) -> Tensor:
        return kernels.filter_and_sample(logits, batch, q, self.tuning)  # greedy rows handled in-kernel

    def filter_logits(self, logits: Tensor, batch: SamplingBatch) -> None:
        kernels.filter_logits(logits, batch, self.tuning)

    def record_tokens(self, last_token: Tensor, history: Tensor, counts: Tensor | None, slots: Tensor,
                      tokens: Tensor, out_index: Tensor) -> None:
        kernels.record_tokens(last_token, history, counts, slots, tokens, out_index)
