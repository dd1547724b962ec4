"""Skinny GEMMs of the decode step in Triton: out = prologue(x) @ W^T (+ bias) for M <= 64 rows.

Why: a decode step streams every weight once, so its GEMMs should run at copy bandwidth. On the
H200 cuBLAS's kernels for these shapes reach 1.8-3.9 TB/s of ~4.3 (batch 64: o_proj 2.2, the
split-K down_proj 2.7 plus a reduce kernel; profiles in deploy/RESULTS.md), and a cuBLAS kernel
cannot take part in the programmatic-dependent-launch chain (runner/triton_pdl.py).

Two modes, picked by the tile:
* GEMV (block_m == 1, only for M == 1): a program owns `block_n` weight rows and walks K in
  `block_k` slices; the next slice's weights are loaded before the current one is reduced
  (double buffering in registers), and the first slice before the PDL wait, since no kernel
  writes weights. fp32 FMA.
* MMA (block_m >= 16): `tl.dot` on [block_m, block_k] x [block_k, block_n] tiles, Triton's
  software pipeline (`num_stages`) streaming W through shared memory.

No split-K: each output element is one program's dot product over K in a fixed order, so a
row's result depends on neither M nor the other rows (graph padding cannot change it).

Prologues form the activation tile on the fly, with the separate kernel's exact roundings
(runner/triton_fused_ops.py), from what that kernel would have read:
* PLAIN        x [M, K]
* SILU_MUL     x = gate | up [M, 2K] -> silu(gate) * up
* RMSNORM      x [M, K] -> rmsnorm(x) * w
* ADD_RMSNORM  x, residual [M, K] -> rmsnorm(x + residual) * w, and x + residual is written
               to `residual_out` (by the programs of the first column block)
The norm needs each row's sum of squares first: every program reads its rows once more (from
L2) before the main loop. The fused prologue is recomputed by all N / block_n programs, so it
pays only at small M; the tile table says where (`tile_for`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runner.triton_pdl import pdl_enter

PLAIN, SILU_MUL, RMSNORM, ADD_RMSNORM = 0, 1, 2, 3
PROLOGUE_NAMES = {PLAIN: "plain", SILU_MUL: "silu_mul", RMSNORM: "rmsnorm", ADD_RMSNORM: "add_rmsnorm"}

# Largest M served here; above it cuBLAS's tensor-core GEMMs are the better choice.
MAX_M = 64


@dataclass(frozen=True)
class LinearTile:
    block_m: int  # 1: GEMV mode (M == 1); else 16/32/64, MMA mode
    block_n: int
    block_k: int  # must divide K
    num_warps: int = 4
    num_stages: int = 3  # MMA mode's pipeline depth (GEMV mode double-buffers by hand)


@triton.jit
def _act_tile(
    x_ptr, res_ptr, nw_ptr, res_out_ptr, rows, m_mask, cols, K, stride_xm, stride_rm, rinv,
    WRITE_RES, PROLOGUE: tl.constexpr,
):
    """The [BM, BK] activation tile (model dtype) at columns `cols` of rows `rows`."""
    xp = x_ptr + rows[:, None] * stride_xm + cols[None, :]
    mask = m_mask[:, None]
    if PROLOGUE == 1:  # SILU_MUL: x holds gate | up
        g = tl.load(xp, mask=mask, other=0.0)
        u = tl.load(xp + K, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu rounds, then the product rounds
        return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    x = tl.load(xp, mask=mask, other=0.0)
    if PROLOGUE == 0:
        return x
    if PROLOGUE == 3:  # the residual sum, rounded to the model dtype like torch's `x + residual`
        r = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + rows[:, None] * K + cols[None, :], x, mask=mask & WRITE_RES)
    normed = (x.to(tl.float32) * rinv[:, None]).to(x.dtype)
    w = tl.load(nw_ptr + cols)
    return (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(x.dtype)


@triton.jit
def _row_rinv(x_ptr, res_ptr, rows, m_mask, offs_k, K, stride_xm, stride_rm, eps,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr):
    """[BM] 1 / rms of each row (of x + residual for ADD_RMSNORM); ones when no norm."""
    if PROLOGUE >= 2:
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs_k
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=m_mask[:, None], other=0.0)
            if PROLOGUE == 3:
                r = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=m_mask[:, None], other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
        return tl.math.rsqrt(ss / K + eps)
    return tl.full([BLOCK_M], 1.0, tl.float32)


# M varies per eager step: not specialising on it (== 1, % 16) keeps one variant per tile.
@triton.jit(do_not_specialize=["M"])
def _skinny_linear_kernel(
    x_ptr,  # [M, K] (SILU_MUL: [M, 2K]), last dim contiguous, row stride stride_xm
    res_ptr,  # [M, K] residual (ADD_RMSNORM)
    nw_ptr,  # [K] norm weight (RMSNORM, ADD_RMSNORM)
    res_out_ptr,  # [M, K] contiguous, x + residual (ADD_RMSNORM)
    w_ptr,  # [N, K] weight (nn.Linear layout), row stride stride_wn
    b_ptr,  # [N] bias (HAS_BIAS)
    out_ptr,  # [M, N], row stride stride_om
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_om,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    write_res = pid_n == 0

    if BLOCK_M == 1:
        # GEMV: the first weight slice is in flight before the wait (weights are never written).
        w_next = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        pdl_enter(USE_GDC)
        rinv = _row_rinv(x_ptr, res_ptr, rows, m_mask, offs_k, K, stride_xm, stride_rm, eps,
                         BLOCK_M, BLOCK_K, PROLOGUE)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = w_next
            # next slice (masked off past K) before this one is reduced
            w_next = tl.load(w_ptrs + (k0 + BLOCK_K), mask=n_mask[:, None] & (k0 + BLOCK_K < K), other=0.0)
            a = _act_tile(x_ptr, res_ptr, nw_ptr, res_out_ptr, rows, m_mask, k0 + offs_k, K, stride_xm,
                          stride_rm, rinv, write_res, PROLOGUE)  # [1, BK]
            acc += tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask & (M > 0))
    else:
        pdl_enter(USE_GDC)
        rinv = _row_rinv(x_ptr, res_ptr, rows, m_mask, offs_k, K, stride_xm, stride_rm, eps,
                         BLOCK_M, BLOCK_K, PROLOGUE)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = _act_tile(x_ptr, res_ptr, nw_ptr, res_out_ptr, rows, m_mask, k0 + offs_k, K, stride_xm,
                          stride_rm, rinv, write_res, PROLOGUE)  # [BM, BK]
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None], other=0.0)  # [BN, BK]
            acc = tl.dot(a, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def skinny_linear(
    x: torch.Tensor,  # [M, K]; SILU_MUL: [M, 2K] (gate | up)
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,
    tile: LinearTile,
    prologue: int = PLAIN,
    *,
    residual: torch.Tensor | None = None,  # [M, K], ADD_RMSNORM
    norm_weight: torch.Tensor | None = None,  # [K], RMSNORM / ADD_RMSNORM
    eps: float = 0.0,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch. Returns (out [M, N] in x's dtype, x + residual [M, K] for ADD_RMSNORM else None).

    Reads only shapes and strides on the host, so it can be captured in a CUDA graph (after one
    eager call per shape has compiled it)."""
    m = x.shape[0]
    n, k = weight.shape
    assert x.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1, (x.shape, x.stride(), weight.stride())
    assert x.shape[1] == (2 * k if prologue == SILU_MUL else k), (x.shape, weight.shape, prologue)
    assert k % tile.block_k == 0, (k, tile)
    assert tile.block_m > 1 or m <= 1, (m, tile)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    res_out = None
    if prologue == ADD_RMSNORM:
        assert residual is not None and residual.shape == x.shape and residual.stride(1) == 1
        res_out = torch.empty(m, k, device=x.device, dtype=x.dtype)
    if prologue in (RMSNORM, ADD_RMSNORM):
        assert norm_weight is not None and norm_weight.shape == (k,) and norm_weight.is_contiguous()
    if m == 0:
        return out, res_out
    grid = (triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m))
    _skinny_linear_kernel[grid](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight,
        res_out if res_out is not None else out, weight, bias if bias is not None else weight, out,
        m, n, k, x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0), out.stride(0),
        eps,
        PROLOGUE=prologue, HAS_BIAS=bias is not None,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, USE_GDC=pdl,
        num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return out, res_out


