"""Skinny GEMMs of the decode step in Triton: out = x @ W^T (+ bias) for M <= 64 rows.

Why: a decode step streams every weight once, so its GEMMs should run at copy bandwidth, and
its ~300 launches each cost a few microseconds. On the H200 cuBLAS reaches 1.9-3.9 TB/s of
~4.2 on these shapes (batch 1: o_proj 1.9, down 2.7; sweep in deploy/RESULTS.md), and a cuBLAS
kernel can neither take part in the programmatic-dependent-launch chain
(runner/kernels/pdl.py) nor absorb the SiLU*mul after gate_up. The tile table (`TUNED`) keeps
cuBLAS wherever it measured faster.

Two modes, picked by the tile:
* GEMV (block_m == 1, only for M == 1): a program owns `block_n` weight rows and walks K in
  `block_k` slices; the next slice's weights are loaded before the current one is reduced
  (double buffering in registers), and the first slice before the PDL wait, since no kernel
  writes weights. fp32 FMA.
* MMA (block_m >= 16): `tl.dot` on [block_m, block_k] x [block_k, block_n] tiles, Triton's
  software pipeline (`num_stages`) streaming W through shared memory, its tiles loaded by
  pointer or, with `LinearTile.tma`, by the TMA unit (the split o_proj / down from 17 rows,
  gate_up's ragged groups from 33 rows, qkv from 33).

Each output element is one program's dot product over K in a fixed order, so a row's result
depends on neither M nor the other rows (graph padding cannot change it). The one exception to
"one program per output" is opt-in: `split_k=S` (o_proj / down between 2 and 64 rows, table
`SPLIT_TUNED`) writes S fp32 partials over consecutive K ranges, each again a fixed-order dot
product independent of the other rows, and leaves the sum (in split order, no atomics) to the
add + RMSNorm that consumes them (`Partials`, `materialize`).

Gated epilogue (the MLP's gate_up, `gated=True`): a program computes the same columns of the
gate and the up half and writes silu(gate) * up [M, I], rounded where the separate GEMM and
SiLU*mul kernel round (runner/kernels/fused_ops.py), so the result is bit for bit that pair's;
the SiLU*mul launch and the [M, 2I] round trip disappear.

PDL trigger placement (`LinearTile.late_trigger`, MMA tiles): a kernel normally lets the next
one launch right after its own wait, so the next kernel's programs start while this one streams
its weights and issue their pre-wait loads (a GEMV's first weight slice) into the same memory
queues. After the MMA tiles that is a loss: gate_up streams 100 MB and the down GEMV behind it
puts its first slices (6 MB at batch 1) in its way. With `late_trigger` every program triggers
after its stores, so the next kernel launches as this one drains. H200, alternated on fresh
models (s14-run6/7): batch 1 2.064-2.087 ms against 2.109-2.113, batch 8 2.539-2.552 against
2.637-2.663, batch 64 3.085-3.095 against 3.101-3.114, batch 32 the same; GEMVs triggering late
lost (batch 1 2.182: the attention's early loads under qkv's tail need the early launch), and so
did the split merge (2.122: o_proj's first slices then no longer load under it), s14-run5.

Norm fold (`residual_linear` + `row_scale`, TritonOps.post_attention, table `FOLD_TUNED`): o_proj
adds the residual in its epilogue and hands gate_up h * w and the rows' sums of squares per
column block; gate_up multiplies its fp32 accumulator by each row's rsqrt. The RMSNorm's
weight goes in before the product and its row factor after it, so gate_up's A tiles still go
from shared memory to the tensor cores (s13's fold normalised them in registers and lost).

Tried on the H200 and dropped (deploy/RESULTS.md, s5): the RMSNorm as a prologue (every
program recomputes the row statistics: slower than the norm kernel), SiLU*mul as down's prologue
(the gated epilogue does it once per element), an add + RMSNorm epilogue run by the last
program to finish (the gpu-scope ticket costs more than the norm's own launch), and L2
prefetch of the weights before the PDL wait (slower at every size). s13: the RMSNorm across
the GEMV boundary at M = 1 (o_proj / down adding the residual and writing per-program sums of
squares, qkv / gate_up normalising x as they load it, with the norm kernel's roundings): batch 1
2.397 / 2.405 ms against 2.158 / 2.161 without. Normalising the A tiles of gate_up's MMA loop cost
~9 us per layer; with only qkv (GEMV) fused, 2.177; with gate_up as a GEMV, 2.238 against 2.284 for
that GEMV unfused, both slower than the MMA tile unfused. s14: o_proj and down at M = 1 as split
GEMVs (fp32 partials for the norm, 2 to 8 splits): batch 1 2.136-2.243 ms against 2.107-2.110.
s20: o_proj / down at 64 rows as stream-K (every SM takes the same run of the flattened tile x K
iterations, 1-7 partial slots per column tile; code in ea51184): alone 9.7 / 18.1 us against 8.5 /
17.0, engine batch 64 3.068-3.145 ms against 2.976-2.993; and Triton's warp-specialised TMA loop
(`tl.range(warp_specialize=True)`, deploy/ws_probe.py) slower than the same loop without it at
every shape (M = 64: o_proj 9.1 against 7.5 us, down 18.4 against 16.7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from runner.kernels.gpu_info import num_sms
from runner.kernels.pdl import pdl_enter, pdl_trigger, pdl_wait

PLAIN, GATED = 0, 1  # tile-table kinds: out = x @ W^T, or the gated gate_up (out [M, I])
KIND_NAMES = {PLAIN: "plain", GATED: "gated"}

# Largest M served here; above it cuBLAS's tensor-core GEMMs are the better choice.
MAX_M = 64


@dataclass(frozen=True)
class LinearTile:
    block_m: int  # 1: GEMV mode (M == 1); else 16/32/64, MMA mode
    block_n: int  # output columns per program (gated: of each half)
    block_k: int  # must divide K
    num_warps: int = 4
    num_stages: int = 3  # MMA mode's pipeline depth (GEMV mode double-buffers by hand)
    # MMA mode: let the next kernel launch (PDL) only after this one's stores instead of right
    # after its wait, so the next kernel's early loads do not compete with this one's stream
    late_trigger: bool = False
    # MMA mode: 0, block_n-wide column tiles; > 0, that many programs per row block split the N
    # columns into ragged groups (boundaries on multiples of 8 columns, each at most block_n
    # wide, the rest of the tile masked); PER_SM, one group per SM of the device where such
    # groups fit in block_n (else plain tiles). Why: a program streams its weights at ~30-45
    # GB/s, so a GEMM of cdiv(N, block_n) = 128 long programs on 132 SMs leaves four SMs' share
    # of the bandwidth unused (ncu and the engine A/B in deploy/RESULTS.md, s19)
    groups: int = 0
    # MMA mode (gated column tiles: N % block_n == 0, or ragged groups): x and W tiles come in
    # through TMA (host-built tensor descriptors; rows past M or the weight's arrive as zeros, rows
    # of other columns are loaded and their results masked) instead of pointer loads, the same
    # tiles in the same order (bit for bit the pointer tile's result). Why: the split o_proj /
    # down tiles at 17..64 rows, gate_up at 33..64 and qkv at 33..64 run faster (SPLIT_TUNED's and
    # TUNED's comments)
    tma: bool = False


PER_SM = -1  # LinearTile.groups: one ragged column group per SM


@triton.jit
def silu_mul(g, u):
    """silu(g) * u of gate and up in the model dtype, rounded where torch rounds: F.silu's
    result, then the product. The one definition of the SiLU*mul roundings, shared by the
    gated epilogue and runner/kernels/fused_ops.py's SiLU*mul kernel (so the two agree bit for
    bit)."""
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


# M varies per eager step: not specialising on it (== 1, % 16) keeps one variant per tile (N: so
# that it is never a constexpr, whatever its value).
@triton.jit(do_not_specialize=["M", "N"])
def _skinny_linear_kernel(
    x_ptr,  # [M, K], last dim contiguous, row stride stride_xm
    w_ptr,  # [N, K] weight (nn.Linear layout), row stride stride_wn; GATED: [2N, K], gate | up
    b_ptr,  # [N] bias (HAS_BIAS)
    out_ptr,  # [M, N], row stride stride_om
    M,
    N,  # output columns (GATED: I, half the weight's rows)
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_split,  # SPLIT_K: K range of one split (a multiple of BLOCK_K)
    res_ptr,  # RESIDUAL: [M, N] the residual stream, row stride stride_rm
    g_ptr,  # RESIDUAL: [N] the RMSNorm weight
    xg_ptr,  # RESIDUAL: [M, N] out, row stride stride_om (as out), (out * g) in the model dtype
    ssq_ptr,  # RESIDUAL: [M, ssq_tiles] fp32 out, column pid_n; ROW_SCALE: read, ssq_tiles per row
    stride_rm,
    ssq_tiles,  # columns of ssq_ptr per row (RESIDUAL: the grid's column-block count)
    norm_n,  # ROW_SCALE: width of the normalised rows (the hidden size)
    eps,  # ROW_SCALE: the RMSNorm epsilon
    n_groups,  # RAGGED: column groups (the grid's first dimension)
    x_desc,  # TMA: tensor descriptor of x [M, K], block [BLOCK_M, BLOCK_K] (else unused)
    w_desc,  # TMA: tensor descriptor of W [N or 2N, K], block [BLOCK_N, BLOCK_K] (else unused)
    GATED: tl.constexpr,  # out = silu(x @ Wgate^T) * (x @ Wup^T)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr,
    SPLIT_K: tl.constexpr,  # > 1 (MMA mode, plain, no bias): out is fp32 partials [SPLIT_K, M, N]
    LATE_TRIGGER: tl.constexpr,  # MMA mode: the next kernel launches after the stores, not after the wait
    RESIDUAL: tl.constexpr = False,  # MMA, unsplit, plain: out = x @ W^T + residual, plus xg and ssq
    ROW_SCALE: tl.constexpr = False,  # MMA: each row's accumulator times rsqrt(sum(ssq row) / norm_n + eps)
    SSQ_P: tl.constexpr = 1,  # ROW_SCALE: ssq_tiles rounded up to a power of two
    RAGGED: tl.constexpr = False,  # MMA: program pid_n owns column group pid_n of n_groups (LinearTile.groups)
    TMA: tl.constexpr = False,  # MMA: x / W tiles through x_desc / w_desc (LinearTile.tma)
    EVEN_N: tl.constexpr = False,  # not RAGGED and N % BLOCK_N == 0: every column of every tile is valid
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rows < M
    if RAGGED:
        # columns [lo, hi): the n_groups-way split of N // 8 eight-column units (N % 8 == 0 and
        # hi - lo <= BLOCK_N, checked on the host)
        lo = tl.multiple_of((pid_n * (N // 8) // n_groups) * 8, 8)
        hi = ((pid_n + 1) * (N // 8) // n_groups) * 8
        n0 = lo
        offs_n = lo + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
    else:
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    up_shift = N.to(tl.int64) * stride_wn  # GATED: the up rows of these columns
    dt = out_ptr.dtype.element_ty

    if BLOCK_M == 1:
        # GEMV: the first weight slice is in flight before the wait (weights are never written).
        w_next = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        if GATED:
            u_next = tl.load(w_ptrs + up_shift, mask=n_mask[:, None], other=0.0)
        pdl_enter(USE_GDC)
        acc = tl.zeros([BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # the next slice (masked off past K) is issued before this one is reduced
            nxt = n_mask[:, None] & (k0 + BLOCK_K < K)
            w = w_next
            w_next = tl.load(w_ptrs + (k0 + BLOCK_K), mask=nxt, other=0.0)
            a = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0).to(tl.float32)  # [1, BK]
            acc += tl.sum(w.to(tl.float32) * a, axis=1)
            if GATED:
                wu = u_next
                u_next = tl.load(w_ptrs + up_shift + (k0 + BLOCK_K), mask=nxt, other=0.0)
                acc_u += tl.sum(wu.to(tl.float32) * a, axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if GATED:
            y = silu_mul(acc.to(dt), acc_u.to(dt))  # the GEMM's outputs rounded first
        else:
            y = acc.to(dt)
        tl.store(out_ptr + offs_n, y, mask=n_mask)
    else:
        # MMA. Split s (SPLIT_K > 1) sums the K range [s * k_split, (s + 1) * k_split) into its
        # own fp32 partial, which the consumer adds in split order (deterministic, no atomics);
        # unsplit, k_split == K. One K loop for both, so both round the same way.
        # The stores' (and the residual load's) mask. N is never specialised, so `offs_n < N` has
        # no known run of equal values along the columns and every access masked by it compiles to
        # scalar (st.global.b16 / .b32); masked by rows only they are 16-byte vectors.
        if EVEN_N:
            mn_mask = m_mask[:, None]
        else:
            mn_mask = m_mask[:, None] & n_mask[None, :]
        if RESIDUAL:  # the norm weight is never written by a kernel: loaded before the wait
            g = tl.load(g_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        pdl_wait(USE_GDC)
        if not LATE_TRIGGER:
            pdl_trigger(USE_GDC)
        if RESIDUAL:  # issued before the K loop, so its latency hides under the weight stream
            res = tl.load(res_ptr + rows.to(tl.int64)[:, None] * stride_rm + offs_n[None, :],
                          mask=mn_mask, other=0.0)
        if ROW_SCALE:  # the rows' RMSNorm factors from the producer's per-tile sums of squares
            t_cols = tl.arange(0, SSQ_P)
            sq = tl.load(ssq_ptr + rows.to(tl.int64)[:, None] * ssq_tiles + t_cols[None, :],
                         mask=m_mask[:, None] & (t_cols < ssq_tiles)[None, :], other=0.0)
            rstd = tl.math.rsqrt(tl.sum(sq, axis=1) / norm_n + eps)  # [BM]
        k_lo = tl.program_id(2) * k_split
        x_ptrs += k_lo
        w_ptrs += k_lo
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_split, BLOCK_K):
            if TMA:  # same tiles, same dot order: rows past M and W rows past the weight's arrive
                # as zeros; a ragged group's or a last tile's rows past its columns are other
                # columns' weights, whose results the stores mask
                a = x_desc.load([pid_m * BLOCK_M, k_lo + k0])
                w = w_desc.load([n0, k_lo + k0])
            else:
                a = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)  # [BM, BK]
                w = tl.load(w_ptrs + k0, mask=n_mask[:, None], other=0.0)  # [BN, BK]
            acc = tl.dot(a, tl.trans(w), acc)
            if GATED:
                if TMA:
                    wu = w_desc.load([N + n0, k_lo + k0])
                else:
                    wu = tl.load(w_ptrs + up_shift + k0, mask=n_mask[:, None], other=0.0)
                acc_u = tl.dot(a, tl.trans(wu), acc_u)
        if SPLIT_K > 1:
            # partials [SPLIT_K, M, N] contiguous, addressed through stride_om (== N, which a launch
            # never specialises; stride_om it does, as a multiple of 16)
            part = out_ptr + tl.program_id(2).to(tl.int64) * M * stride_om
            out_ptrs = part + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(out_ptrs, acc, mask=mn_mask)
        elif RESIDUAL:
            # The add + RMSNorm's first half, with its roundings (runner/kernels/fused_ops.py
            # _rmsnorm_kernel): the GEMM output in the model dtype, plus the residual, rounded.
            h = (acc.to(dt).to(tl.float32) + res.to(tl.float32)).to(dt)
            out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(out_ptrs, h, mask=mn_mask)
            hf = h.to(tl.float32)  # masked columns are 0
            tl.store(ssq_ptr + rows.to(tl.int64) * ssq_tiles + pid_n, tl.sum(hf * hf, axis=1), mask=m_mask)
            # xg's row stride is h's (stride_om, which a launch specialises as a multiple of 16),
            # not N (never specialised): with `rows * N` here ptxas serialises the K loop's MMAs
            # at 64-row tiles (C7514, "non wgmma instructions reading accumulator registers"), and
            # o_proj at 64 rows took 16.3 us instead of 10.5 (s21-run3)
            xg_ptrs = xg_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(xg_ptrs, (hf * g[None, :]).to(dt), mask=mn_mask)
        else:
            if ROW_SCALE:  # before the bias and the rounding: (rstd * x) @ W^T, then + b
                acc = acc * rstd[:, None]
                acc_u = acc_u * rstd[:, None]
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                y = silu_mul(acc.to(dt), acc_u.to(dt))  # the GEMM's outputs rounded first
            else:
                y = acc.to(dt)
            out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(out_ptrs, y, mask=mn_mask)
        if LATE_TRIGGER:
            pdl_trigger(USE_GDC)


class RowScale(NamedTuple):
    """An RMSNorm's row factors left unapplied: row r of the GEMM input is to be scaled by
    rsqrt(sum(ssq[r]) / n + eps). The GEMM applies it to its fp32 accumulator (a per-row factor
    commutes with the product), so the input reaches the tensor cores straight from shared
    memory. `ssq` [M, T] fp32 are a residual_linear's per-column-block sums of squares."""

    ssq: torch.Tensor
    n: int  # the normalised width (hidden size)
    eps: float


