"""Triton kernel of runner/orpheus.py's code constraint (CUDA; tests use the interpreter)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _code_range_kernel(logits_ptr, stride, rows_ptr, idx_ptr, V, offset, cb, tpf, end,
                       ALL_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = r if ALL_ROWS else tl.load(rows_ptr + r)
    k = tl.load(idx_ptr + r) % tpf
    lo = offset + k * cb
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = ((cols >= lo) & (cols < lo + cb)) | ((cols == end) & (k == 0))
    ptrs = logits_ptr + row.to(tl.int64) * stride + cols
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), tl.float32), mask=(cols < V) & ~keep)


_BLOCK = 4096


def mask_outside_code_range(logits: torch.Tensor, rows: torch.Tensor | None, out_index: torch.Tensor,
                            offset: int, cb: int, tpf: int, end: int) -> None:
    """-inf on every id of the rows outside [offset + k * cb, offset + (k + 1) * cb), k = out_index
    % tpf, except `end` where k == 0. logits [B, V] float32 with unit column stride."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    b, v = logits.shape
    n = b if rows is None else rows.shape[0]
    if n == 0:
        return
    grid = (n, triton.cdiv(v, _BLOCK))
    _code_range_kernel[grid](logits, logits.stride(0), rows if rows is not None else out_index, out_index,
                             v, offset, cb, tpf, end, ALL_ROWS=rows is None, BLOCK=_BLOCK, num_warps=4)