def _largest_block_k(k: int, cap: int) -> int | None:
    bk = cap
    while bk >= 64:
        if k % bk == 0:
            return bk
        bk //= 2
    return None


# Measured on the H200 (`python3 deploy/bench_gpu.py --sections gemm`, results in
# deploy/RESULTS.md): (prologue, N, K) -> ((max_m, tile), ...) in increasing max_m. An M above
# the last max_m, or a prologue/shape/M with no entry where an entry for the shape exists,
# is not served here (the caller runs the separate ops and cuBLAS). Shapes absent from the
# table (other models) use `default_tile`.
TUNED: dict[tuple[int, int, int], tuple[tuple[int, LinearTile | None], ...]] = {
    (PLAIN, 5120, 3072): ((1, None), (16, None), (32, None), (64, None)),
    (ADD_RMSNORM, 5120, 3072): ((1, None), (16, None)),
    (PLAIN, 3072, 3072): ((1, LinearTile(1, 8, 1024, 4, 1)), (16, LinearTile(16, 32, 512, 4, 3)), (32, None), (64, None)),
    (PLAIN, 16384, 3072): ((1, None), (16, None), (32, None), (64, None)),
    (ADD_RMSNORM, 16384, 3072): ((1, None), (16, None)),
    (PLAIN, 3072, 8192): ((1, LinearTile(1, 8, 1024, 4, 1)), (16, None), (32, None), (64, None)),
    (SILU_MUL, 3072, 8192): ((1, LinearTile(1, 8, 1024, 4, 1)), (16, None)),
}


def default_tile(prologue: int, n: int, k: int, m: int) -> LinearTile | None:
    """Shape-generic choice: GEMV at M == 1, MMA up to MAX_M; fused prologues only at M == 1."""
    if m < 1 or m > MAX_M:
        return None
    if prologue != PLAIN and m > 1:
        return None
    if m == 1:
        bk = _largest_block_k(k, 1024)
        return LinearTile(1, 16, bk, 4, 1) if bk else None
    bk = _largest_block_k(k, 256 if m <= 16 else 128)
    if bk is None:
        return None
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    return LinearTile(bm, 32, bk, 4, 4)


def tile_for(prologue: int, n: int, k: int, m: int) -> LinearTile | None:
    """The tile for this call, or None: leave it to the separate ops + cuBLAS.

    The choice depends on M only through thresholds that are graph bucket sizes (1, 16, 32,
    64; runner/cuda_graphs.py), so an eager step of M rows and a graph replay of M padded to
    its bucket take the same kernel."""
    # layer 0's plain RMSNorm (no residual) costs what the add + RMSNorm costs: same entry
    rows = TUNED.get((ADD_RMSNORM if prologue == RMSNORM else prologue, n, k))
    if rows is None:
        if (PLAIN, n, k) in TUNED:  # tuned shape, this prologue measured not to pay
            return None
        return default_tile(prologue, n, k, m)
    for max_m, tile in rows:
        if m <= max_m:
            return tile
    return None
