"""Skinny GEMMs of the decode step in Triton: out = x @ W^T (+ bias) for M <= 64 rows.

Why: a decode step streams every weight once, so its GEMMs should run at copy bandwidth, and
its ~300 launches each cost a few microseconds. cuBLAS reaches about half the HBM bandwidth on
some of these shapes (o_proj at one row), and a cuBLAS kernel can neither take part in the
programmatic-dependent-launch chain (runner/kernels/pdl.py) nor absorb the SiLU*mul after
gate_up. The device's tile table (runner/kernels/tuning, `LinearTables`) keeps cuBLAS wherever
it measured faster; a device without a table runs cuBLAS everywhere.

Two modes, picked by the tile:
* GEMV (block_m == 1, only for M == 1): a program owns `block_n` weight rows and walks K in
  `block_k` slices; the next slice's weights are loaded before the current one is reduced
  (double buffering in registers), and the first slice before the PDL wait, since no kernel
  writes weights. fp32 FMA.
* MMA (block_m >= 16): `tl.dot` on [block_m, block_k] x [block_k, block_n] tiles, Triton's
  software pipeline (`num_stages`) streaming W through shared memory, its tiles loaded by
  pointer or, with `LinearTile.tma`, by the TMA unit.

Each output element is one program's dot product over K in a fixed order, so a row's result
depends on neither M nor the other rows (graph padding cannot change it). The one exception to
"one program per output" is opt-in: `split_k=S` (the table's `split` rows) writes S fp32
partials over consecutive K ranges, each again a fixed-order dot product independent of the
other rows, and leaves the sum (in split order, no atomics) to the add + RMSNorm that consumes
them (`Partials`, `materialize`).

Gated epilogue (the MLP's gate_up, `gated=True`): a program computes the same columns of the
gate and the up half and writes silu(gate) * up [M, I], rounded where the separate GEMM and
SiLU*mul kernel round (runner/kernels/fused_ops.py), so the result is bit for bit that pair's;
the SiLU*mul launch and the [M, 2I] round trip disappear.

PDL trigger placement (`LinearTile.late_trigger`, MMA tiles): a kernel normally lets the next
one launch right after its own wait, so the next kernel's programs start while this one streams
its weights and issue their pre-wait loads (a GEMV's first weight slice) into the same memory
queues. After a long MMA GEMM (gate_up streams 100 MB) that competition costs more than the
early start gains: with `late_trigger` every program triggers after its stores, so the next
kernel launches as this one drains. GEMVs keep the early trigger: the attention's early loads
under qkv's tail need it.

Norm fold (`residual_linear` + `row_scale`, the table's `fold` rows): o_proj adds the residual
in its epilogue and hands gate_up h * w and the rows' sums of squares per column block; gate_up
multiplies its fp32 accumulator by each row's rsqrt. The RMSNorm's weight goes in before the
product and its row factor after it, so gate_up's A tiles still go from shared memory to the
tensor cores (normalising them in registers was slower).

Tried and dropped (docs/performance.md): the RMSNorm as a GEMM prologue (every program
recomputes the row statistics), SiLU*mul as down's prologue, an add + RMSNorm epilogue run by
the last program to finish (the gpu-scope ticket costs more than the norm's launch), L2
prefetch of the weights before the PDL wait, the RMSNorm across the GEMV boundary at M = 1,
o_proj / down at M = 1 as split GEMVs, stream-K o_proj / down at 64 rows, and Triton's
warp-specialised TMA loop: each slower than what is here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from runner.kernels.gpu_info import num_sms
from runner.kernels.pdl import pdl_enter, pdl_trigger, pdl_wait
from runner.kernels.tuning import LinearTables, read_table

# The tile type, the kinds and the shape-generic tile live with the tuning tables (no triton
# import there); re-exported here for the launchers' callers.
from runner.kernels.tuning.tiles import (  # noqa: F401
    GATED,
    KIND_NAMES,
    MAX_M,
    PER_SM,
    PLAIN,
    LinearTile,
    default_tile,
)


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
            # o_proj at 64 rows took 16.3 us instead of 10.5
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


# The reference device's tables (runner/kernels/tuning/nvidia_h200.json): the default of the
# lookups below for a caller that passes none (tests, benchmarks). A backend never uses it: it is
# given its device's `LinearTables`, chosen once at its construction (runner/layers/__init__.py,
# runner.kernels.tuning.load_tables).
REFERENCE: LinearTables = read_table("nvidia_h200").linear


def fold_tile_for(n: int, k: int, m: int, tables: LinearTables = REFERENCE) -> LinearTile | None:
    """residual_linear's tile for a GEMM [n, k] of m rows feeding an MLP's RMSNorm, or None.
    Thresholds at graph bucket sizes, like tile_for."""
    return tables.fold_tile(n, k, m)


def split_tile_for(n: int, k: int, m: int, tables: LinearTables = REFERENCE) -> tuple[LinearTile, int] | None:
    """(tile, splits) for a plain GEMM [n, k] of m rows whose consumer sums partials, or None.
    Thresholds at graph bucket sizes, like tile_for."""
    return tables.split_tile(n, k, m)


def tile_for(kind: int, n: int, k: int, m: int, tables: LinearTables = REFERENCE) -> LinearTile | None:
    """The tile for a call of `kind` (PLAIN or GATED) on a weight [n, k] with m rows, or None:
    leave it to cuBLAS (and, for GATED, the separate SiLU*mul kernel), from `tables`.

    The choice depends on M only through thresholds that are graph bucket sizes (1, 16, 32,
    64; runner/engine/cuda_graphs.py), so an eager step of M rows and a graph replay of M padded to
    its bucket take the same kernel."""
    return tables.tile(kind, n, k, m)
