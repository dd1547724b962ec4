"""Greedy ids from the lm_head GEMM's epilogue (runner/kernels/head_argmax.py).

Compiled on CUDA; under Triton's interpreter on CPU; skipped without `triton` (CPU CI). An
offline sm_90 compile catches lowering errors without a GPU.

What is checked:
* the ids equal the argmax of the logits the same tile's GEMM writes (`skinny_linear`, then
  `row_argmax`), for pointer, TMA and ragged tiles, one or several row blocks, a vocabulary that
  ends inside a tile, exact ties inside a tile and across tiles (the first index wins);
* TritonOps.greedy_head takes it only where its tables' `head` rows name the shape and row count;
* a model's greedy_ids go through it and give those ids, also with a padded head.
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

from runner.kernels.argmax import row_argmax
from runner.kernels.head_argmax import (
    _head_argmax_kernel,
    head_argmax,
    head_tile_for,
)
from runner.kernels.linear import REFERENCE, LinearTile, skinny_linear
from runner.layers import triton_ops as triton_fused_ops
from runner.layers.triton_ops import TritonOps

DEVICE = "cuda" if _CUDA else "cpu"
if not _CUDA:
    interpreted_or_skip(_head_argmax_kernel, "runner.kernels.head_argmax")

V, H = 997, 128  # a vocabulary that is no multiple of 8, 16 or any block_n


def _rand(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(DEVICE, torch.bfloat16)


def _case(m: int, seed: int, v: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    x = _rand(m, H, seed=seed)
    w = _rand(v, H, seed=seed + 1, scale=0.1)
    # exact ties: the same weight row at columns 3 (tile 0), 70 (another tile of 64 columns,
    # the same tile of 128) and v - 1 (the last, partial tile), scaled to be row 0's maximum;
    # equal rows give equal logits (the same dot in the same order), so the first index must win
    w[[3, 70, v - 1]] = (x[0].float() / x[0].float().norm() * 8).to(w.dtype)
    return x, w


def _reference(x: torch.Tensor, w: torch.Tensor, tile: LinearTile) -> torch.Tensor:
    """The unfused pair: the same tile's GEMM (plain column tiles of its shape), then the argmax."""
    plain = LinearTile(tile.block_m, tile.block_n, tile.block_k, tile.num_warps, tile.num_stages, tma=tile.tma)
    return row_argmax(skinny_linear(x, w, None, plain))


TILES = [LinearTile(16, 64, 64, 4, 2), LinearTile(16, 128, 32, 4, 3, tma=True), LinearTile(64, 64, 64, 4, 2, tma=True),
         LinearTile(16, 64, 64, 4, 2, groups=17), LinearTile(16, 64, 64, 4, 2, groups=20, tma=True)]


@pytest.mark.parametrize("m", [1, 13, 40])
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t.block_m}x{t.block_n}x{t.block_k}"
                         f"{'-tma' if t.tma else ''}{f'-g{t.groups}' if t.groups else ''}")
def test_equals_gemm_then_argmax(m, tile):
    x, w = _case(m, seed=m)
    ids = head_argmax(x, w, tile)
    assert ids.shape == (m,) and ids.dtype == torch.int64
    assert torch.equal(ids, _reference(x, w, tile))
    assert int(ids[0]) == 3  # the first of the tied maxima, across tiles


@pytest.mark.parametrize("tile", TILES[:3] + TILES[4:], ids=lambda t: f"{t.block_n}{'-tma' if t.tma else ''}")
def test_all_negative_logits(tile):
    """Every logit below 0: the columns past the vocabulary (zero weight rows, masked loads or
    TMA's out-of-bounds fill) must not win."""
    x, w = _case(5, seed=2)
    x, w = x.abs(), -w.abs()
    ids = head_argmax(x, w, tile)
    assert torch.equal(ids, _reference(x, w, tile))
    assert (ids < V - 1).all()  # random data: no row's maximum is the last column


def test_ragged_groups_must_fit_block_n():
    x, w = _case(4, seed=1)
    with pytest.raises(AssertionError, match="groups"):
        head_argmax(x, w, LinearTile(16, 64, 64, 4, 2, groups=15))  # 125 units / 15 -> 72 columns > 64


