"""A decode graph's per-step inputs as one host array, one copy and one unpack inside the graph.

Why: filling the graph's persistent input buffers from the host took ~10 small operations per
step ahead of every replay: three pinned copies (the packed row arrays, the rows whose token is
still on the device, the block tables), the gather of those tokens from the sampler's
`last_token`, and a device copy (or cast) per buffer. Each is a launch of its own on the step's
critical path. Now the host packs everything into one int32 array (`pack_graph_inputs`), one
pinned copy moves it into the graph's `staged` buffer, and the first node of every captured
graph unpacks it (`runner/kernels/graph_inputs.py` on CUDA; `unpack_graph_inputs_torch`, the
reference, elsewhere).

Layout, int32, for R rows and table width W (both in the header, so one captured unpack serves
any step that fits its bucket):

    [R, W | ids R | positions R | slots R | seq_lens R | device_slot R | tables R x W]

`device_slot[r] >= 0`: row r's token is `last_token[device_slot[r]]` (sampled by a step still
in flight), else `ids[r]`. Rows [R, bucket) of the graph are padding: they get the scratch slot
and sequence length 0; their ids, positions and table rows keep stale values, which nothing
reads (the attention kernel reads no K/V for seq_len 0).
"""

from __future__ import annotations

import numpy as np
import torch

HEADER = 2


def staged_capacity(max_rows: int, max_blocks: int) -> int:
    """int32 elements of the largest packed array (`max_rows` rows, full-width tables)."""
    return HEADER + 5 * max_rows + max_rows * max_blocks


def pack_graph_inputs(ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
                      device_slot: np.ndarray, tables: np.ndarray) -> np.ndarray:
    """The int32 array above, from R-row arrays and tables [R, W]. Values must fit int32 (token
    ids, positions, cache slots: DecodeGraphs checks the cache's size at construction)."""
    r, w = tables.shape
    out = np.empty(HEADER + 5 * r + r * w, dtype=np.int32)
    out[0], out[1] = r, w
    for i, a in enumerate((ids, positions, slots, seq_lens, device_slot)):
        assert a.shape == (r,), (i, a.shape, r)
        out[HEADER + i * r: HEADER + (i + 1) * r] = a
    out[HEADER + 5 * r:] = tables.reshape(-1)
    return out


def unpack_graph_inputs_torch(staged: torch.Tensor, last_token: torch.Tensor, input_ids: torch.Tensor,
                              positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                              block_tables: torch.Tensor, scratch_slot: int) -> None:
    """Reference unpack (CPU; the CUDA graphs use the Triton kernel, tested against this): fills
    rows [0, R) of the buffers from `staged` and marks rows [R, len) as padding. Reads R and W
    on the host, so it cannot be captured."""
    r, w = int(staged[0]), int(staged[1])
    body = staged[HEADER:].long()
    ids, pos, slot, seq, dev = (body[i * r:(i + 1) * r] for i in range(5))
    input_ids[:r] = torch.where(dev >= 0, last_token[dev.clamp(min=0)], ids)
    positions[:r] = pos
    slot_mapping[:r] = slot
    seq_lens[:r] = seq.to(seq_lens.dtype)
    block_tables[:r, :w] = body[5 * r:5 * r + r * w].view(r, w).to(block_tables.dtype)
    slot_mapping[r:] = scratch_slot
    seq_lens[r:] = 0
