"""Per-codebook sampling of a multi-codebook frame: the callable `CsmModel.frame_step` and
`CsmModel.depth_decode` call once per codebook, on the device, with no host sync.

A `CodebookSampler` maps logits [B, V] (float32, or the head's bf16 / fp16: drawn as their
float32 values) of codebook `k` to ids [B] int64, written into `out` when given (a column of the
frames, say). Greedy is an argmax; `RaceCodebooks` runs the project's sampler
(runner/layers/sampler.py: temperature, top-k / top-p / min-p, the counter-keyed exponential race)
with the race counter of codebook k of frame n set to n * K + k: each code of a request gets its
own noise key, so a seeded request's frames do not depend on the batch (the same argument as for
tokens). Penalties and logit bias (the sampler's stages 1-2) do not apply to codes, except code
0's repetition penalty where the family declares one (`Code0Penalty`).

`FusedCodebooks` draws the same ids as `CodecRange(RaceCodebooks(...))` in one Triton launch per
codebook (runner/kernels/codebook_sampling.py: CUDA, a vocabulary of at most MAX_VOCAB codes);
the frame runner picks it once, at construction, where it applies.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch
from torch import Tensor

from runner.layers.noise import NOISE_SALTS
from runner.layers.sampler import Sampler
from runner.layers.sampling_batch import SamplingBatch
from runner.layers.slot_state import SlotState


class CodebookSampler(Protocol):
    def __call__(self, logits: Tensor, codebook: int, out: Tensor | None = None) -> Tensor:
        """logits [B, V] float of codebook `codebook` (may be modified in place) -> ids [B]
        int64: `out` ([B] int64, any stride) when given, else a new tensor."""
        ...


def _into(ids: Tensor, out: Tensor | None) -> Tensor:
    if out is None:
        return ids
    out.copy_(ids)
    return out


class GreedyCodebooks:
    """argmax of every codebook (transformers' do_sample=False, depth_decoder_do_sample=False)."""

    def __call__(self, logits: Tensor, codebook: int, out: Tensor | None = None) -> Tensor:
        return _into(logits.argmax(dim=-1), out)


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

    def __call__(self, logits: Tensor, codebook: int, out: Tensor | None = None) -> Tensor:
        # the sampler scales in place and works in float32 (.float() is a no-op on float32)
        ids = self.sampler.sample(logits.float(), replace(self.batch, counters=self._base + codebook))
        return _into(ids, out)


class CodecRange:
    """Draws only codes the codec can decode for the rows that feed it: columns >= `limit`
    (CSM's 2051 ids against Mimi's 2048 codes: padding and spare ids) get -inf on rows where
    `rows` [B] bool is set (audio requests); other rows keep the model's distribution."""

    def __init__(self, inner: CodebookSampler, limit: int, rows: Tensor, vocab: int):
        self.inner = inner
        over = torch.arange(vocab, device=rows.device) >= limit
        self.mask = rows[:, None] & over[None, :]  # [B, V], built once per frame step

    def __call__(self, logits: Tensor, codebook: int, out: Tensor | None = None) -> Tensor:
        logits.masked_fill_(self.mask, float("-inf"))
        return self.inner(logits, codebook, out)


class SplitCodebooks:
    """Code 0 drawn by one sampler, groups 1..K-1 by another (Qwen3-TTS: the talker's and the
    subtalker's parameters, two SamplingBatch views with the same seeds and counters)."""

    def __init__(self, code0: CodebookSampler, groups: CodebookSampler):
        self.code0 = code0
        self.groups = groups

    def __call__(self, logits: Tensor, codebook: int, out: Tensor | None = None) -> Tensor:
        return (self.code0 if codebook == 0 else self.groups)(logits, codebook, out)


class Code0Window:
    """Code 0 drawn only from `rule`'s window (runner/families/base.py Code0Rule): ids >=
    num_codes other than eos get -inf, and eos too on rows whose frame counter ([B] int64,
    the request's frames so far) is below min_frames. Other codebooks pass through. The mask
    [B, vocab] is built once per frame step from device tensors: no host sync, graph safe."""

    def __init__(self, rule, counters: Tensor, inner: CodebookSampler):
        ids = torch.arange(rule.vocab, device=counters.device)
        is_eos = ids == rule.eos
        outside = (ids >= rule.num_codes) & ~is_eos  # [V0]
        self.barred = outside[None, :] | (is_eos[None, :] & (counters < rule.min_frames)[:, None])  # [B, V0]
        self.inner = inner

    def __call__(self, logits: Tensor, codebook: int, out: Tensor | None = None) -> Tensor:
        if codebook == 0:
            logits.masked_fill_(self.barred, float("-inf"))
        return self.inner(logits, codebook, out)


class Code0Penalty:
    """Code 0's repetition penalty (Qwen3-TTS: the talker's `repetition_penalty`, transformers'
    RepetitionPenaltyLogitsProcessor: a seen id's logit > 0 is divided by the row's penalty,
    else multiplied, once however often it was drawn) over the code-0 ids the row's request
    generated so far. The history is `state` (a SlotState of code 0's vocabulary whose output
    counts the frame runner records and whose prompt mask stays empty: prompt codes do not
    count); the row's penalty is `batch.repetition_penalty`. The sampler's stage 1 does the
    work (Sampler.penalize: torch or its Triton kernel), in float32 as transformers' generate
    does. Groups 1..K-1 pass through untouched. No host sync, graph safe (a graph's batch has
    any_repetition set; a row without a penalty carries 1.0, an exact identity)."""

    def __init__(self, sampler: Sampler, batch: SamplingBatch, state: SlotState, inner: CodebookSampler):
        self.sampler = sampler
        self.batch = batch
        self.state = state
        self.inner = inner

    def __call__(self, logits: Tensor, codebook: int, out: Tensor | None = None) -> Tensor:
        if codebook == 0:
            logits = logits.float()  # [B, V0]: in place when already float32
            self.sampler.penalize(logits, self.batch, self.state)
        return self.inner(logits, codebook, out)


class FusedCodebooks:
    """`CodecRange(RaceCodebooks(sampler, batch, K), limit, rows, V)` (or the bare
    `RaceCodebooks` when `limit` is None) in one launch per codebook: the codec range, the
    sampler's stages 3-5 and the race noise computed inline
    (runner/kernels/codebook_sampling.py). Same ids as the torch sampler up to fp32 rounding
    (a mass within rounding of its top-p bound, a race tie within an ulp). Logits are read,
    never written, in their own dtype. CUDA with Triton, V <= `max_vocab()`.

    Built once per frame step like RaceCodebooks; a call allocates at most its output (none
    with `out`), reads no device value and launches one kernel (CUDA-graph safe)."""

    def __init__(self, batch: SamplingBatch, num_codebooks: int, limit: int | None = None,
                 rows: Tensor | None = None):
        if (limit is None) != (rows is None):
            raise ValueError("limit and rows come together (the codec range) or not at all")
        from runner.kernels.codebook_sampling import codebook_sample  # needs triton: CUDA only

        self._sample = codebook_sample
        self.batch = batch
        self.num_codebooks = num_codebooks
        self.limit = limit
        self.rows = rows

    @staticmethod
    def max_vocab() -> int:
        """The largest vocabulary the kernel holds in registers (imports triton)."""
        from runner.kernels.codebook_sampling import MAX_VOCAB

        return MAX_VOCAB

    def __call__(self, logits: Tensor, codebook: int, out: Tensor | None = None) -> Tensor:
        b = self.batch
        return self._sample(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.counters,
                            self.num_codebooks, codebook, NOISE_SALTS, rows=self.rows,
                            limit=self.limit or 0, out=out)
