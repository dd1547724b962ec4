"""Per-codebook sampling of a multi-codebook frame: the callable `CsmModel.frame_step` and
`CsmModel.depth_decode` call once per codebook, on the device, with no host sync.

A `CodebookSampler` maps logits [B, V] float32 of codebook `k` to ids [B] int64. Greedy is an
argmax; `RaceCodebooks` runs the project's sampler (runner/layers/sampler.py: temperature,
top-k / top-p / min-p, the counter-keyed exponential race) with the race counter of codebook k of
frame n set to n * K + k: each code of a request gets its own noise key, so a seeded request's
frames do not depend on the batch (the same argument as for tokens). Penalties and logit bias
(the sampler's stages 1-2) do not apply to codes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch
from torch import Tensor

from runner.layers.sampler import Sampler
from runner.layers.sampling_batch import SamplingBatch


class CodebookSampler(Protocol):
    def __call__(self, logits: Tensor, codebook: int) -> Tensor:
        """logits [B, V] float32 of codebook `codebook` (may be modified in place) -> ids [B] int64."""
        ...


class GreedyCodebooks:
    """argmax of every codebook (transformers' do_sample=False, depth_decoder_do_sample=False)."""

    def __call__(self, logits: Tensor, codebook: int) -> Tensor:
        return logits.argmax(dim=-1)


class RaceCodebooks:
    """The project's sampler over each codebook's logits.

    `batch.counters` holds each row's frame index (its request's frames emitted so far); the race
    counter of codebook k is frame * num_codebooks + k. Built once per frame step (the counter
    base is one device op); calling it per codebook costs no host work beyond the sampler's.
    """

    def __init__(self, sampler: Sampler, batch: SamplingBatch, num_codebooks: int):
        self.sampler = sampler
        self.batch = batch
        self._base = batch.counters * num_codebooks  # [B] int64, on the batch's device

    def __call__(self, logits: Tensor, codebook: int) -> Tensor:
        return self.sampler.sample(logits, replace(self.batch, counters=self._base + codebook))


class CodecRange:
    """Draws only codes the codec can decode for the rows that feed it: columns >= `limit`
    (CSM's 2051 ids against Mimi's 2048 codes: padding and spare ids) get -inf on rows where
    `rows` [B] bool is set (audio requests); other rows keep the model's distribution."""

    def __init__(self, inner: CodebookSampler, limit: int, rows: Tensor, vocab: int):
        self.inner = inner
        over = torch.arange(vocab, device=rows.device) >= limit
        self.mask = rows[:, None] & over[None, :]  # [B, V], built once per frame step

    def __call__(self, logits: Tensor, codebook: int) -> Tensor:
        logits.masked_fill_(self.mask, float("-inf"))
        return self.inner(logits, codebook)