def skinny_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]; gated: [2I, K] (gate | up)
    bias: torch.Tensor | None,
    tile: LinearTile,
    *,
    gated: bool = False,  # out [M, I] = silu(x @ gate^T) * (x @ up^T), the MLP's activation
    pdl: bool = False,
    split_k: int = 1,  # > 1: fp32 partials [split_k, M, N] instead of out (plain, no bias, MMA)
    row_scale: RowScale | None = None,  # MMA, unsplit: (rstd * x) @ W^T, x's RMSNorm finished here
) -> torch.Tensor:
    """One launch: out [M, N] (gated: [M, I]) in x's dtype.

    Reads only shapes and strides on the host, so it can be captured in a CUDA graph (after one
    eager call per shape has compiled it)."""
    m = x.shape[0]
    n, k = weight.shape
    check_operands(x, weight, tile)
    if gated:
        assert n % 2 == 0 and bias is None, "gated: weight rows gate | up, no bias"
        n //= 2
    if split_k > 1:
        assert not gated and bias is None and tile.block_m > 1, "split-K: plain GEMM, no bias, MMA tile"
        assert k % (split_k * tile.block_k) == 0, (k, split_k, tile)
        out = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32)
    else:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if row_scale is not None:
        assert tile.block_m > 1 and split_k == 1, "row_scale: MMA tile, unsplit"
        ssq = row_scale.ssq
        assert ssq.shape[0] == m and ssq.is_contiguous() and ssq.dtype == torch.float32, (ssq.shape, m)
        scale = dict(ssq_ptr=ssq, ssq_tiles=ssq.shape[1], norm_n=row_scale.n, eps=row_scale.eps, ROW_SCALE=True,
                     SSQ_P=triton.next_power_of_2(ssq.shape[1]))
    else:
        scale = {}
    if m:
        _launch(x, weight, bias, out, tile, m, n, k, gated=gated, pdl=pdl, split_k=split_k, **scale)
    return out


