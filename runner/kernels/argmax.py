"""Row-wise argmax of a decode step's logits (greedy ids) in two short launches.

Why: greedy decoding takes argmax over the vocabulary (Orpheus: 156940 ids) of every row. torch's
reduction gives one row to few programs, so it runs far below memory bandwidth on 0.3 MB (one
row) to 20 MB (64 rows) of logits. Here each row is cut into CHUNK-wide pieces, one program each
(39 per row), that write their piece's maximum and its first index; a second launch picks, per
row, the first piece holding the row's maximum. Neither reads a value on the host.

Result: torch.argmax(x, dim=-1) exactly for rows without NaN: the first index of the maximum (a
piece keeps its first maximal index, and the second launch takes the first maximal piece, which
holds the smaller indices). A row with NaN gets some index of the row, never one past it
(torch: the first NaN's); the model's logits hold no NaN unless its weights do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.kernels.pdl import pdl_enter

# Elements per program: 8 KB of bf16 in one load, so a program is one memory round trip and a
# batch-1 row spreads over 39 programs.
CHUNK = 4096


@triton.jit
def _piece_max_kernel(
    x_ptr,  # [N, V], last dim contiguous, row stride stride_x
    val_ptr,  # [N, P] fp32: each piece's maximum
    idx_ptr,  # [N, P] int32: the first index of it in the row
    V,
    stride_x,
    P,  # pieces per row = cdiv(V, CHUNK)
    CHUNK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    cols = piece * CHUNK + tl.arange(0, CHUNK)
    xs = x_ptr + row * stride_x + cols
    if piece < P - 1:
        # a whole piece, unmasked: V is never specialised (156940 is no multiple of 16), so a
        # load masked by cols < V compiles to 32 scalar ld.global.b16 per thread, and this one to
        # 4 16-byte vectors
        x = tl.load(xs).to(tl.float32)
    else:
        x = tl.load(xs, mask=cols < V, other=float("-inf")).to(tl.float32)
    # a piece has at least one real column, so the maximum (and its index) is a real one's,
    # unless every column is -inf: then index 0 of the piece, a real column too. NaN compares
    # false either way and may hand the index to a padding column: the clamp keeps it in the row.
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * P + piece, best)
    tl.store(idx_ptr + row * P + piece, tl.minimum(piece * CHUNK + at, V - 1))


@triton.jit
def _row_argmax_kernel(
    val_ptr,  # [N, P] fp32
    idx_ptr,  # [N, P] int32
    out_ptr,  # [N] int64
    P,
    P_BLOCK: tl.constexpr,  # next power of two >= P
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, P_BLOCK)
    vals = tl.load(val_ptr + row * P + offs, mask=offs < P, other=float("-inf"))
    # the first maximal piece: it holds the smallest index of the row's maximum
    _, piece = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * P + piece).to(tl.int64))


def row_argmax(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """[N, V] (last dim contiguous; e.g. a column slice of padded logits) -> [N] int64, the
    first index of each row's maximum. Reads no tensor value on the host (graph capturable)."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    n, v = x.shape
    assert v >= 1 and v < 2**31, v
    out = torch.empty(n, device=x.device, dtype=torch.int64)
    if n == 0:
        return out
    p = triton.cdiv(v, CHUNK)
    vals = torch.empty(n, p, device=x.device, dtype=torch.float32)
    idxs = torch.empty(n, p, device=x.device, dtype=torch.int32)
    _piece_max_kernel[(n, p)](x, vals, idxs, v, x.stride(0), p, CHUNK=CHUNK, USE_GDC=pdl, num_warps=4,
                              launch_pdl=pdl)
    pick_pieces(vals, idxs, out, pdl)
    return out


def pick_pieces(vals: torch.Tensor, idxs: torch.Tensor, out: torch.Tensor, pdl: bool) -> None:
    """out[r] = idxs[r, p] of the first p with vals[r, p] maximal: the second launch of a
    piecewise argmax (also runner/kernels/head_argmax.py's). vals [N, P] fp32, idxs [N, P] int32,
    both contiguous, pieces in column order; out [N] int64."""
    n, p = vals.shape
    assert vals.is_contiguous() and idxs.is_contiguous() and idxs.shape == (n, p) and out.shape == (n,)
    p_block = triton.next_power_of_2(p)
    # one warp reads a row of up to 128 pieces in one go; wider rows (the head's column tiles,
    # ~1200) take more warps so a thread holds few
    _row_argmax_kernel[(n,)](vals, idxs, out, p, P_BLOCK=p_block, USE_GDC=pdl,
                             num_warps=min(8, max(1, p_block // 256)), launch_pdl=pdl)
