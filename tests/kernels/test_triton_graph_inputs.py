"""The decode graph's input unpack kernel (runner/kernels/graph_inputs.py) against the reference
unpack (runner/utils/graph_inputs.py), element for element: real rows, rows whose token comes from
last_token, padding rows, tables wider than one column block, and a buffer's stale columns past
this step's width left alone. Compiled on CUDA; under Triton's interpreter on CPU; skipped
without `triton`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.triton_interpreter import (
    compile_offline,
    has_nvidia_backend,
    interpret_without_cuda,
    interpreted_or_skip,
)

_CUDA = interpret_without_cuda()
triton = pytest.importorskip("triton", reason="triton not installed (CPU torch wheel does not bring it)")

from runner.kernels.graph_inputs import _unpack_kernel, unpack_graph_inputs  # noqa: E402
from runner.utils.graph_inputs import (  # noqa: E402
    pack_graph_inputs,
    staged_capacity,
    unpack_graph_inputs_torch,
)

DEVICE = "cuda" if _CUDA else "cpu"
if not _CUDA:
    interpreted_or_skip(_unpack_kernel, "runner.kernels.graph_inputs")


def _buffers(n: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-9, 0, (n,), generator=g), torch.randint(-9, 0, (n,), generator=g),
            torch.randint(-9, 0, (n,), generator=g), torch.randint(-9, 0, (n,), generator=g).int(),
            torch.randint(-9, 0, (n, width), generator=g).int())


@pytest.mark.parametrize("rows,bucket,width", [(1, 1, 3), (5, 8, 130), (8, 8, 257), (3, 16, 1)])
def test_kernel_matches_the_reference(rows, bucket, width):
    rng = np.random.default_rng(rows * 100 + width)
    max_width = width + 5  # the buffers' tables are wider than this step's
    dev = np.where(rng.random(rows) < 0.5, rng.integers(0, 12, rows), -1)
    staged = pack_graph_inputs(rng.integers(0, 50000, rows), rng.integers(0, 4000, rows),
                               rng.integers(0, 2**30, rows), rng.integers(1, 4000, rows), dev,
                               rng.integers(0, 2**20, (rows, width)).astype(np.int32))
    buf = np.zeros(staged_capacity(bucket, max_width), dtype=np.int32)
    buf[:staged.size] = staged
    last_token = torch.from_numpy(rng.integers(0, 50000, 12))
    scratch = 77 * 16
    want = _buffers(bucket, max_width, seed=rows)
    got = tuple(t.clone().to(DEVICE) for t in want)
    unpack_graph_inputs_torch(torch.from_numpy(buf), last_token, *want, scratch)
    unpack_graph_inputs(torch.from_numpy(buf).to(DEVICE), last_token.to(DEVICE), *got, scratch)
    for w, g_ in zip(want, got):
        assert torch.equal(g_.cpu(), w)


_COMPILE_SCRIPT = """
from runner.kernels import graph_inputs as m
from runner.utils.graph_inputs import HEADER
from tests.support.triton_interpreter import compile_sm90

sig = dict(staged_ptr="*i32", last_token_ptr="*i64", ids_ptr="*i64", pos_ptr="*i64", slot_ptr="*i64",
           seq_ptr="*i32", tables_ptr="*i32", stride_t="i32", scratch_slot="i32")
compile_sm90(m._unpack_kernel, sig, dict(HDR=HEADER, BLOCK_C=m._BLOCK_COLS), num_warps=1)
print("compiled")
"""


@pytest.mark.skipif(not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_kernel_compiles_for_sm90():
    compile_offline(_COMPILE_SCRIPT, timeout=300)