def residual_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    residual: torch.Tensor,  # [M, N], x's dtype
    norm_weight: torch.Tensor,  # [N], the RMSNorm weight of the sum
    eps: float,  # ... and its epsilon
    tile: LinearTile,  # MMA
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, RowScale]:
    """x @ W^T + residual, and the RMSNorm of that sum left for the next GEMM, in one launch.

    Returns (h, xg, scale): h = the new residual stream [M, N] (the GEMM output rounded to the
    model dtype, plus the residual, rounded: the add + RMSNorm's sum bit for bit); xg = h * w
    [M, N] (w the norm weight); scale = the RMSNorm's row factors of h (`RowScale`, from fp32
    sums of squares per column block of this GEMM, [M, cdiv(N, block_n)]). rmsnorm(h) * w is
    rstd * xg up to where the roundings fall: skinny_linear(xg, W2, row_scale=scale) is the next
    GEMM on the normalised rows."""
    m = x.shape[0]
    n, k = weight.shape
    check_operands(x, weight, tile)
    assert tile.block_m > 1, "residual_linear: MMA tile"
    assert residual.shape == (m, n) and residual.dtype == x.dtype and residual.stride(1) == 1, residual.shape
    assert norm_weight.shape == (n,) and norm_weight.is_contiguous(), norm_weight.shape
    tiles = _column_groups(n, tile, x.device) or triton.cdiv(n, tile.block_n)
    h = torch.empty(m, n, device=x.device, dtype=x.dtype)
    xg = torch.empty(m, n, device=x.device, dtype=x.dtype)  # h's row stride (the kernel's stride_om)
    ssq = torch.empty(m, tiles, device=x.device, dtype=torch.float32)
    if m:
        _launch(x, weight, None, h, tile, m, n, k, gated=False, pdl=pdl, split_k=1, res_ptr=residual, g_ptr=norm_weight,
                xg_ptr=xg, ssq_ptr=ssq, stride_rm=residual.stride(0), ssq_tiles=tiles, RESIDUAL=True)
    return h, xg, RowScale(ssq, n, eps)


