"""A decode graph's packed per-step inputs (runner/utils/graph_inputs.py): the host layout and the
reference unpack that the CUDA kernel (tests/kernels/test_triton_graph_inputs.py) is held to."""

from __future__ import annotations

import numpy as np
import torch

from runner.utils.graph_inputs import (
    HEADER,
    pack_graph_inputs,
    staged_capacity,
    unpack_graph_inputs_torch,
)


def _rows():
    ids = np.array([11, 0, 13], dtype=np.int64)
    pos = np.array([4, 20, 7], dtype=np.int64)
    slots = np.array([100, 221, 37], dtype=np.int64)
    seq = pos + 1
    dev = np.array([-1, 5, -1], dtype=np.int64)  # row 1's token is still on the device: slot 5's
    tables = np.array([[6, 0], [13, 9], [2, 0]], dtype=np.int32)
    return ids, pos, slots, seq, dev, tables


def test_layout_is_header_then_row_arrays_then_tables():
    ids, pos, slots, seq, dev, tables = _rows()
    p = pack_graph_inputs(ids, pos, slots, seq, dev, tables)
    assert p.dtype == np.int32 and p.size == HEADER + 5 * 3 + 3 * 2 <= staged_capacity(3, 2)
    assert p[:HEADER].tolist() == [3, 2]
    assert p[HEADER:HEADER + 15].tolist() == [*ids, *pos, *slots, *seq, *dev]
    assert p[HEADER + 15:].reshape(3, 2).tolist() == tables.tolist()


def test_reference_unpack_fills_rows_and_pads_the_rest():
    ids, pos, slots, seq, dev, tables = _rows()
    staged = torch.from_numpy(pack_graph_inputs(ids, pos, slots, seq, dev, tables))
    last_token = torch.arange(8, dtype=torch.int64) * 10
    n, width = 5, 4  # a bucket of 5 rows; the buffers' tables are wider than this step's
    input_ids, positions = torch.full((n,), -7, dtype=torch.int64), torch.full((n,), -7, dtype=torch.int64)
    slot_mapping, seq_lens = torch.full((n,), -7, dtype=torch.int64), torch.full((n,), -7, dtype=torch.int32)
    block_tables = torch.full((n, width), -7, dtype=torch.int32)
    unpack_graph_inputs_torch(staged, last_token, input_ids, positions, slot_mapping, seq_lens, block_tables, 999)
    assert input_ids.tolist() == [11, 50, 13, -7, -7]  # padding rows keep stale ids ...
    assert positions.tolist() == [4, 20, 7, -7, -7]
    assert slot_mapping.tolist() == [100, 221, 37, 999, 999]  # ... but write the scratch slot
    assert seq_lens.tolist() == [5, 21, 8, 0, 0]  # ... and see no keys
    assert block_tables[:3, :2].tolist() == tables.tolist() and (block_tables[:3, 2:] == -7).all()