@pytest.mark.skipif(not _CUDA, reason="the Orpheus-3B head (964 MB) on the GPU only")
@pytest.mark.parametrize("m", [16, 32, 64])
def test_orpheus_head_tiles(m):
    """The reference table's head tiles on Orpheus-3B's head [156940, 3072], as the engine runs them."""
    tile = head_tile_for(156940, 3072, m)
    assert tile is not None
    x = _rand(m, 3072, seed=m)
    w = _rand(156940, 3072, seed=m + 1, scale=0.02)
    assert torch.equal(head_argmax(x, w, tile, pdl=True), _reference(x, w, tile))


def _counting(monkeypatch) -> list[int]:
    calls = []
    real = triton_fused_ops.head_argmax

    def counted(x, w, tile, pdl=False):
        calls.append(x.shape[0])
        return real(x, w, tile, pdl=pdl)

    monkeypatch.setattr(triton_fused_ops, "head_argmax", counted)
    return calls


def test_ops_take_it_only_where_tuned(monkeypatch):
    tile = LinearTile(16, 64, 64, 4, 2)
    ops = TritonOps(tables=REFERENCE.with_entries(head={(V, H): ((1, None), (16, None), (64, tile))}))
    calls = _counting(monkeypatch)
    _, w = _case(1, seed=9)
    for m, taken in ((1, False), (16, False), (17, True), (64, True), (65, False)):
        x = _rand(m, H, seed=m)
        ids = ops.greedy_head(x, w, None)
        assert (calls[-1:] == [m]) == taken, m
        ref = _reference(x, w, tile) if taken else ops.head(x, w, None).argmax(-1)
        assert torch.equal(ids, ref), m
    assert calls == [17, 64]
    calls.clear()
    TritonOps(skinny_linear=False, tables=ops.tables).greedy_head(_rand(20, H, seed=1), w, None)  # no Triton GEMMs
    assert calls == []


@pytest.mark.parametrize("vocab", [960, 1000])  # 1000: the head is padded to 1024 rows
def test_model_greedy_ids_through_it(monkeypatch, vocab):
    from runner.config import ModelConfig
    from runner.models.llama import build_random_model

    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": H, "intermediate_size": 192,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
        "max_position_embeddings": 64,
    })
    tile = LinearTile(16, 64, 64, 4, 2, tma=True)
    ops = TritonOps(tables=REFERENCE.with_entries(head={(vocab, H): ((64, tile),)}))
    model = build_random_model(cfg, DEVICE, torch.bfloat16, seed=3, ops=ops)
    if not _CUDA:  # the loader pads on CUDA only (for cuBLAS); the path is the same
        model.pad_lm_head()
    assert (model.lm_head_padded is not None) == (vocab % 64 != 0)
    calls = _counting(monkeypatch)
    h = _rand(24, H, seed=5)
    ids = model.greedy_ids(h)
    assert calls == [24]
    assert torch.equal(ids, _reference(h, model.lm_head_weight, tile))


_COMPILE_SCRIPT = textwrap.dedent(
    """
    from runner.kernels import head_argmax as m
    from tests.support.triton_interpreter import assert_mma_not_serialised, compile_sm90

    tiles = [t for _, t in m.REFERENCE.head[(156940, 3072)] if t is not None]  # Orpheus-3B's head
    assert tiles
    for tile in tiles:
        ptr = "*bf16"
        sig = dict(x_ptr=ptr, w_ptr=ptr, val_ptr="*fp32", idx_ptr="*i32", M="i32", V="i32", K="i32",
                   stride_xm="i32", stride_wn="i32", P="i32",
                   x_desc=f"tensordesc<bf16[{tile.block_m}, {tile.block_k}]>",
                   w_desc=f"tensordesc<bf16[{tile.block_n}, {tile.block_k}]>")
        div = ("x_ptr", "w_ptr", "val_ptr", "idx_ptr", "K", "stride_xm", "stride_wn")
        k = compile_sm90(m._head_argmax_kernel, sig, dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                         BLOCK_K=tile.block_k, RAGGED=tile.groups > 0, TMA=tile.tma, LATE_TRIGGER=tile.late_trigger,
                         USE_GDC=True), div, num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=True)
        ptx = k.asm["ptx"]
        assert "griddepcontrol.wait" in ptx and ("cp.async.bulk.tensor" in ptx) == tile.tma
        assert_mma_not_serialised(ptx, tile)  # ptxas must not serialise the K loop's wgmma (C7514)
    print("compiled")
    """
)


@pytest.mark.skipif(not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_kernel_compiles_for_sm90():
    compile_offline(_COMPILE_SCRIPT, timeout=600)
