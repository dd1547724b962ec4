"""Orpheus-family sampling rule: the model's own constraint on which ids may come next.

An Orpheus stream is frames of 7 audio tokens; token k of the stream must come from codebook
slot k % 7, i.e. ids [offset + (k % 7) * codebook_size, offset + (k % 7 + 1) * codebook_size),
and end-of-speech may only come at a frame boundary (k % 7 == 0). A well-trained model follows
this anyway; enforcing it means a stream can never stop mid-frame or emit an undecodable id,
and the embedded random-weight default still produces (noise) audio.

The rule is a window per row: the runner computes only the logits of the span of ids that
holds every window (`vocab_span`, 28680 of Orpheus-3B's 156940 lm_head rows), gathers the
row's window (codebook_size + 1 columns), the sampler filters and draws among those columns
only, and the chosen column maps back to a token id. That is the same distribution as masking
every other id to -inf in the full row, at a fraction of the lm_head's and the sampler's work.
It runs on the device, vectorised over rows, with the true output index of each row (correct
in async mode, where the host has not seen the previous token yet).
"""

from __future__ import annotations

import torch

from runner.codecs.config import CodecConfig
from runner.codecs.stage import CodecStage
from runner.families.base import CodecStageLike, LogitsConstraint, ModelFamily
from streaming.profile import ModelProfile


class OrpheusCodeConstraint:
    def __init__(self, audio_token_offset: int, codebook_size: int, tokens_per_frame: int, end_token_id: int,
                 backend: str = "torch"):
        """backend: 'torch', or 'triton' (CUDA): the window gather and the id map as one kernel
        launch each instead of ~10 torch ops (the sampler's backend; runner/kernels/sampling.py)."""
        if backend not in ("torch", "triton"):
            raise ValueError(f"OrpheusCodeConstraint backend must be 'torch' or 'triton', got {backend!r}")
        self.offset = audio_token_offset
        self.cb = codebook_size
        self.tpf = tokens_per_frame
        self.end = end_token_id
        self._kernels = None
        if backend == "triton":
            from runner.kernels import sampling as sampling_kernels

            self._kernels = sampling_kernels

    @property
    def vocab_span(self) -> tuple[int, int]:
        """[lo, hi): the contiguous ids that hold every window (the 7 codebook slots and the
        end token), so the runner computes only these logits for constrained rows: 28680 of
        Orpheus-3B's 156940 lm_head rows."""
        return min(self.offset, self.end), max(self.offset + self.tpf * self.cb, self.end + 1)

    @property
    def window_width(self) -> int:
        """Columns of `gather_window`: the codebook slot's ids, then the end token."""
        return self.cb + 1

    def gather_window(self, logits: torch.Tensor, out_index: torch.Tensor, base: int = 0) -> torch.Tensor:
        """logits [R, N] of ids [base, base + N) -> [R, cb + 1]: column j < cb is id
        offset + k * cb + j (k = out_index % 7), column cb the end token (-inf where k != 0,
        or where the end id is outside the logits). The codebook ids must lie inside."""
        end_col = self.end - base
        has_end = 0 <= end_col < logits.shape[1]
        if self._kernels is not None and logits.stride(1) == 1:
            return self._kernels.code_window(logits, out_index, self.offset - base, self.cb, self.tpf,
                                             end_col if has_end else None)
        k = out_index % self.tpf
        lo = self.offset - base + k * self.cb  # [R]
        cols = lo[:, None] + torch.arange(self.cb, device=logits.device)  # [R, cb]
        if has_end:
            end = torch.where(k == 0, logits[:, end_col], float("-inf"))
        else:
            end = torch.full(k.shape, float("-inf"), device=logits.device, dtype=logits.dtype)
        return torch.cat([logits.gather(1, cols), end[:, None]], dim=1)

    def window_ids(self, cols: torch.Tensor, out_index: torch.Tensor) -> torch.Tensor:
        """Sampled columns of `gather_window` [R] -> token ids [R]."""
        if self._kernels is not None and cols.dim() == 1:
            return self._kernels.code_window_ids(cols, out_index, self.offset, self.cb, self.tpf, self.end)
        lo = self.offset + (out_index % self.tpf) * self.cb
        return torch.where(cols < self.cb, lo + cols, self.end)


class OrpheusFamily(ModelFamily):
    """A Llama that emits SNAC codes as tokens: one code per step, 7 steps per SNAC frame, in
    codebook slots k % 7; speech ends with the end token at a frame boundary."""

    name = "orpheus"

    def __init__(self, profile: ModelProfile, model_path: str = ""):
        super().__init__(profile, model_path)
        # the codec section parsed (and checked) once; the constraint and the codec stage both
        # read the token layout from it, so its defaults live in CodecConfig alone
        self.codec_config = CodecConfig(**profile.codec) if profile.codec is not None else None

    def build_codec(self, device: torch.device, dtype: torch.dtype, tuning: str = "auto") -> CodecStageLike | None:
        if self.codec_config is None:
            return None
        return CodecStage(self.codec_config, device, dtype, tuning)

    def logits_constraint(self, backend: str) -> LogitsConstraint | None:
        c = self.codec_config
        if c is None:
            return None
        return OrpheusCodeConstraint(c.audio_token_offset, c.codebook_size, c.tokens_per_frame, c.end_token_id,
                                     backend=backend)

    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.codec_config.end_token_id,) if self.codec_config is not None else ()
