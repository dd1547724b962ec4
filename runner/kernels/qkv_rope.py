"""The decode step's qkv GEMM with RoPE and the KV-cache write in its epilogue (CUDA, Triton).

Why: at batch 64 the attention kernel rotated q and this token's k itself and wrote k / v to
the cache before attending (`runner/kernels/attention.py`, FUSED_ROPE, write-first). That chain
(positions -> RoPE rows -> q / k / v -> rotate -> store -> CTA barrier) sits at the start of
each of its 512 programs, before the first K/V byte is requested: a tenth of the kernel at 350
tokens. Here the GEMM that produces q / k / v finishes them (its programs already hold the
values in registers), and the attention kernel after it is the plain one
(`TritonPagedAttention.forward_decode_cached`). The step gains less than the chain's cost per
layer: the RoPE rows are loaded after the K loop (see the kernel), on the GEMM's tail.

Layout: a program owns BLOCK_N columns of each half of one head: columns [n_a, n_a + BLOCK_N)
and [n_a + D/2, ...), n_a = head * D + part * BLOCK_N, so the rotate-half pairs (j, j + D/2)
meet in its registers (two tl.dot of BLOCK_N columns each, like gate_up's gate and up halves).
Heads [0, Hq) are q (rotated, written to q [M, Hq * D]), the next Hkv are k (rotated, written
to the cache), the last Hkv are v (written to the cache as they are). Nothing writes the k / v
part of a qkv output: only a caller that reads k and v from the cache may use this
(`TritonOps.qkv_rope_write`).

Numerics: the GEMM's output is rounded to the model dtype, then rotated with `rope_pair`, the
RoPE kernel's roundings: q and the cache hold what `skinny_linear` + `rope_(..., kv_cache=...)`
leave there, bit for bit wherever the two GEMMs agree (tests/kernels/test_triton_qkv_rope.py).

Importing this module needs `triton` (CUDA, or the interpreter in tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.kernels.linear import LinearTile, check_operands, tile_descriptors
from runner.kernels.pdl import pdl_trigger, pdl_wait
from runner.kernels.rope import rope_pair


# M varies per eager step: not specialised (one variant per tile).
@triton.jit(do_not_specialize=["M"])
def _qkv_rope_kernel(
    x_ptr,  # [M, K] (pointer tiles; TMA tiles read x_desc)
    w_ptr,  # [Hq * D + 2 * Hkv * D, K] q | k | v rows (pointer tiles; TMA tiles read w_desc)
    q_ptr,  # [M, Hq * D] out, row stride stride_qm
    kv_ptr,  # [2, NB * BS, Hkv, D] the cache, flat slots
    cos_ptr,  # [P, D] fp32, cat(f, f) rows: columns [0, D/2) are read
    sin_ptr,
    pos_ptr,  # [M] int positions
    slot_ptr,  # [M] int64 flat cache slots
    M,
    K,
    stride_xm,
    stride_wn,
    stride_qm,
    stride_kv,  # K -> V distance in the cache (may exceed int32; triton then types it int64)
    stride_slot,
    stride_kvh,
    stride_cos,
    stride_sin,
    max_pos,
    x_desc,  # TMA: tensor descriptor of x, block [BLOCK_M, BLOCK_K]
    w_desc,  # TMA: tensor descriptor of W, block [BLOCK_N, BLOCK_K]
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns per half (HEAD_DIM // 2 is a multiple of it)
    BLOCK_K: tl.constexpr,
    TMA: tl.constexpr,
    ROUND: tl.constexpr,  # 16-bit model dtype: round where torch materialises a tensor
    LATE_TRIGGER: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    PARTS: tl.constexpr = HALF // BLOCK_N
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    head = pid // PARTS  # 0..Hq-1 q, then k heads, then v heads
    part = pid % PARTS
    n_a = head * HEAD_DIM + part * BLOCK_N  # first of this program's columns in each half
    n_b = n_a + HALF
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rows < M
    cols = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    pdl_wait(USE_GDC)
    if not LATE_TRIGGER:
        pdl_trigger(USE_GDC)
    # Positions and slots (from the step's first kernel) are loaded before the K loop, so their
    # latency hides under the weight stream. A stale position in a padded graph row is clamped
    # into the table (its results go to the scratch slot).
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + rows, mask=m_mask, other=0).to(tl.int64), 0), max_pos - 1)
    slot = tl.load(slot_ptr + rows, mask=m_mask, other=0).to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    wa_ptrs = w_ptr + (n_a + cols).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    wb_ptrs = wa_ptrs + HALF * stride_wn
    acc_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if TMA:  # rows past M arrive as zeros
            a = x_desc.load([pid_m * BLOCK_M, k0])
            wa = w_desc.load([n_a, k0])
            wb = w_desc.load([n_b, k0])
        else:
            a = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
            wa = tl.load(wa_ptrs + k0)
            wb = tl.load(wb_ptrs + k0)
        acc_a = tl.dot(a, tl.trans(wa), acc_a)
        acc_b = tl.dot(a, tl.trans(wb), acc_b)
    # The RoPE rows ([BM, BN] fp32 each; L2-hot: the layer before read the same rows) after the
    # loop: loaded before it, they made ptxas serialise the loop's wgmma (C7514), as residual_linear's
    # xg did with an unspecialised stride (runner/kernels/linear.py).
    freq = part * BLOCK_N + cols  # [BN] index into the table's first half
    c = tl.load(cos_ptr + pos[:, None] * stride_cos + freq[None, :])  # [BM, BN] fp32
    s = tl.load(sin_ptr + pos[:, None] * stride_sin + freq[None, :])
    dt = q_ptr.dtype.element_ty
    xa = acc_a.to(dt)  # the GEMM's output in the model dtype, as the unfused RoPE reads it
    xb = acc_b.to(dt)
    if head < Q_HEADS + KV_HEADS:  # q and k: rotate (uniform per program)
        if ROUND:  # torch casts the fp32 table rows to the model dtype before use
            c = c.to(dt).to(tl.float32)
            s = s.to(dt).to(tl.float32)
        oa, ob = rope_pair(xa, xb, c, s, ROUND)
    else:
        oa, ob = xa, xb
    mask = m_mask[:, None]
    if head < Q_HEADS:
        dst = q_ptr + rows.to(tl.int64)[:, None] * stride_qm + n_a + cols[None, :]
        tl.store(dst, oa, mask=mask)
        tl.store(dst + HALF, ob, mask=mask)
    else:
        # runner.layers.attention.write_kv's cache write: k (rotated) and v of this token's slot
        is_v = head >= Q_HEADS + KV_HEADS
        kvh = (head - Q_HEADS) % KV_HEADS
        base = kv_ptr + tl.where(is_v, stride_kv, 0) + kvh * stride_kvh + part * BLOCK_N
        dst = base + slot[:, None] * stride_slot + cols[None, :]
        ety = kv_ptr.dtype.element_ty
        tl.store(dst, oa.to(ety), mask=mask)
        tl.store(dst + HALF, ob.to(ety), mask=mask)
    if LATE_TRIGGER:
        pdl_trigger(USE_GDC)


def qkv_rope_write(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [(Hq + 2 Hkv) * D, K]: q | k | v rows
    tile: LinearTile,  # MMA; its block_n counts both halves' columns (block_n / 2 per half)
    cos: torch.Tensor,  # [P, D] fp32, cat(f, f) rows
    sin: torch.Tensor,
    positions: torch.Tensor,  # [M]
    kv_cache: torch.Tensor,  # [2, NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [M] int64 flat slots
    num_q_heads: int,
    *,
    pdl: bool = False,
) -> torch.Tensor:  # q [M, Hq, D], rotated
    """q = RoPE(x @ Wq^T), and RoPE(x @ Wk^T) / x @ Wv^T written to the cache at slot_mapping,
    in one launch (module docstring). Reads only shapes and strides on the host (capturable)."""
    m, k = x.shape
    _, nb, bs, hkv, d = kv_cache.shape
    n = weight.shape[0]
    half = d // 2
    bn = tile.block_n // 2
    check_operands(x, weight, tile)
    assert n == (num_q_heads + 2 * hkv) * d, (weight.shape, num_q_heads, hkv, d)
    assert tile.block_m > 1 and half % bn == 0, (tile, d)
    assert x.dtype == weight.dtype == kv_cache.dtype, (x.dtype, weight.dtype, kv_cache.dtype)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape and cos.shape[1] == d
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and positions.shape == (m,) and slot_mapping.shape == (m,)
    flat = kv_cache.view(2, nb * bs, hkv, d)  # needs contiguous blocks, like write_kv
    assert flat.stride(3) == 1
    q = torch.empty(m, num_q_heads * d, device=x.device, dtype=x.dtype)
    if m == 0:
        return q.view(0, num_q_heads, d)
    x_desc, w_desc = tile_descriptors(x, weight, tile, w_rows=bn)  # a dot's W block: one half's columns
    grid = ((num_q_heads + 2 * hkv) * (half // bn), triton.cdiv(m, tile.block_m))
    _qkv_rope_kernel[grid](
        x, weight, q, flat, cos, sin, positions, slot_mapping,
        m, k, x.stride(0), weight.stride(0), q.stride(0),
        flat.stride(0), flat.stride(1), flat.stride(2), cos.stride(0), sin.stride(0), cos.shape[0],
        x_desc, w_desc,
        Q_HEADS=num_q_heads, KV_HEADS=hkv, HEAD_DIM=d, BLOCK_M=tile.block_m, BLOCK_N=bn, BLOCK_K=tile.block_k,
        TMA=tile.tma, ROUND=x.dtype != torch.float32, LATE_TRIGGER=tile.late_trigger, USE_GDC=pdl,
        num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return q.view(m, num_q_heads, d)
