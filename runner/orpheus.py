"""Orpheus-family sampling rule: the model's own constraint on which ids may come next.

An Orpheus stream is frames of 7 audio tokens; token k of the stream must come from codebook
slot k % 7, i.e. ids [offset + (k % 7) * codebook_size, offset + (k % 7 + 1) * codebook_size),
and end-of-speech may only come at a frame boundary (k % 7 == 0). A well-trained model follows
this anyway; enforcing it means a stream can never stop mid-frame or emit an undecodable id,
and the embedded random-weight default still produces (noise) audio.

It runs on the device, vectorised over rows, with the true output index of each row (correct
in async mode, where the host has not seen the previous token yet). The variant is picked once
from the device: on CUDA one Triton launch writes -inf outside each row's range (writes only:
at batch 256 x 156940 the torch version's gather, masks and scatter moved ~1 GB per step).
"""

from __future__ import annotations

import torch


class OrpheusCodeConstraint:
    def __init__(self, audio_token_offset: int, codebook_size: int, tokens_per_frame: int, end_token_id: int,
                 device: torch.device | str = "cpu", kernels: str = "auto"):
        self.offset = audio_token_offset
        self.cb = codebook_size
        self.tpf = tokens_per_frame
        self.end = end_token_id
        self._kernel = None
        if kernels == "triton" or (kernels == "auto" and torch.device(device).type == "cuda"):
            from runner.orpheus_kernels import mask_outside_code_range

            self._kernel = mask_outside_code_range

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor | None, out_index: torch.Tensor) -> None:
        """logits [B, V] in place; rows [R] int64 batch rows the rule applies to (None: every
        row); out_index [R] int64 (or [B] when rows is None): index among the request's outputs
        of the token being sampled."""
        if self._kernel is not None:
            self._kernel(logits, rows, out_index, self.offset, self.cb, self.tpf, self.end)
            return
        V = logits.shape[1]
        k = out_index % self.tpf  # [R]
        lo = (self.offset + k * self.cb).unsqueeze(1)  # [R, 1]
        vocab = torch.arange(V, device=logits.device).unsqueeze(0)  # [1, V]
        allowed = (vocab >= lo) & (vocab < lo + self.cb)
        if 0 <= self.end < V:
            allowed[:, self.end] |= k == 0
        if rows is None:
            logits.masked_fill_(~allowed, float("-inf"))
            return
        sub = logits[rows]
        logits[rows] = sub.masked_fill(~allowed, float("-inf"))