def check_operands(x: torch.Tensor, weight: torch.Tensor, tile: LinearTile) -> None:
    """x [M, K] and weight [N, K] fit `tile` (layouts, K, and what TMA needs): every launcher of
    a tile checks them here (also runner/kernels/qkv_rope.py)."""
    m, k = x.shape[0], weight.shape[1]
    assert x.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1, (x.shape, x.stride(), weight.stride())
    assert x.shape[1] == k and k % tile.block_k == 0, (x.shape, weight.shape, tile)
    assert tile.block_m > 1 or m <= 1, (m, tile)
    assert tile.block_m > 1 or not tile.late_trigger, "late_trigger: MMA tiles only"
    assert tile.block_m > 1 or not tile.groups, "groups: MMA tiles only"
    if tile.tma:
        assert tile.block_m > 1, f"tma: MMA tiles only, {tile}"
        for t in (x, weight):  # TMA: 16-byte aligned base and row stride
            assert t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0, (t.shape, t.stride())


def tile_descriptors(x: torch.Tensor, weight: torch.Tensor, tile: LinearTile, w_rows: int | None = None):
    """(x_desc, w_desc) for a launch of `tile`: TMA tensor descriptors of x [M, K] (block
    [block_m, block_k]) and of the weight (block [w_rows or block_n, block_k]) when tile.tma,
    else x twice (the kernels' unused placeholders). Host-built: the descriptors go into the
    launch (and a captured graph) by value. Every launcher of a tile builds them here (also
    runner/kernels/qkv_rope.py, runner/kernels/head_argmax.py)."""
    if not tile.tma:
        return x, x
    return (TensorDescriptor.from_tensor(x, [tile.block_m, tile.block_k]),
            TensorDescriptor.from_tensor(weight, [w_rows or tile.block_n, tile.block_k]))


