"""The decode graph's input unpack (runner/utils/graph_inputs.py) as one Triton launch, captured as the
first node of every decode graph: one program per row of the bucket.

It runs without PDL: the launch before it in the stream is the pinned copy that filled `staged`
(or, during capture, nothing), and the model's first kernel waits for it the ordinary way.

Importing this module needs `triton` (CUDA; tests run it under TRITON_INTERPRET=1 on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.utils.graph_inputs import HEADER

_BLOCK_COLS = 128  # table columns per load


# the table stride and the scratch slot are step-invariant but never specialised (== 1, % 16)
@triton.jit(do_not_specialize=["stride_t", "scratch_slot"])
def _unpack_kernel(staged_ptr, last_token_ptr, ids_ptr, pos_ptr, slot_ptr, seq_ptr, tables_ptr, stride_t,
                   scratch_slot, HDR: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0)
    rows = tl.load(staged_ptr)
    width = tl.load(staged_ptr + 1)
    body = staged_ptr + HDR
    if r < rows:
        dev = tl.load(body + 4 * rows + r)
        host_id = tl.load(body + r).to(tl.int64)
        # a row whose token is still on the device reads the sampler's last_token of its slot
        tok = tl.load(last_token_ptr + tl.maximum(dev, 0).to(tl.int64), mask=dev >= 0, other=0)
        tl.store(ids_ptr + r, tl.where(dev >= 0, tok, host_id))
        tl.store(pos_ptr + r, tl.load(body + rows + r).to(tl.int64))
        tl.store(slot_ptr + r, tl.load(body + 2 * rows + r).to(tl.int64))
        tl.store(seq_ptr + r, tl.load(body + 3 * rows + r))
        src = body + 5 * rows + r.to(tl.int64) * width
        dst = tables_ptr + r.to(tl.int64) * stride_t
        for c0 in range(0, width, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            m = cols < width
            tl.store(dst + cols, tl.load(src + cols, mask=m), mask=m)
    else:  # padding row: the scratch slot, no keys
        tl.store(slot_ptr + r, scratch_slot.to(tl.int64))
        tl.store(seq_ptr + r, 0)


def unpack_graph_inputs(staged: torch.Tensor, last_token: torch.Tensor, input_ids: torch.Tensor,
                        positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, scratch_slot: int) -> None:
    """unpack_graph_inputs_torch's effect for rows [0, len(input_ids)), reading the row count and
    table width on the device only, so it can be captured. staged int32; last_token, input_ids,
    positions, slot_mapping int64; seq_lens, block_tables int32."""
    assert staged.dtype == seq_lens.dtype == block_tables.dtype == torch.int32, (staged.dtype, seq_lens.dtype)
    assert last_token.dtype == input_ids.dtype == positions.dtype == slot_mapping.dtype == torch.int64
    assert block_tables.stride(1) == 1
    n = input_ids.shape[0]
    if n == 0:
        return
    _unpack_kernel[(n,)](staged, last_token, input_ids, positions, slot_mapping, seq_lens, block_tables,
                         block_tables.stride(0), scratch_slot, HDR=HEADER, BLOCK_C=_BLOCK_COLS, num_warps=1)
