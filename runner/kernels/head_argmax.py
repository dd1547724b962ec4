"""Greedy ids straight from the lm_head GEMM: argmax(x @ W^T) without writing the logits (CUDA,
Triton).

Why: a greedy step needs only each row's first maximal id, but the plain path writes the [M, V]
logits (Orpheus: 156940 ids, 20 MB in bf16 at 64 rows) and reads them back in the argmax's
pieces (runner/kernels/argmax.py): ~9 us of the argmax plus the write, on every step's critical
path. Here each program of the lm_head GEMM reduces its own [BLOCK_M, BLOCK_N] tile of logits to
each row's maximum and its first index, and writes only those (8 bytes per row and tile); the
second launch (`pick_pieces`) picks, per row, the first tile holding the row's maximum. At 64
rows of Orpheus-3B's head that is ~9% less time than cuBLAS + the argmax, and less than this
tile writing its logits + the argmax.

Numerics: the logits are the GEMM's accumulator rounded to the model dtype, the value
`skinny_linear` with the same tile would store, so the ids are exactly
`row_argmax(skinny_linear(x, W, None, tile))` (tests/kernels/test_triton_head_argmax.py): torch's
argmax of those logits, first index of the maximum, for rows without NaN. Against cuBLAS's
logits (the unfused path where no tile is tuned) a row may differ where two logits are within
one rounding of each other: another GEMM, another accumulation order.

Used by TritonOps.greedy_head only where the device's table (runner/kernels/tuning, its `head`
rows) names the head's shape and the step's row count; elsewhere the head and the argmax stay
two kernels.

Importing this module needs `triton` (CUDA, or the interpreter in tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.kernels.argmax import pick_pieces
from runner.kernels.linear import (
    REFERENCE,
    LinearTile,
    check_operands,
    tile_descriptors,
)
from runner.kernels.pdl import pdl_trigger, pdl_wait
from runner.kernels.tuning import LinearTables


# M varies per eager step and V is any vocabulary: neither is specialised (one variant per tile).
@triton.jit(do_not_specialize=["M", "V"])
def _head_argmax_kernel(
    x_ptr,  # [M, K] (pointer tiles; TMA tiles read x_desc)
    w_ptr,  # [V, K] the head's weight (pointer tiles; TMA tiles read w_desc)
    val_ptr,  # [M, P] fp32 out: each tile's row maxima (P = the grid's column tiles or groups)
    idx_ptr,  # [M, P] int32 out: the first vocabulary index of each
    M,
    V,
    K,
    stride_xm,
    stride_wn,
    P,
    x_desc,  # TMA: tensor descriptor of x, block [BLOCK_M, BLOCK_K]
    w_desc,  # TMA: tensor descriptor of W, block [BLOCK_N, BLOCK_K]
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RAGGED: tl.constexpr,  # P ragged column groups (LinearTile.groups) instead of BLOCK_N-wide tiles
    TMA: tl.constexpr,
    LATE_TRIGGER: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # row blocks vary fastest in launch order: past BLOCK_M rows a weight tile's second reader
    # runs beside its first and finds it in L2
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rows < M
    if RAGGED:
        # columns [lo, min(hi, V)): the P-way split of cdiv(V, 8) eight-column units, each group
        # at most BLOCK_N wide (checked on the host)
        units = (V + 7) // 8
        n0 = tl.multiple_of((pid_n * units // P) * 8, 8)
        hi = tl.minimum(((pid_n + 1) * units // P) * 8, V)
    else:
        n0 = pid_n * BLOCK_N
        hi = V
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    pdl_wait(USE_GDC)
    if not LATE_TRIGGER:
        pdl_trigger(USE_GDC)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # skinny_linear's MMA loop: the same tiles in the same order, so the same accumulator
    for k0 in range(0, K, BLOCK_K):
        if TMA:  # rows past M or V arrive as zeros; other groups' rows are masked below
            a = x_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([n0, k0])
        else:
            a = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    # the logit skinny_linear stores (model dtype), compared in fp32 (exact); columns past this
    # tile's own never win
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    logits = tl.where(n_mask[None, :], logits, float("-inf"))
    best, at = tl.max(logits, axis=1, return_indices=True, return_indices_tie_break_left=True)  # [BM]
    # all -inf: index 0 of the tile, a real column; NaN compares false and may pick a masked
    # one: the clamp keeps it in the vocabulary (runner/kernels/argmax.py's rule)
    idx = tl.minimum(n0 + at, V - 1)
    out = rows.to(tl.int64) * P + pid_n
    tl.store(val_ptr + out, best, mask=m_mask)
    tl.store(idx_ptr + out, idx, mask=m_mask)
    if LATE_TRIGGER:
        pdl_trigger(USE_GDC)


def head_tile_for(v: int, k: int, m: int, tables: LinearTables = REFERENCE) -> LinearTile | None:
    """head_argmax's tile for a head [v, k] at m rows, or None: `tables`' head rows, (V, K) ->
    ((max_m, tile or None), ...) in increasing max_m, thresholds at graph bucket sizes; None, or
    an M past the last row: the head and runner/kernels/argmax.py, two kernels. (Default: the
    reference table, for tests and benchmarks; a backend passes its device's.)"""
    return tables.head_tile(v, k, m)


def head_argmax(x: torch.Tensor, weight: torch.Tensor, tile: LinearTile, *, pdl: bool = False) -> torch.Tensor:
    """x [M, K], weight [V, K] -> [M] int64: argmax(x @ W^T, dim=-1) in two launches (module
    docstring). `tile` is an MMA tile; its `groups` (> 0) splits V into that many ragged column
    groups of at most block_n columns. Reads only shapes and strides on the host (capturable)."""
    m = x.shape[0]
    v, k = weight.shape
    check_operands(x, weight, tile)
    assert tile.block_m > 1, f"head_argmax: MMA tiles only, {tile}"
    assert x.dtype == weight.dtype, (x.dtype, weight.dtype)
    assert 0 < v < 2**31, v
    groups = tile.groups
    assert groups >= 0, f"head_argmax: an explicit group count, {tile}"
    if groups:
        assert triton.cdiv(triton.cdiv(v, 8), groups) * 8 <= tile.block_n, f"{groups} groups of {v} columns: {tile}"
    p = groups or triton.cdiv(v, tile.block_n)
    assert p < 2**16, f"{p} column tiles: past the grid's second dimension, {tile}"
    out = torch.empty(m, device=x.device, dtype=torch.int64)
    if m == 0:
        return out
    vals = torch.empty(m, p, device=x.device, dtype=torch.float32)
    idxs = torch.empty(m, p, device=x.device, dtype=torch.int32)
    x_desc, w_desc = tile_descriptors(x, weight, tile)
    _head_argmax_kernel[(triton.cdiv(m, tile.block_m), p)](
        x, weight, vals, idxs, m, v, k, x.stride(0), weight.stride(0), p, x_desc, w_desc,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, RAGGED=groups > 0, TMA=tile.tma,
        LATE_TRIGGER=tile.late_trigger, USE_GDC=pdl, num_warps=tile.num_warps, num_stages=tile.num_stages,
        launch_pdl=pdl,
    )  # fmt: skip
    pick_pieces(vals, idxs, out, pdl)
    return out
