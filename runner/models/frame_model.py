"""What the multi-codebook talkers (CSM, Qwen3-TTS) share around their two stacks: a backbone
(csm_parts.DecoderStack) whose `head` gives code 0, and a depth decoder (csm_parts.DepthDecoder)
that draws codes 1..K-1 over a DepthKV allocated once. One frame step, for B rows:

    hidden, logits0 = backbone_step(embeds, positions, kv_caches, meta, last_rows)
    frames = depth_decode(hidden, sampler(logits0, 0), sampler)      # [B, K]

A subclass builds `backbone`, names its depth decoder (`depth_decoder`) and code-0 head
(`code0_head`) and defines the rest: `embed_inputs`, `frame_is_eos`, `tie_embeddings`,
`reset_buffers`."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from runner.layers import make_attention, make_ops
from runner.layers.attention import AttentionMetadata
from runner.layers.base import AttentionBackend, OpsBackend
from runner.layers.ops import padded_rows, row_multiple_for
from runner.models.csm_parts import DecoderStack, DepthDecoder, DepthKV
from runner.models.csm_sampling import CodebookSampler


class FrameModel(nn.Module):
    backbone: DecoderStack
    num_codebooks: int
    depth_kv: DepthKV | None = None
    # [V0', H]: the code-0 head's weight as the first V0 rows of a zero-padded copy (cuBLAS
    # alignment, ops.padded_rows), or None; set by allocate_depth_kv
    code0_padded: torch.Tensor | None = None

    @property
    def depth_decoder(self) -> DepthDecoder:
        raise NotImplementedError

    @property
    def code0_head(self) -> nn.Linear:
        """The backbone's head for code 0 (bias-free)."""
        raise NotImplementedError

    def head(self, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, H] last hidden states -> (the same, code-0 logits [B, V0] in the model dtype; a
        column view of a wider product where the head is padded: a CodebookSampler takes any
        row stride)."""
        return last, self.backbone.ops.head(last, self.code0_head.weight, self.code0_padded)

    def tie_embeddings(self) -> None:
        """Share the tables the checkpoint ties (again after to_empty, which gives each module
        its own tensor)."""
        raise NotImplementedError

    def reset_buffers(self, device: torch.device | str) -> None:
        """Non-parameter state on `device` after a meta-device build: RoPE tables, offsets."""
        raise NotImplementedError

    @torch.no_grad()
    def allocate_depth_kv(self, max_rows: int, head_row_multiple: int | None = None) -> DepthKV:
        """The depth decoder's per-frame KV and metadata for up to max_rows rows, and the
        decode-time weight layouts, once the weights are loaded: every head's rows padded to
        `head_row_multiple` (default: ops.row_multiple_for the model's device) and
        DepthDecoder.prepare_decode."""
        w = self.backbone.norm.weight  # the model's device and dtype
        if head_row_multiple is None:
            head_row_multiple = row_multiple_for(w.device)
        rows, self.code0_padded = padded_rows(self.code0_head.weight.detach(), head_row_multiple)
        if self.code0_padded is not None:
            self.code0_head.weight = nn.Parameter(rows, requires_grad=False)
        self.depth_kv = DepthKV(self.depth_decoder.cfg, self.num_codebooks, max_rows, w.device, w.dtype)
        self.depth_decoder.prepare_decode(head_row_multiple)
        return self.depth_kv

    def backbone_step(self, embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      meta: AttentionMetadata, last_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [T, H] of a flattened batch (positions [T], the paged KV and its metadata as
        for LlamaForCausalLM), last_rows [B] int64: the row of each sequence's last new token
        -> (its final hidden state [B, H], code-0 logits [B, V0], model dtype)."""
        h = self.backbone(embeds, positions, kv_caches, meta)
        return self.head(h.index_select(0, last_rows))

    def depth_decode(self, hidden: torch.Tensor, code0: torch.Tensor, sampler: CodebookSampler) -> torch.Tensor:
        """hidden [B, H], code0 [B] -> frames [B, K] int64: codes 1..K-1 by the depth decoder,
        every row's sub-steps batched, each code drawn by `sampler` on the device."""
        if self.depth_kv is None:
            raise RuntimeError("depth_decode: call allocate_depth_kv(max_rows) first")
        return self.depth_decoder.decode(hidden, code0, sampler, self.depth_kv)

    def frame_step(self, embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                   meta: AttentionMetadata, last_rows: torch.Tensor, sampler: CodebookSampler) -> torch.Tensor:
        """backbone_step, code 0 drawn by `sampler`, depth_decode: one frame [B, K] per sequence."""
        hidden, logits = self.backbone_step(embeds, positions, kv_caches, meta, last_rows)
        return self.depth_decode(hidden, sampler(logits, 0), sampler)


M = TypeVar("M", bound=FrameModel)


def build_empty_frame_model(cls: type[M], cfg, device: torch.device | str, dtype: torch.dtype,
                            attn: AttentionBackend | None = None, ops: OpsBackend | None = None) -> M:
    """cls(cfg, attn, ops) on `device` in `dtype` with uninitialised parameters (built on the
    meta device, as runner/models/llama.py build_empty_model); RoPE tables and offsets computed
    for real, tied tables shared again."""
    device = torch.device(device)
    attn = attn if attn is not None else make_attention(None, device)
    ops = ops if ops is not None else make_ops(None, device)
    with torch.device("meta"):
        model = cls(cfg, attn, ops)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_embeddings()
    model.reset_buffers(device)
    return model.eval().requires_grad_(False)
