"""Greedy ids in two launches (runner/kernels/argmax.py) against torch.argmax.

Compiled on CUDA; under Triton's interpreter on CPU; skipped without `triton` (CPU CI). An
offline sm_90 compile (with the PDL wait) catches lowering errors without a GPU.

What is checked: torch.argmax(x, -1) bit for bit (the first index of the maximum) on bf16 rows
full of ties, with the maximum repeated inside a piece, in several pieces, at piece edges and in
the ragged last piece; column slices of wider (padded) logits; fp32; one-column and all -inf rows;
no rows; and TritonOps.argmax being this kernel pair.
"""

from __future__ import annotations

import textwrap

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

from runner.kernels.argmax import CHUNK, _piece_max_kernel, row_argmax  # noqa: E402
from runner.layers.triton_ops import TritonOps  # noqa: E402

DEVICE = "cuda" if _CUDA else "cpu"
if not _CUDA:
    interpreted_or_skip(_piece_max_kernel, "runner.kernels.argmax")


def _coarse_rows(n: int, v: int, seed: int) -> torch.Tensor:
    """bf16 rows of few distinct values (so the maximum repeats many times), on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-20, 20, (n, v), generator=g).to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("v", [1, 7, CHUNK, CHUNK + 1, 3 * CHUNK - 5, 38 * CHUNK + 1308])
def test_first_index_of_the_maximum(v):
    x = _coarse_rows(5, v, seed=v)
    got = row_argmax(x)
    assert got.dtype == torch.int64 and got.shape == (5,)
    assert torch.equal(got, x.argmax(dim=-1))


def test_ties_across_pieces_and_edges():
    """The maximum placed in several pieces, at a piece's first and last column and in the
    ragged last piece: the smallest of its indices wins, as in torch."""
    v = 3 * CHUNK + 100
    x = torch.zeros(6, v, dtype=torch.bfloat16)
    places = [[CHUNK - 1, CHUNK, 2 * CHUNK], [2 * CHUNK + 5, 3 * CHUNK + 99], [v - 1], [0, v - 1],
              [CHUNK, CHUNK + 1], [3 * CHUNK]]
    for r, cols in enumerate(places):
        x[r, cols] = 3.0
        # a runner-up beside the last copy
        x[r, next(c for c in (max(cols) - 1, max(cols) + 1, 1) if 0 <= c < v and c not in cols)] = 2.0
    x = x.to(DEVICE)
    got = row_argmax(x)
    assert got.tolist() == [min(c) for c in places]
    assert torch.equal(got, x.argmax(dim=-1))


def test_column_slice_fp32_and_edge_rows():
    """A [:, :V] slice of wider rows (the padded lm_head's logits): the padding columns are never
    read; fp32 rows; a row of -inf (index 0, as torch); no rows at all."""
    wide = _coarse_rows(4, CHUNK + 300, seed=3)
    wide[:, CHUNK + 200 :] = 100.0  # padding beyond V, larger than any real logit
    x = wide[:, : CHUNK + 200]
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    f = torch.randn(3, 2 * CHUNK + 9, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    f[1] = float("-inf")
    assert torch.equal(row_argmax(f), f.argmax(dim=-1))
    assert row_argmax(f[:0]).shape == (0,)


def test_nan_rows_get_an_index_of_the_row():
    """NaN logits (broken weights) must not produce an id past the vocabulary, which the next
    step's embedding would read out of bounds."""
    v = CHUNK + 10
    x = torch.full((3, v), float("nan"), dtype=torch.bfloat16)
    x[1, 5] = 1.0
    x[2, CHUNK + 3] = float("nan")
    x[2, : CHUNK + 3] = 0.0
    got = row_argmax(x.to(DEVICE))
    assert ((got >= 0) & (got < v)).all(), got


def test_triton_ops_argmax_is_the_kernel_pair(monkeypatch):
    import runner.layers.triton_ops as tfo

    calls = []
    monkeypatch.setattr(tfo, "row_argmax", lambda x, pdl: calls.append(pdl) or x.argmax(dim=-1))
    x = _coarse_rows(2, 100, seed=5)
    assert torch.equal(TritonOps(pdl=False).argmax(x), x.argmax(dim=-1)) and calls == [False]


_COMPILE_SCRIPT = textwrap.dedent(
    """
    from runner.kernels import argmax as m
    from tests.support.triton_interpreter import compile_sm90

    # as a launch on the padded logits specialises it (aligned pointers, row stride 156992; V never)
    k = compile_sm90(m._piece_max_kernel, dict(x_ptr="*bf16", val_ptr="*fp32", idx_ptr="*i32", V="i32",
                     stride_x="i32", P="i32"), dict(CHUNK=m.CHUNK, USE_GDC=True),
                     ("x_ptr", "val_ptr", "idx_ptr", "stride_x"), num_warps=4, launch_pdl=True)
    # a whole piece loads as 16-byte vectors (masked by cols < V it was 32 scalar loads per thread)
    assert k.asm["ptx"].count("ld.global.v4.b32") == m.CHUNK * 2 // 16 // 128, k.asm["ptx"].count("ld.global")
    compile_sm90(m._row_argmax_kernel, dict(val_ptr="*fp32", idx_ptr="*i32", out_ptr="*i64", P="i32"),
                 dict(P_BLOCK=64, USE_GDC=True), num_warps=1, launch_pdl=True)
    print("compiled")
    """
)


@pytest.mark.skipif(not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_kernels_compile_for_sm90_with_pdl():
    compile_offline(_COMPILE_SCRIPT, timeout=300)
