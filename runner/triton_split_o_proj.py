"""o_proj straight from a split decode attention's partials: the split merge inside the GEMV.

Why: at batch 1 the decode attention is split 32 ways (flash-decoding, runner/triton_attention.py)
and its partials are merged by a second launch before o_proj reads the merged [1, Hq * D] row.
That launch does almost no work, but it is one more kernel boundary on the step's critical path
(wait for the attention, read the partials from L2, write, drain: ~3 us per layer on the H200,
s11-run2's profile), and o_proj behind it is a GEMV that itself waits for its input. Here each
o_proj program merges the heads it multiplies, so the merge costs one L2 read inside the GEMV
instead of a launch:

* A program owns `block_n` output columns and `heads` query heads, i.e. the K slice
  [h0 * D, (h0 + heads) * D) of o_proj's weight, and writes one fp32 partial over that slice
  (split-K over heads): out [Hq / heads, B, N], summed in slice order by the add + RMSNorm that
  consumes o_proj's output (runner/triton_linear.Partials), as the split-K o_proj of 2..64 rows
  already is.
* Its whole weight tile is loaded before the PDL wait (weights are never written), so o_proj's
  weight bytes stream while the attention still runs; after the wait only the partials of its
  heads are read, and only those of live splits (the split rule from seq_len, which the host
  wrote before the step).
* The merge is `_merge_splits_kernel`'s arithmetic (rescale to the heads' max, l-weighted sum,
  divide, round to the model dtype), so the GEMV multiplies the merged row the separate merge
  would have written, up to the fp32 order of the sum over splits.

Sized for one row (the graph bucket of batch 1): every further row repeats the weight reads,
so the tile table (`TUNED`) uses it at M = 1 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runner.attention import AttentionSplits
from runner.triton_attention import _NEG, _split_range
from runner.triton_linear import Partials
from runner.triton_pdl import pdl_enter


@dataclass(frozen=True)
class SplitOTile:
    block_n: int  # output columns per program
    heads: int  # query heads per program (a power of two dividing Hq): Hq / heads partials
    num_warps: int = 4


@triton.jit
def _split_o_proj_kernel(
    acc_ptr,  # [B, Hq, S, D] fp32 attention partials (unnormalised)
    m_ptr,  # [B, Hq, S] fp32 running max, log2 domain
    l_ptr,  # [B, Hq, S] fp32 running sum of exp2
    seq_lens_ptr,  # [B] int32
    w_ptr,  # [N, Hq * D] o_proj weight, row stride stride_wn, the model dtype
    out_ptr,  # [Hq / HEADS, B, N] fp32 partials
    B,
    N,
    stride_wn,
    num_q_heads,
    max_blocks,  # the attention launch's block-table width (its seq_len clamp)
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,  # NUM_SPLITS padded to a power of two
    ATTN_BLOCK_SIZE: tl.constexpr,
    ATTN_BLOCK_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    g = tl.program_id(1)  # head slice
    b = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    heads = g * HEADS + tl.arange(0, HEADS)
    offs_d = tl.arange(0, HEAD_DIM)
    # The weight tile [BLOCK_N, HEADS, D] before the wait: no kernel writes weights.
    cols = heads[:, None] * HEAD_DIM + offs_d[None, :]  # [HEADS, D]
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_wn + cols[None, :, :],
                mask=n_mask[:, None, None], other=0.0)
    # Live splits from seq_len (written by the host before the step, so also before the wait):
    # the attention kernel's own split rule. Dead splits hold (m = _NEG, l = 0, acc = 0), so
    # skipping them changes nothing but the bytes read.
    offs_s = tl.arange(0, SPLITS_P)
    _, _, t_lo, t_hi = _split_range(seq_lens_ptr, b, offs_s, max_blocks, ATTN_BLOCK_SIZE, ATTN_BLOCK_N, NUM_SPLITS)
    live = (offs_s < NUM_SPLITS) & (t_lo < t_hi)  # [SPLITS_P]
    pdl_enter(USE_GDC)

    rows = (b * num_q_heads + heads)[:, None] * NUM_SPLITS + offs_s[None, :]  # [HEADS, SPLITS_P]
    m = tl.load(m_ptr + rows, mask=live[None, :], other=_NEG)
    l = tl.load(l_ptr + rows, mask=live[None, :], other=0.0)
    acc = tl.load(acc_ptr + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=live[None, :, None],
                  other=0.0)  # [HEADS, SPLITS_P, D]
    # _merge_splits_kernel's arithmetic per head: every split rescaled to the head's max
    m_max = tl.max(m, 1)
    wgt = tl.exp2(m - m_max[:, None])  # [HEADS, SPLITS_P]
    l_tot = tl.sum(l * wgt, 1)  # [HEADS]
    o = tl.sum(acc * wgt[:, :, None], 1)  # [HEADS, D]
    o = tl.where(l_tot[:, None] > 0.0, o / tl.where(l_tot > 0.0, l_tot, 1.0)[:, None], 0.0)
    x = o.to(w_ptr.dtype.element_ty).to(tl.float32)  # the merged row, rounded where the merge rounds
    y = tl.sum(tl.sum(w.to(tl.float32) * x[None, :, :], 2), 1)  # [BLOCK_N]
    tl.store(out_ptr + (g * B + b).to(tl.int64) * N + offs_n, y, mask=n_mask)


def split_o_proj(splits: AttentionSplits, weight: torch.Tensor, tile: SplitOTile, *, pdl: bool = False) -> Partials:
    """o_proj (no bias) of the merged attention rows, as fp32 partials over head slices for the
    add + RMSNorm that consumes them. weight: [N, Hq * D] in the attention output's dtype.

    Reads only shapes on the host: capturable in a CUDA graph once compiled."""
    bsz, hq, s, d = splits.acc.shape
    n, k = weight.shape
    assert k == hq * d and weight.stride(1) == 1 and weight.dtype == splits.dtype, (weight.shape, weight.dtype)
    assert hq % tile.heads == 0, (hq, tile)
    slices = hq // tile.heads
    out = torch.empty(slices, bsz, n, device=weight.device, dtype=torch.float32)
    if bsz:
        grid = (triton.cdiv(n, tile.block_n), slices, bsz)
        _split_o_proj_kernel[grid](
            splits.acc, splits.m, splits.l, splits.seq_lens, weight, out,
            bsz, n, weight.stride(0), hq, splits.max_blocks,
            HEADS=tile.heads, HEAD_DIM=d, NUM_SPLITS=s, SPLITS_P=triton.next_power_of_2(s),
            ATTN_BLOCK_SIZE=splits.block_size, ATTN_BLOCK_N=splits.block_n, BLOCK_N=tile.block_n,
            USE_GDC=pdl, num_warps=tile.num_warps, launch_pdl=pdl,
        )  # fmt: skip
    return Partials(out, splits.dtype)


# (N, Hq, D) -> ((max_m, tile or None), ...) in increasing max_m; past the last row, or None: the
# attention merges and o_proj runs as a plain GEMM. Orpheus-3B / Llama-3.2-3B: o_proj 3072 x
# (24 x 128).
TUNED: dict[tuple[int, int, int], tuple[tuple[int, SplitOTile | None], ...]] = {
    (3072, 24, 128): ((1, SplitOTile(64, 4, 8)),),
}


def default_tile(n: int, num_heads: int, head_dim: int, m: int) -> SplitOTile | None:
    """Shape-generic choice: one row, K slices of at most 512 (2 to 8 partials on common heads)."""
    if m != 1:
        return None
    heads = 1
    while num_heads % (2 * heads) == 0 and 2 * heads * head_dim <= 512:
        heads *= 2
    return SplitOTile(32, heads, 4)


def tile_for(n: int, num_heads: int, head_dim: int, m: int) -> SplitOTile | None:
    """The tile for o_proj [n, num_heads * head_dim] over the splits of m rows, or None. Like
    runner/triton_linear.tile_for it changes only at graph bucket sizes."""
    rows = TUNED.get((n, num_heads, head_dim))
    if rows is None:
        return default_tile(n, num_heads, head_dim, m)
    for max_m, tile in rows:
        if m <= max_m:
            return tile
    return None
