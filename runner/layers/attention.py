"""Paged KV cache layout, per-step attention metadata, and the plain-torch attention backend.

KV cache: one tensor per layer, shape [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = K, 1 = V), model dtype. Token at position p of a sequence lives in block
block_table[p // block_size] at offset p % block_size; its flat slot is
block_id * block_size + offset, which is what `AttentionMetadata.slot_mapping` holds.

Backends implement `AttentionBackend` (runner/layers/base.py) and are chosen once at
construction by the registry (runner/layers/__init__.py): this module's `TorchPagedAttention`,
or `TritonPagedAttention` (runner/layers/triton_attention.py) on CUDA.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from runner.config import ModelConfig


@dataclass
class AttentionMetadata:
    # A flattened batch of T new tokens from B sequences (sequence b owns query rows
    # query_start_loc[b]:query_start_loc[b+1]; its new tokens are the LAST q_len_b positions of its context).
    query_start_loc: torch.Tensor  # [B+1] int32, device
    seq_lens: torch.Tensor  # [B] int32, device: context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, device, rows padded with 0
    # (max_blocks * block_size >= max_seq_len: the torch backend indexes columns up to it)
    slot_mapping: torch.Tensor  # [T] int64, device: flat KV slot (block_id*block_size + offset) of each new token
    max_query_len: int
    max_seq_len: int
    # Host-side split of a mixed step: sequences [0, num_decodes) have one query token each
    # (the scheduler puts them first); the rest are prefill chunks whose longest context is
    # prefill_max_seq_len. Backends may run the two parts differently; 0 = no such split.
    num_decodes: int = 0
    prefill_max_seq_len: int = 0
    # Per query row (set by the runner for backends with `supports_token_rows` when every
    # query chunk is short): row t is position p_t of its sequence and attends causally over
    # [0, p_t + 1), i.e. exactly a decode row with that sequence's block table. A short
    # prefill chunk then runs through the decode kernel as one row per token, with no padded
    # gather; its cost grows with q_len * context, hence the runner's length limit.
    token_seq_lens: torch.Tensor | None = None  # [T] int32, p_t + 1
    token_block_tables: torch.Tensor | None = None  # [T, max_blocks] int32, row t = its sequence's table
    # Every row is the one new token of a distinct sequence (T == B, no token rows): a backend
    # may then write each row's K/V inside the attention launch (no row reads another's slot).
    pure_decode: bool = False

    def prefill_part(self) -> AttentionMetadata:
        """Metadata of sequences [num_decodes, B) alone (query rows num_decodes..T-1)."""
        nd = self.num_decodes
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[nd:] - nd,  # decode rows are one token each
            seq_lens=self.seq_lens[nd:],
            block_tables=self.block_tables[nd:],
            slot_mapping=self.slot_mapping[nd:],
            max_query_len=self.max_query_len,
            max_seq_len=self.prefill_max_seq_len,
        )


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device | str, dtype: torch.dtype
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer.

    Zero-filled on purpose: the torch backend gathers whole blocks (and block 0 for padded
    block-table entries) and relies on masking; a masked position still multiplies its V by a
    zero probability, so an uninitialised NaN there would poison the output. Every value ever
    written afterwards comes from the model and is finite.
    """
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V bytes of one token across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem


# SDPA backends for the CUDA prefill path: kernels that are compiled in, nothing set up per shape.
# Left to choose, SDPA paid a per-shape setup (most likely a cuDNN execution plan) on its first
# call at each new prompt length, hundreds of times the call itself, while every other stream of
# the batch waited. Memory-efficient attention takes the boolean mask; math is the fallback.
NO_PLAN_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter the new tokens' K/V ([T, Hkv, D]) into their slots.

    Every slot must be a real slot of the cache (no -1 sentinels): padding rows of a captured
    batch must point at a scratch block the allocator never hands out.
    """
    _, nb, bs, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, hkv, d)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


class TorchPagedAttention:
    """Vectorised paged attention with SDPA: gather each sequence's KV into a padded batch.

    Works on any device; cost is O(B * max_seq_len) gathered KV per layer, which is fine on CPU
    and for prefill, and is what the GPU decode kernel replaces. Its capabilities
    (runner/layers/base.py AttentionBackend) are all off: it ignores AttentionMetadata.token_*,
    the model writes K/V and applies RoPE through `forward`; `forward_prewritten_kv` and
    `forward_decode_cached` would attend from the cache all the same, but are never asked for.
    """

    supports_token_rows = False
    accepts_prewritten_kv = False
    decodes_from_cache = False
    fuses_decode_rope = False

    def __init__(self, sdpa_backends: list[SDPBackend] | None = None) -> None:
        # None: SDPA picks as it likes (CPU). TritonPagedAttention passes NO_PLAN_BACKENDS.
        self.sdpa_backends = sdpa_backends

    def decode_rope_fused(self, batch: int, num_kv_heads: int, device: torch.device) -> bool:
        return False

    def unsplit(self) -> TorchPagedAttention:
        return self  # nothing to split: SDPA over the gathered KV

    def warm_up(self, kv_cache: torch.Tensor, num_q_heads: int) -> None:
        pass  # SDPA needs no per-shape plan (NO_PLAN_BACKENDS on CUDA) and nothing compiles

    def forward_decode_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError("TorchPagedAttention does not fuse RoPE (decode_rope_fused is always False)")

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return self._attend(q, kv_cache, meta, scale)

    def forward_prewritten_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._attend(q, kv_cache, meta, scale)

    def forward_decode_cached(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
        return self._attend(q, kv_cache, meta, scale)

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q [T, Hq, D] over the cached K/V of its sequences (this step's included) -> [T, Hq, D]."""
        t, hq, d = q.shape
        _, nb, bs, hkv, _ = kv_cache.shape
        group = hq // hkv
        b = meta.seq_lens.shape[0]
        max_q, max_s = meta.max_query_len, meta.max_seq_len
        dev = q.device

        # Gather KV: flat slot of position s of sequence b = block_tables[b, s // bs] * bs + s % bs.
        # Positions >= seq_len read whatever is in the slot (block 0 for padded table entries);
        # the mask hides them.
        pos_k = torch.arange(max_s, device=dev)  # [S]
        blocks = meta.block_tables[:, pos_k // bs].long()  # [B, S]
        slots = blocks * bs + (pos_k % bs)  # [B, S]
        flat = kv_cache.view(2, nb * bs, hkv, d)
        k_pad = flat[0][slots]  # [B, S, Hkv, D]
        v_pad = flat[1][slots]

        # Where each flattened token goes in the padded query batch.
        qsl = meta.query_start_loc.long()
        tok = torch.arange(t, device=dev)
        seq_of_tok = torch.searchsorted(qsl[1:], tok, right=True)  # [T]
        idx_in_seq = tok - qsl[seq_of_tok]  # [T]
        q_pad = q.new_zeros(b, max_q, hq, d)
        q_pad[seq_of_tok, idx_in_seq] = q

        # Causal rule: query i of sequence b sits at position seq_len - q_len + i. Padded query
        # rows (i >= q_len) get positions >= seq_len, so they see every real key and never form
        # an all-masked row (SDPA would return NaN there); their output is dropped anyway.
        seq_lens = meta.seq_lens.long()
        q_lens = qsl[1:] - qsl[:-1]
        q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q, device=dev)  # [B, Lq]
        mask = (pos_k[None, None, :] <= q_pos[:, :, None]) & (pos_k[None, None, :] < seq_lens[:, None, None])  # [B, Lq, S]

        # GQA without copying KV: fold the `group` query heads that share a KV head into the
        # query-length axis. Query head h uses KV head h // group (transformers' repeat_kv order).
        qg = q_pad.view(b, max_q, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * max_q, d)
        mask_g = mask[:, None, None].expand(b, 1, group, max_q, max_s).reshape(b, 1, group * max_q, max_s)
        with sdpa_kernel(self.sdpa_backends) if self.sdpa_backends else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                qg, k_pad.transpose(1, 2), v_pad.transpose(1, 2), attn_mask=mask_g, scale=scale
            )  # [B, Hkv, group*Lq, D]
        out = out.view(b, hkv, group, max_q, d).permute(0, 3, 1, 2, 4).reshape(b, max_q, hq, d)
        return out[seq_of_tok, idx_in_seq]  # [T, Hq, D]

    __call__ = forward