def _column_groups(n: int, tile: LinearTile, device: torch.device) -> int:
    """Ragged column groups of `tile` over n columns on `device`; 0: plain block_n-wide tiles."""
    groups = num_sms(device) if tile.groups == PER_SM else tile.groups
    if groups <= 0:
        return 0
    fits = n % 8 == 0 and -(-(n // 8) // groups) * 8 <= tile.block_n
    if tile.groups == PER_SM:
        return groups if fits else 0
    assert fits, f"{groups} column groups of {n} columns do not fit {tile}"
    return groups


def _launch(x, weight, bias, out, tile: LinearTile, m: int, n: int, k: int, *, gated: bool, pdl: bool, split_k: int,
            res_ptr=None, g_ptr=None, xg_ptr=None, ssq_ptr=None, stride_rm=0, ssq_tiles=1, norm_n=1, eps=0.0,
            RESIDUAL=False, ROW_SCALE=False, SSQ_P=1) -> None:
    groups = _column_groups(n, tile, x.device)
    grid = (groups or triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m), split_k)
    # TMA: a gated tile's up rows start at N + its first column: whole column tiles (or ragged
    # groups) only there (plain tiles past N read zero rows, and their columns are masked at the
    # store)
    assert not tile.tma or not gated or groups or n % tile.block_n == 0, f"tma: gated N {n} not a multiple of {tile}"
    x_desc, w_desc = tile_descriptors(x, weight, tile)
    _skinny_linear_kernel[grid](
        x, weight, bias if bias is not None else weight, out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(-2), k // split_k,
        weight if res_ptr is None else res_ptr, weight if g_ptr is None else g_ptr,
        weight if xg_ptr is None else xg_ptr, out if ssq_ptr is None else ssq_ptr,
        stride_rm, ssq_tiles, norm_n, eps, max(groups, 1), x_desc, w_desc,
        GATED=gated, HAS_BIAS=bias is not None,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, USE_GDC=pdl, SPLIT_K=split_k,
        LATE_TRIGGER=tile.late_trigger, RESIDUAL=RESIDUAL, ROW_SCALE=ROW_SCALE, SSQ_P=SSQ_P, RAGGED=groups > 0,
        TMA=tile.tma, EVEN_N=groups == 0 and n % tile.block_n == 0, num_warps=tile.num_warps,
        num_stages=tile.num_stages, launch_pdl=pdl,
    )  # fmt: skip


class Partials(NamedTuple):
    """A GEMM's output left as fp32 split-K partials, for a consumer that sums them itself in
    split order and rounds once to `dtype` (the fused add + RMSNorm: runner/kernels/fused_ops.py;
    anything else calls `materialize`). Saves the separate reduce (cuBLAS's splitKreduce) and
    lets o_proj / down use split-K at all (N = 3072 is too few output tiles to keep HBM busy)."""

    parts: torch.Tensor  # [S, M, N] fp32, split s = the K range [s K/S, (s+1) K/S)
    dtype: torch.dtype  # the GEMM's output dtype


def materialize(h: torch.Tensor | Partials) -> torch.Tensor:
    """The GEMM output [M, N] in its dtype: partials summed in split order in fp32, rounded
    once; bit for bit what the fused add + RMSNorm uses as its input."""
    if not isinstance(h, Partials):
        return h
    acc = h.parts[0].clone()
    for p in h.parts[1:]:
        acc += p
    return acc.to(h.dtype)


def _largest_block_k(k: int, cap: int) -> int | None:
    bk = cap
    while bk >= 64:
        if k % bk == 0:
            return bk
        bk //= 2
    return None


# Measured on the H200 (`python3 deploy/bench_gpu.py --sections gemm`, s5-run4 in
# deploy/RESULTS.md): (kind, N, K) -> ((max_m, tile), ...) in increasing max_m. An M above
# the last max_m, or a kind/shape/M with no entry where an entry for the shape exists, is not
# served here (the caller uses cuBLAS). Shapes absent from the table
# (other models) use `default_tile`. Orpheus-3B / Llama-3.2-3B shapes: qkv 5120 x 3072,
# o 3072 x 3072, gate_up 16384 x 3072, down 3072 x 8192. qkv at M = 1 is the GEMV although
# cuBLAS is faster alone: launched with PDL it lets the split attention kernel after it start
# and load its K/V under the GEMV's tail (runner/kernels/attention.py PREFETCH_MIN_SPLITS), and
# the pair is faster: engine batch 1 2.162 / 2.164 ms against 2.199 / 2.241 with cuBLAS
# (s11-run2; 2.232 as the GEMV without the prefetch). The M = 1 rows were re-measured in the
# engine (s13-run7..9, `--sections variants`, batch 1, alternated on fresh models): GEMVs of 4
# rows per program (twice the programs of 8) and gate_up's MMA tile with 4 stages instead of 5
# took the step from 2.136-2.140 ms to 2.088-2.089 (o_proj + down at 4 rows: 2.103-2.106;
# + gate_up: 2.094-2.103; + qkv: 2.088-2.089); 2 rows per program or 2 warps lost (2.109-2.113).
# The gated MMA tiles trigger the next launch late (module docstring; s14-run6/7). From 2 rows
# gate_up runs one ragged column group per SM (132 programs instead of 128) and, at 33..64 rows,
# 128-wide K slices in 4 stages (5 x 64 before): alone at M = 64 27.6 us against 29.1; engine,
# alternated on fresh models (s19-run5), batch 8 / 16 / 32 / 64 2.341-2.342 / 2.465-2.469 /
# 2.651-2.658 / 2.979-2.981 ms against 2.343-2.351 / 2.485-2.487 / 2.672-2.685 / 3.023-3.025.
# At M = 1 the ragged tile lost (2.064-2.066 against 2.022-2.023). At 33..64 rows the groups load
# through TMA (s22-run5, alternated: batch 64 2.894-2.895 ms against 2.908-2.909); at 2..32 TMA
# groups lost (batch 16 / 32 2.431-2.433 / 2.578-2.579 against 2.403-2.406 / 2.560-2.565), and
# 64 x 64 x 64 TMA groups in 8 stages lost at 64 (2.927). qkv at 49..64 rows is a TMA tile
# (cuBLAS before): alone 10.59 us against cuBLAS 10.18 (12.06 in s20, before its stores were
# vectorised), and launched with PDL it lets the attention start under its tail: batch 64
# 2.867-2.876 ms against 2.890-2.893 (s22-run10, alternated 3 times); at 33..48 it lost (batch 48
# 2.715 against 2.701-2.707, s22-run9), and 8 warps lost at both. Since s23 an MMA qkv tile also
# brings RoPE and the KV write into its epilogue (TritonOps.qkv_rope_write), which pays at 2..16
# and 33..48 rows too (s24-run3/4, alternated on fresh models): the 16 x 64 x 128 pointer tile
# batch 4 / 8 2.194 / 2.266-2.271 ms against 2.225-2.228 / 2.286-2.288, batch 16 a tie
# (2.384-2.388 against 2.384-2.392); the 64-row TMA tile at 33..48 batch 40 2.734-2.738 against
# 2.746-2.755, batch 48 a tie (2.710-2.715 against 2.708-2.713). At 17..32 every tile tried lost
# by ~10 us per layer (batch 24 / 32 2.756-2.818 / 2.793-2.904 against 2.498-2.509 / 2.541-2.552:
# 32 x 64 x 128 TMA in 6 stages, pointer in 5, 32 x 64 x 64 in 6; not profiled).
TUNED: dict[tuple[int, int, int], tuple[tuple[int, LinearTile | None], ...]] = {
    (PLAIN, 5120, 3072): ((1, LinearTile(1, 4, 1024, 4, 1)), (16, LinearTile(16, 64, 128, 4, 5)), (32, None),
                          (48, LinearTile(64, 64, 128, 4, 6, tma=True)), (64, LinearTile(64, 64, 128, 4, 6, tma=True))),
    (PLAIN, 3072, 3072): ((1, LinearTile(1, 4, 1024, 4, 1)), (16, LinearTile(16, 32, 128, 4, 5)), (32, None), (64, None)),
    (PLAIN, 16384, 3072): ((1, None), (16, None), (32, None), (64, None)),
    (GATED, 16384, 3072): ((1, LinearTile(16, 64, 128, 4, 4, True)), (16, LinearTile(16, 64, 128, 4, 5, True, PER_SM)),
                           (32, LinearTile(32, 64, 128, 4, 5, True, PER_SM)),
                           (64, LinearTile(64, 64, 128, 4, 4, True, PER_SM, tma=True))),
    (PLAIN, 3072, 8192): ((1, LinearTile(1, 4, 1024, 4, 1)), (16, None), (32, None), (64, None)),
    # Orpheus-3B's lm_head (TritonOps.head runs only heads named here). M = 1 as the GEMV: alone
    # 210.8 us (4.57 TB/s) against cuBLAS 218.2 on the padded weight; engine batch 1 2.042 ms
    # against 2.051-2.054 (s15-run3). M = 64: every tile tied or lost against cuBLAS (238.0 us).
    (PLAIN, 156940, 3072): ((1, LinearTile(1, 4, 1024, 4, 1)), (16, None), (32, None), (64, None)),
}


# Split-K GEMMs whose output goes straight into the add + RMSNorm (o_proj, down): (N, K) ->
# ((max_m, tile or None, splits), ...) in increasing max_m, only for 1 < M (M = 1 keeps the
# GEMV, or cuBLAS); None, or an M past the last row: not split. In the GEMM sweep
# (`bench_gpu.py --sections splitk`, s6-run1) split-K beat cuBLAS / the unsplit tile at every
# M from 16 to 64 (o_proj M = 16: 7.2 vs 9.4 us; down M = 16 / 32 / 64: 15.1 / 16.1 / 16.9 vs
# 18.7 / 18.9 / 18.7), but the engine step (s6-run5/6, the same run twice, ms with and without)
# only gains at batch 8 (2.646 vs 2.706) and 64 (3.180 vs 3.206, down only), and loses at 16
# (2.756 vs 2.650) and 32 (2.970 vs 2.920); so only those buckets split. o_proj at M = 64 in 2
# splits of 64 x 64 x 128 tiles (s13-run12/13, alternated in the engine): batch 64 3.076 / 3.082 /
# 3.084 ms against 3.104 / 3.096 / 3.101 with cuBLAS (s9's 4-split tile had lost). The M <= 8 rows
# trigger the next launch late (module docstring); the M = 64 rows do not (every MMA tile late:
# batch 64 3.115 ms against 3.104-3.117, s14-run5). down at 9..16 rows in 4 splits (cuBLAS before;
# re-measured in s19-run7, alternated on fresh models): batch 12 / 16 2.408-2.415 / 2.439-2.444 ms
# against 2.448-2.449 / 2.466-2.469; at 17..32 rows 4 splits of 32 x 64 x 128 pointer tiles still
# lose (batch 24 / 32 2.648-2.649 / 2.693-2.699 against 2.617-2.622 / 2.669-2.673). From 17 rows
# both run as TMA tiles (LinearTile.tma; s20): alone, o_proj at M = 32 / 64 8.64 / 7.56 us against
# cuBLAS 9.58 / the 4-stage pointer split 8.39, down 15.63 / 16.24 against cuBLAS 18.42 / the
# pointer split 16.79 (s20-run3); engine, alternated on fresh models (s20-run4), batch 24 / 32 /
# 64 2.558-2.559 / 2.595-2.596 / 2.970-2.973 ms against 2.625-2.631 / 2.666-2.668 / 2.983-2.987,
# batch 8 / 16 unchanged. At 33..64 rows down then gains from 2 splits of 64 x 64 x 128 in 6
# stages (half the partials for the norm to add: alone 16.5 us against 16.2 for 4 splits) and
# o_proj from 5 stages: batch 48 / 64 2.753-2.766 / 2.910-2.919 ms against 2.791-2.804 /
# 2.963-2.971 (s20-run6/7); around that table (s20-run9, 2.915-2.918) these late-trigger, 8-warp
# and 64-wide-K variants lost (2.919-2.943). TMA lost elsewhere: the M <= 16 split and fold tiles (batch 8 / 16
# 2.349-2.353 / 2.447-2.450), gate_up at 64 rows (128 TMA tiles instead of the 132 ragged
# groups: 2.992), qkv at 64 (3.008 against cuBLAS's 2.984-2.990), s20-run3/4; both won in s22,
# as TMA-fed ragged groups and, with whole-column stores, as a qkv tile (TUNED's comment). Since
# s23 o_proj's 33..64 row serves the unfolded path only: the default folds the norm there
# (FOLD_TUNED).
SPLIT_TUNED: dict[tuple[int, int], tuple[tuple[int, LinearTile | None, int], ...]] = {
    (3072, 3072): ((8, LinearTile(16, 64, 64, 4, 4, True), 8), (32, LinearTile(32, 64, 128, 4, 4, tma=True), 2),
                   (64, LinearTile(64, 64, 128, 4, 5, tma=True), 2)),
    (3072, 8192): ((8, LinearTile(16, 32, 128, 4, 4, True), 4), (16, LinearTile(16, 32, 128, 4, 4, True), 4),
                   (32, LinearTile(32, 128, 128, 4, 4, tma=True), 4), (64, LinearTile(64, 64, 128, 4, 6, tma=True), 2)),
}


# GEMMs whose sum with the residual stream is RMS-normalised for an MLP (o_proj), run as
# residual_linear with the norm finished inside gate_up (TritonOps.post_attention): (N, K) ->
# ((max_m, tile or None), ...) in increasing max_m; None, or an M past the last row: the add +
# RMSNorm kernel between the two GEMMs. The tile is unsplit (a program owns whole output columns,
# so it can add the residual and square them). H200, greedy ms per step, alternated on fresh
# models (`bench_gpu.py --sections variants`, deploy/RESULTS.md s18-run5/7): batch 2 / 4 / 8
# 2.215-2.221 / 2.245 / 2.313-2.315 against 2.253-2.254 / 2.281-2.286 / 2.356-2.361 (o_proj
# split 8 ways plus the norm launch), batch 12 / 16 2.427-2.429 / 2.462-2.466 against 2.455 /
# 2.487-2.491. Not folded: batch 1 (o_proj as this MMA tile instead of the GEMV: 2.180-2.293
# against 2.007, s18-run8), 17..32 (a tie, 2.651-2.679 against 2.656-2.665) and 33..64: unsplit,
# o_proj over 64 rows streams too few weight bytes per program (every tile tried, 16-64 columns
# wide, 4-12 stages, 4 or 8 warps, 16-64 rows per program: 3.109-3.369 ms against 3.003-3.011
# for 2 split-K partials + the norm launch, s18-run1/3/6; profile: o_proj 18.3 us against 8.4;
# s20-run11, o_proj as an unsplit 64 x 32 x 128 TMA tile, 8.4 us alone: batch 64 3.063-3.071 ms
# against 2.920-2.929). Much of that was ptxas serialising the 64-row residual tile's MMAs (the
# xg stride, fixed in s21: residual_linear alone 16.3 -> 12.75 us, plain 10.4, all as the
# pointer tile: deploy/RESULTS.md s22's correction); with the fix the fold still lost a little:
# batch 32 / 64 2.624-2.627 / 2.927-2.933 against 2.599 / 2.917-2.922 (s21-run5). Once its h and
# xg left as 16-byte vectors (EVEN_N, s22) it won at 33..64 rows as that 64 x 32 x 128 TMA tile in
# 6 stages (9.0 us alone as residual_linear against 7.6 for the 2-split partials, but no norm
# launch): batch 64 2.820-2.831 ms against 2.855-2.869 with the row at None, batch 48 2.706-2.710
# against 2.715-2.720, batch 40 a tie (s23-run2/3, alternated on fresh models); 8 stages tied,
# 64 x 64 x 128 lost (3.034). At 17..32 rows the 32 x 32 x 128 TMA tile still lost (batch 24 / 32
# 2.511-2.514 / 2.542-2.546 against 2.496-2.503 / 2.529-2.535, s23-run3).
FOLD_TUNED: dict[tuple[int, int], tuple[tuple[int, LinearTile | None], ...]] = {
    (3072, 3072): ((1, None), (8, LinearTile(16, 32, 128, 4, 5)), (16, LinearTile(16, 32, 128, 4, 5)), (32, None),
                   (64, LinearTile(64, 32, 128, 4, 6, tma=True))),
}


def fold_tile_for(n: int, k: int, m: int) -> LinearTile | None:
    """residual_linear's tile for a GEMM [n, k] of m rows feeding an MLP's RMSNorm, or None.
    Thresholds at graph bucket sizes, like tile_for."""
    for max_m, tile in FOLD_TUNED.get((n, k), ()):
        if m <= max_m:
            return tile
    return None


def split_tile_for(n: int, k: int, m: int) -> tuple[LinearTile, int] | None:
    """(tile, splits) for a plain GEMM [n, k] of m rows whose consumer sums partials, or None.
    Thresholds at graph bucket sizes, like tile_for."""
    if m <= 1:
        return None
    for max_m, tile, splits in SPLIT_TUNED.get((n, k), ()):
        if m <= max_m:
            return None if tile is None else (tile, splits)
    return None


def default_tile(kind: int, n: int, k: int, m: int) -> LinearTile | None:
    """Shape-generic choice (either kind): GEMV at M == 1, MMA up to MAX_M."""
    if m < 1 or m > MAX_M:
        return None
    if m == 1:
        bk = _largest_block_k(k, 1024)
        return LinearTile(1, 16, bk, 4, 1) if bk else None
    bk = _largest_block_k(k, 256 if m <= 16 else 128)
    if bk is None:
        return None
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    return LinearTile(bm, 32, bk, 4, 4)


def tile_for(kind: int, n: int, k: int, m: int) -> LinearTile | None:
    """The tile for a call of `kind` (PLAIN or GATED) on a weight [n, k] with m rows, or None:
    leave it to cuBLAS (and, for GATED, the separate SiLU*mul kernel).

    The choice depends on M only through thresholds that are graph bucket sizes (1, 16, 32,
    64; runner/engine/cuda_graphs.py), so an eager step of M rows and a graph replay of M padded to
    its bucket take the same kernel."""
    rows = TUNED.get((kind, n, k))
    if rows is None:
        if (PLAIN, n, k) in TUNED:  # tuned shape, this kind measured not to pay
            return None
        return default_tile(kind, n, k, m)
    for max_m, tile in rows:
        if m <= max_m:
            return tile
    return None
