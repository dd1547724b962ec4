"""Skinny decode GEMMs (runner/triton_linear.py) and their use through TritonOps.

Compiled on CUDA; under Triton's interpreter on CPU; skipped without `triton` (CPU CI). An
offline sm_90 compile (every prologue, both modes, with the PDL wait) catches lowering errors
without a GPU.

What is checked:
* every prologue against the torch composition (norm / SiLU*mul, then F.linear) to bf16
  tolerance, and bit for bit against "the separate Triton op, then the same kernel with the
  PLAIN prologue" (the fused prologue rebuilds the same activation tile, the same K order);
* a row's result does not depend on M or on the other rows (so graph padding cannot move it);
* the new residual of ADD_RMSNORM is exactly x + residual;
* the tile choice only changes at graph bucket sizes (eager M and its padded bucket agree).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import compile_offline, has_nvidia_backend, interpret_without_cuda, patch_interpreter

_CUDA = interpret_without_cuda()
triton = pytest.importorskip("triton", reason="triton not installed (CPU torch wheel does not bring it)")

from runner.cuda_graphs import graph_buckets  # noqa: E402
from runner.fused_ops import TorchOps, torch_rmsnorm  # noqa: E402
from runner.triton_fused_ops import TritonOps, rmsnorm, silu_and_mul  # noqa: E402
from runner.triton_linear import (  # noqa: E402
    ADD_RMSNORM,
    MAX_M,
    PLAIN,
    RMSNORM,
    SILU_MUL,
    TUNED,
    LinearTile,
    _skinny_linear_kernel,
    skinny_linear,
    tile_for,
)

DEVICE = "cuda" if _CUDA else "cpu"
if not _CUDA:
    if type(_skinny_linear_kernel).__name__ != "InterpretedFunction":
        pytest.skip("runner.triton_linear was imported before TRITON_INTERPRET=1; run this file on its own",
                    allow_module_level=True)
    patch_interpreter()

GEMV = LinearTile(1, 16, 64, 4, 1)
MMA = LinearTile(16, 32, 64, 4, 2)
N, K = 48, 128  # N not a multiple of block_n: the masked column block is exercised


def _rand(*shape, seed, dtype=torch.bfloat16, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(DEVICE, dtype)


def _inputs(m: int, prologue: int, seed: int = 0):
    x = _rand(m, 2 * K if prologue == SILU_MUL else K, seed=seed)
    w = _rand(N, K, seed=seed + 1, scale=0.05)
    b = _rand(N, seed=seed + 2)
    res = _rand(m, K, seed=seed + 3)
    nw = _rand(K, seed=seed + 4, scale=0.5) + 1
    return x, w, b, res, nw


def _fused(x, w, b, res, nw, prologue, tile):
    return skinny_linear(x, w, b, tile, prologue, residual=res if prologue == ADD_RMSNORM else None,
                         norm_weight=nw if prologue in (RMSNORM, ADD_RMSNORM) else None, eps=1e-5)


def _activation_torch(x, res, nw, prologue):
    if prologue == SILU_MUL:
        return TorchOps().silu_and_mul(x)
    if prologue == RMSNORM:
        return torch_rmsnorm(x, nw, 1e-5)
    if prologue == ADD_RMSNORM:
        return torch_rmsnorm(x + res, nw, 1e-5)
    return x


def _activation_triton(x, res, nw, prologue):
    if prologue == SILU_MUL:
        return silu_and_mul(x)
    if prologue == RMSNORM:
        return rmsnorm(x, nw, 1e-5)
    if prologue == ADD_RMSNORM:
        return rmsnorm(x, nw, 1e-5, residual=res)[0]
    return x


PROLOGUES = [PLAIN, SILU_MUL, RMSNORM, ADD_RMSNORM]
CASES = [(1, GEMV), (1, MMA), (5, MMA), (16, MMA), (21, LinearTile(32, 16, 128, 4, 3))]


@pytest.mark.parametrize("prologue", PROLOGUES, ids=["plain", "silu", "norm", "addnorm"])
@pytest.mark.parametrize("m,tile", CASES, ids=[f"m{m}-bm{t.block_m}" for m, t in CASES])
def test_matches_torch_composition(prologue, m, tile):
    x, w, b, res, nw = _inputs(m, prologue)
    out, new_res = _fused(x, w, b, res, nw, prologue, tile)
    ref = F.linear(_activation_torch(x, res, nw, prologue).float(), w.float(), b.float())
    # fp32 accumulation in another order, one bf16 rounding of the result (and the norm's
    # sum-of-squares order): within a few bf16 ulps of the fp32 reference
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    if prologue == ADD_RMSNORM:
        assert torch.equal(new_res, x + res)
    else:
        assert new_res is None


@pytest.mark.parametrize("prologue", [SILU_MUL, RMSNORM, ADD_RMSNORM], ids=["silu", "norm", "addnorm"])
@pytest.mark.parametrize("m,tile", CASES[:3], ids=[f"m{m}-bm{t.block_m}" for m, t in CASES[:3]])
def test_fused_prologue_equals_separate_op_then_plain(prologue, m, tile):
    """The fused tile is the separate kernel's output: same GEMM bits. (The norm's sum of squares
    is reduced in another order than the rmsnorm kernel's; with these inputs no element lands on
    a rounding boundary, which the sizes here make near certain but tolerate up to 1%.)"""
    x, w, b, res, nw = _inputs(m, prologue, seed=3)
    fused, _ = _fused(x, w, b, res, nw, prologue, tile)
    separate, _ = skinny_linear(_activation_triton(x, res, nw, prologue), w, b, tile)
    frac = (fused != separate).float().mean().item()
    assert frac <= (0.01 if prologue != SILU_MUL else 0.0), frac


@pytest.mark.parametrize("tile", [GEMV, MMA], ids=["gemv", "mma"])
def test_row_result_independent_of_batch(tile):
    m = 1 if tile.block_m == 1 else 13
    x, w, b, *_ = _inputs(m, PLAIN, seed=5)
    full, _ = skinny_linear(x, w, b, tile)
    if tile.block_m == 1:
        other, _ = skinny_linear(x, w, b, MMA)  # same row in MMA mode: close, not necessarily equal
        torch.testing.assert_close(full.float(), other.float(), rtol=2e-2, atol=2e-2)
        return
    for r in (0, 6, 12):
        alone, _ = skinny_linear(x[r : r + 1].contiguous(), w, b, tile)
        assert torch.equal(alone[0], full[r])
    padded = torch.cat([x, _rand(3, K, seed=9)])  # extra rows (graph padding) change nothing
    assert torch.equal(skinny_linear(padded, w, b, tile)[0][:m], full)


def test_strided_rows_and_no_bias():
    x = _rand(4, 2 * K, seed=7)[:, :K]  # row stride 2K
    w = _rand(N, K, seed=8, scale=0.05)
    out, _ = skinny_linear(x, w, None, MMA)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


def test_tile_choice_changes_only_at_graph_buckets():
    buckets = graph_buckets(1024)

    def bucket(m):
        return next(s for s in buckets if s >= m)

    shapes = {(p, n, k) for (p, n, k) in TUNED} | {(p, 5120, 3072) for p in PROLOGUES} | {(PLAIN, 96, 200)}
    for p, n, k in shapes:
        for m in range(1, MAX_M + 40):
            assert tile_for(p, n, k, m) == tile_for(p, n, k, bucket(m)), (p, n, k, m)
        assert tile_for(p, n, k, MAX_M + 1) is None


def test_triton_ops_route_by_dtype_and_size():
    """TritonOps: 16-bit GEMMs of <= MAX_M rows run here; fp32 and big M stay with F.linear."""
    ops, ref = TritonOps(), TorchOps()
    lin = torch.nn.Linear(K, N, bias=True).to(DEVICE)
    with torch.no_grad():
        for dtype, m in ((torch.float32, 3), (torch.bfloat16, 1), (torch.bfloat16, 7), (torch.bfloat16, MAX_M + 1)):
            lin = lin.to(dtype)
            x, res = _rand(m, K, seed=m, dtype=dtype), _rand(m, K, seed=m + 1, dtype=dtype)
            nw = _rand(K, seed=m + 3, dtype=dtype, scale=0.5) + 1
            got, got_res = ops.norm_linear(x, res, nw, 1e-5, lin)
            want, want_res = ref.norm_linear(x, res, nw, 1e-5, lin)
            assert torch.equal(got_res, want_res)
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
            gu = _rand(m, 2 * K, seed=m + 2, dtype=dtype)
            torch.testing.assert_close(ops.silu_mul_linear(gu, lin).float(), ref.silu_mul_linear(gu, lin).float(),
                                       rtol=tol, atol=tol)
            got0, r0 = ops.norm_linear(x, None, nw, 1e-5, lin)
            assert r0 is x
            torch.testing.assert_close(got0.float(), ref.norm_linear(x, None, nw, 1e-5, lin)[0].float(),
                                       rtol=tol, atol=tol)


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from runner import triton_linear as m

    target = GPUTarget("cuda", 90, 32)
    ptr = "*bf16"
    sig = dict(x_ptr=ptr, res_ptr=ptr, nw_ptr=ptr, res_out_ptr=ptr, w_ptr=ptr, b_ptr=ptr, out_ptr=ptr,
               M="i32", N="i32", K="i32", stride_xm="i32", stride_rm="i32", stride_wn="i32", stride_om="i32",
               eps="fp32")
    for tile in (m.LinearTile(1, 16, 1024, 4, 1), m.LinearTile(16, 32, 256, 4, 4), m.LinearTile(64, 64, 128, 8, 4)):
        for prologue in (m.PLAIN, m.SILU_MUL, m.RMSNORM, m.ADD_RMSNORM):
            consts = dict(PROLOGUE=prologue, HAS_BIAS=False, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                          BLOCK_K=tile.block_k, USE_GDC=True)
            s = dict(sig, **{k: "constexpr" for k in consts})
            triton.compile(ASTSource(m._skinny_linear_kernel, s, constexprs=consts), target=target,
                           options={"num_warps": tile.num_warps, "num_stages": tile.num_stages, "launch_pdl": True})
    print("compiled")
    """
)


@pytest.mark.skipif(not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_kernel_compiles_for_sm90_with_pdl():
    compile_offline(_COMPILE_SCRIPT, timeout=600)
