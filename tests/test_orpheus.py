"""The Orpheus code constraint: torch variant against a per-token reference, and the Triton
kernel (interpreter on CPU, compiled on CUDA) bit-equal to the torch variant."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Before any triton kernel module is imported: @triton.jit picks the interpreter at
    # decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from runner.orpheus import OrpheusCodeConstraint  # noqa: E402

OFFSET, CB, TPF, END, V = 40, 8, 7, 30, 120  # audio ids [40, 96); end token below them


def reference(logits: torch.Tensor, rows: list[int], out_index: list[int]) -> torch.Tensor:
    out = logits.clone()
    for r, idx in zip(rows, out_index):
        k = idx % TPF
        for v in range(V):
            ok = OFFSET + k * CB <= v < OFFSET + (k + 1) * CB or (v == END and k == 0)
            if not ok:
                out[r, v] = float("-inf")
    return out


def test_torch_constraint_all_rows_and_subset():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, V, generator=g)
    idx = [0, 1, 6, 7, 13, 14, 20, 3, 700]
    c = OrpheusCodeConstraint(OFFSET, CB, TPF, END, kernels="torch")
    x = logits.clone()
    c(x, None, torch.tensor(idx))
    assert torch.equal(x, reference(logits, list(range(9)), idx))
    rows = [1, 4, 8]
    x = logits.clone()
    c(x, torch.tensor(rows), torch.tensor([idx[r] for r in rows]))
    assert torch.equal(x, reference(logits, rows, [idx[r] for r in rows]))
    # a frame boundary allows exactly the slot-0 codes plus the end token
    assert torch.isfinite(x[8]).nonzero().flatten().tolist() == [END, *range(OFFSET, OFFSET + CB)]


def test_triton_constraint_equals_torch():
    pytest.importorskip("triton", reason="triton not installed (CPU torch wheel does not bring it)")
    from tests.triton_interpreter import patch_interpreter

    patch_interpreter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton kernels imported without the interpreter: run this file on its own")
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, V, generator=g)
    idx = torch.tensor([0, 8, 13, 21, 5, 1_000_003])
    ref = OrpheusCodeConstraint(OFFSET, CB, TPF, END, kernels="torch")
    tri = OrpheusCodeConstraint(OFFSET, CB, TPF, END, kernels="triton")
    for rows in (None, torch.tensor([5, 0, 3])):
        i = idx if rows is None else idx[rows]
        want, got = logits.clone(), logits.clone().to(dev)
        ref(want, rows, i)
        tri(got, None if rows is None else rows.to(dev), i.to(dev))
        assert torch.equal(got.cpu(), want)
