"""Skinny decode GEMMs (runner/kernels/linear.py) and their use through TritonOps.

Compiled on CUDA; under Triton's interpreter on CPU; skipped without `triton` (CPU CI). An
offline sm_90 compile (every variant, with the PDL wait) catches lowering errors without a GPU.

What is checked:
* both modes, with and without bias, against F.linear in fp32 to bf16 tolerance;
* the gated epilogue is bit for bit the plain GEMM followed by the SiLU*mul kernel;
* a row's result does not depend on M or on the other rows (so graph padding cannot move it);
* the tile choice only changes at graph bucket sizes (eager M and its padded bucket agree);
* TritonOps' linear / mlp equal TorchOps' for every route they take (fp32 and large M stay
  with cuBLAS).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.support.triton_interpreter import (
    compile_offline,
    has_nvidia_backend,
    interpret_without_cuda,
    interpreted_or_skip,
)

_CUDA = interpret_without_cuda()
triton = pytest.importorskip("triton", reason="triton not installed (CPU torch wheel does not bring it)")

from runner.engine.cuda_graphs import graph_buckets  # noqa: E402
from runner.kernels.fused_ops import silu_and_mul  # noqa: E402
from runner.kernels.gpu_info import num_sms  # noqa: E402
from runner.kernels.linear import (  # noqa: E402
    GATED,
    MAX_M,
    PER_SM,
    PLAIN,
    REFERENCE,
    LinearTile,
    RowScale,
    _column_groups,
    _launch,
    _skinny_linear_kernel,
    fold_tile_for,
    residual_linear,
    skinny_linear,
    split_tile_for,
    tile_for,
)
from runner.layers.ops import TorchOps  # noqa: E402
from runner.layers.triton_ops import TritonOps  # noqa: E402

DEVICE = "cuda" if _CUDA else "cpu"
if not _CUDA:
    interpreted_or_skip(_skinny_linear_kernel, "runner.kernels.linear")

GEMV = LinearTile(1, 16, 64, 4, 1)
MMA = LinearTile(16, 32, 64, 4, 2)
N, K = 48, 128  # N not a multiple of block_n: the masked column block is exercised


def _rand(*shape, seed, dtype=torch.bfloat16, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(DEVICE, dtype)


def _inputs(m: int, seed: int = 0):
    return _rand(m, K, seed=seed), _rand(N, K, seed=seed + 1, scale=0.05), _rand(N, seed=seed + 2)


GEMV4 = LinearTile(1, 4, 64, 4, 1)  # 4 rows per program, as the tuned table's M = 1 GEMVs
CASES = [(1, GEMV), (1, GEMV4), (1, MMA), (5, MMA), (16, MMA), (21, LinearTile(32, 16, 128, 4, 3))]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("m,tile", CASES, ids=[f"m{m}-bm{t.block_m}" for m, t in CASES])
def test_matches_torch(m, tile, bias):
    x, w, b = _inputs(m)
    b = b if bias else None
    out = skinny_linear(x, w, b, tile)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    # fp32 accumulation in another order, one bf16 rounding: within a few bf16 ulps
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("m,tile", [(1, GEMV), (1, GEMV4), (1, MMA), (6, MMA), (21, LinearTile(32, 16, 128, 4, 3))],
                         ids=["m1-gemv", "m1-gemv4", "m1-mma", "m6-mma", "m21-bm32"])
def test_gated_epilogue_equals_gemm_then_silu_mul(m, tile):
    x = _rand(m, K, seed=11)
    w = _rand(2 * N, K, seed=12, scale=0.05)  # gate | up, I = N
    gated = skinny_linear(x, w, None, tile, gated=True)
    assert gated.shape == (m, N)
    assert torch.equal(gated, silu_and_mul(skinny_linear(x, w, None, tile)))
    ref = TorchOps().silu_and_mul(F.linear(x.float(), w.float()).to(x.dtype))
    torch.testing.assert_close(gated.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tile", [GEMV, MMA], ids=["gemv", "mma"])
def test_row_result_independent_of_batch(tile):
    m = 1 if tile.block_m == 1 else 13
    x, w, b = _inputs(m, seed=5)
    full = skinny_linear(x, w, b, tile)
    if tile.block_m == 1:
        other = skinny_linear(x, w, b, MMA)  # same row in MMA mode: close, not necessarily equal
        torch.testing.assert_close(full.float(), other.float(), rtol=2e-2, atol=2e-2)
        return
    for r in (0, 6, 12):
        alone = skinny_linear(x[r : r + 1].contiguous(), w, b, tile)
        assert torch.equal(alone[0], full[r])
    padded = torch.cat([x, _rand(3, K, seed=9)])  # extra rows (graph padding) change nothing
    assert torch.equal(skinny_linear(padded, w, b, tile)[:m], full)


def test_strided_rows_and_no_bias():
    x = _rand(4, 2 * K, seed=7)[:, :K]  # row stride 2K
    w = _rand(N, K, seed=8, scale=0.05)
    out = skinny_linear(x, w, None, MMA)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


def test_tile_choice_changes_only_at_graph_buckets():
    buckets = graph_buckets(1024)

    def bucket(m):
        return next(s for s in buckets if s >= m)

    shapes = {(p, n, k) for (p, n, k) in REFERENCE.tuned} | {(p, 5120, 3072) for p in (PLAIN, GATED)} | {(PLAIN, 96, 200)}
    for p, n, k in shapes:
        for m in range(1, MAX_M + 40):
            assert tile_for(p, n, k, m) == tile_for(p, n, k, bucket(m)), (p, n, k, m)
        assert tile_for(p, n, k, MAX_M + 1) is None
    for n, k in list(REFERENCE.split) + [(96, 200)]:
        for m in range(1, MAX_M + 40):
            assert split_tile_for(n, k, m) == split_tile_for(n, k, bucket(m)), (n, k, m)
        assert split_tile_for(n, k, 1) is None and split_tile_for(n, k, MAX_M + 1) is None
    for n, k in list(REFERENCE.fold) + [(96, 200)]:
        for m in range(1, MAX_M + 40):
            assert fold_tile_for(n, k, m) == fold_tile_for(n, k, bucket(m)), (n, k, m)
        assert fold_tile_for(n, k, MAX_M + 1) is None


def test_triton_ops_route_by_dtype_and_size():
    """TritonOps: 16-bit GEMMs of <= MAX_M rows run here (gate_up gated); fp32 and big M stay with
    F.linear; whichever route, the results are TorchOps' within the dtype's tolerance."""
    ops, ref = TritonOps(), TorchOps()
    with torch.no_grad():
        for dtype, m in ((torch.float32, 3), (torch.bfloat16, 1), (torch.bfloat16, 7), (torch.bfloat16, MAX_M + 1)):
            lin = torch.nn.Linear(K, N, bias=True).to(DEVICE, dtype)
            gate_up = torch.nn.Linear(N, 2 * K, bias=False).to(DEVICE, dtype)
            x, h = _rand(m, K, seed=m, dtype=dtype), _rand(m, N, seed=m + 2, dtype=dtype)
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(ops.linear(x, lin).float(), ref.linear(x, lin).float(), rtol=tol, atol=tol)
            torch.testing.assert_close(ops.mlp(h, gate_up, lin).float(), ref.mlp(h, gate_up, lin).float(),
                                       rtol=tol, atol=tol)
            if dtype == torch.float32 or m > MAX_M:  # cuBLAS: bit for bit TorchOps
                assert torch.equal(ops.linear(x, lin), ref.linear(x, lin))


@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize("split", [2, 4])
def test_split_k_partials_sum_to_the_gemm(m, split):
    """split_k: fp32 partials [S, M, N] over consecutive K ranges; their sum is x @ W^T (fp32
    tolerance), each partial is exactly the GEMM over its K range, and a row's partials do not
    depend on the other rows."""
    x, w, _ = _inputs(m, seed=21)
    tile = LinearTile(16, 32, 32, 4, 2)  # K = 128: four 32-wide slices
    parts = skinny_linear(x, w, None, tile, split_k=split)
    assert parts.shape == (split, m, N) and parts.dtype == torch.float32
    ref = x.float() @ w.float().T
    torch.testing.assert_close(parts.sum(0), ref, atol=1e-3, rtol=1e-3)
    ks = K // split
    for s_ in range(split):
        torch.testing.assert_close(parts[s_], x[:, s_ * ks:(s_ + 1) * ks].float() @ w[:, s_ * ks:(s_ + 1) * ks].float().T,
                                   atol=1e-3, rtol=1e-3)
    one = skinny_linear(x[-1:].contiguous(), w, None, tile, split_k=split)
    if _CUDA:  # tensor-core rows are independent; the interpreter's numpy matmul may block by M
        assert torch.equal(one[:, 0], parts[:, -1])
    else:
        torch.testing.assert_close(one[:, 0], parts[:, -1], atol=1e-6, rtol=1e-6)


def test_head_runs_here_only_where_the_table_names_its_shape(monkeypatch):
    """TritonOps.head (the lm_head): F.linear on the padded weight, bit for bit TorchOps', unless
    the backend's tables name the head's shape; then the table's tile (a GEMV at M = 1, an MMA tile above),
    within bf16 tolerance, as an [N, V] result."""
    v, k = 100, 256
    padded = torch.zeros(128, k, dtype=torch.bfloat16, device=DEVICE)
    padded[:v] = _rand(v, k, seed=70, scale=0.05)
    weight = padded[:v]
    ops, ref = TritonOps(), TorchOps()
    calls = []

    def spy(x, w, b, tile, **kw):
        calls.append(tile)
        return skinny_linear(x, w, b, tile, **kw)

    monkeypatch.setattr("runner.layers.triton_ops.skinny_linear", spy)
    for m in (1, 5):
        x = _rand(m, k, seed=71 + m)
        want = ref.head(x, weight, padded)
        assert want.shape == (m, v) and torch.equal(ops.head(x, weight, padded), want) and not calls
    rows = ((1, LinearTile(1, 16, 128, 4, 1)), (16, LinearTile(16, 32, 64, 4, 2)))
    ops = TritonOps(tables=REFERENCE.with_entries(tuned={(PLAIN, v, k): rows}))
    for m in (1, 5):
        x = _rand(m, k, seed=71 + m)
        got = ops.head(x, weight, padded)
        assert got.shape == (m, v) and calls[-1] == rows[m > 1][1]
        torch.testing.assert_close(got.float(), ref.head(x, weight, padded).float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(ops.head(_rand(17, k, seed=9), weight, padded), ref.head(_rand(17, k, seed=9), weight, padded))


def test_late_trigger_only_on_mma_tiles():
    """A GEMV must trigger right after its wait (the split attention after qkv prefetches under
    its tail), so a GEMV tile with late_trigger is refused; an MMA tile with it computes what the
    same tile without it computes (the trigger orders launches, not values)."""
    x, w, _ = _inputs(1)
    with pytest.raises(AssertionError, match="late_trigger"):
        skinny_linear(x, w, None, LinearTile(1, 16, 64, 4, 1, late_trigger=True))
    x, w, b = _inputs(5)
    late = skinny_linear(x, w, b, LinearTile(16, 32, 64, 4, 2, late_trigger=True))
    assert torch.equal(late, skinny_linear(x, w, b, LinearTile(16, 32, 64, 4, 2)))
    assert all(t.late_trigger for _, t in REFERENCE.tuned[(GATED, 16384, 3072)])


@pytest.mark.parametrize("m", [64, 40])
def test_tuned_split_rows_sum_to_the_gemm(m):
    """Every split tile of the reference table with its split count (at a K it divides) against the fp32 GEMM:
    the rows the engine runs, e.g. o_proj at M = 64 in 2 splits of 64 x 64 x 128 tiles."""
    for rows in REFERENCE.split.values():
        for _, tile, splits in rows:
            if tile is None:
                continue
            k = 2 * splits * tile.block_k
            n = 2 * tile.block_n if tile.tma else N  # TMA tiles take whole column tiles
            x, w = _rand(m, k, seed=60), _rand(n, k, seed=61, scale=0.05)
            parts = skinny_linear(x, w, None, tile, split_k=splits)
            assert parts.shape == (splits, m, n)
            torch.testing.assert_close(parts.sum(0), x.float() @ w.float().T, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("groups,block_n", [(5, 16), (3, 16), (6, 16)])
@pytest.mark.parametrize("m", [5, 40])
def test_ragged_column_groups_compute_every_column(m, groups, block_n):
    """LinearTile.groups: `groups` programs split N = 48 (six 8-column units) into ragged groups
    inside block_n-wide tiles. Every column of the plain GEMM, the split-K partials, the gated
    epilogue and the residual epilogue must come out as with ordinary tiles (to fp32 / bf16
    tolerance: another tile width may order the tensor-core sums differently), and a group wider
    than its tile is refused."""
    tile = LinearTile(16, block_n, 32, 4, 2, groups=groups)
    plain = LinearTile(16, 16, 32, 4, 2)
    x, w, b = _inputs(m, seed=110)
    torch.testing.assert_close(skinny_linear(x, w, b, tile).float(), skinny_linear(x, w, b, plain).float(),
                               rtol=1e-2, atol=1e-2)
    parts = skinny_linear(x, w, None, tile, split_k=2)
    torch.testing.assert_close(parts, skinny_linear(x, w, None, plain, split_k=2), rtol=1e-4, atol=1e-4)
    wg = _rand(2 * N, K, seed=111, scale=0.05)
    torch.testing.assert_close(skinny_linear(x, wg, None, tile, gated=True).float(),
                               skinny_linear(x, wg, None, plain, gated=True).float(), rtol=2e-2, atol=2e-2)
    scale = RowScale(_rand(m, 3, seed=114, dtype=torch.float32).abs() + 0.5, K, 1e-5)  # gate_up in the norm fold
    torch.testing.assert_close(skinny_linear(x, wg, None, tile, gated=True, row_scale=scale).float(),
                               skinny_linear(x, wg, None, plain, gated=True, row_scale=scale).float(), rtol=2e-2, atol=2e-2)
    res, g = _rand(m, N, seed=112), _rand(N, seed=113)
    h, xg, scale = residual_linear(x, w, res, g, 1e-5, tile)
    assert scale.ssq.shape == (m, groups) and torch.equal(xg, (h.float() * g.float()).to(torch.bfloat16))
    torch.testing.assert_close(h.float(), (x.float() @ w.float().T + res.float()), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(scale.ssq.sum(1), h.float().square().sum(1), rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):
        skinny_linear(x, w, b, LinearTile(16, 8, 32, 4, 2, groups=2))  # 24-column groups in 8-wide tiles


@pytest.mark.parametrize("m", [5, 16, 33])
def test_tma_tiles_equal_pointer_tiles(m):
    """LinearTile.tma only changes how the x and W tiles are loaded: the plain GEMM, the gated
    epilogue, split-K partials, residual_linear and the row scale come out bit for bit as with
    pointer loads (rows past M arrive as zeros either way), in column tiles and ragged groups."""
    n, k = 64, 128  # N a multiple of block_n, as gated TMA tiles need
    x, w, res = _rand(m, k, seed=80), _rand(n, k, seed=81, scale=0.05), _rand(m, n, seed=82)
    g = _rand(n, seed=83)
    bm = 16 if m <= 16 else 64
    ptr, tma = LinearTile(bm, 16, 32, 4, 2), LinearTile(bm, 16, 32, 4, 2, tma=True)
    for kw in ({}, {"gated": True}, {"split_k": 2}):
        assert torch.equal(skinny_linear(x, w, None, tma, **kw), skinny_linear(x, w, None, ptr, **kw)), kw
    h0, xg0, s0 = residual_linear(x, w, res, g, 1e-6, ptr)
    h1, xg1, s1 = residual_linear(x, w, res, g, 1e-6, tma)
    assert torch.equal(h0, h1) and torch.equal(xg0, xg1) and torch.equal(s0.ssq, s1.ssq)
    w2 = _rand(2 * n, n, seed=84, scale=0.05)
    assert torch.equal(skinny_linear(xg1, w2, None, tma, gated=True, row_scale=s1),
                       skinny_linear(xg0, w2, None, ptr, gated=True, row_scale=s0))
    # a partial column tile (N = 48 in 32-wide tiles): W rows past N arrive as zeros, the store is
    # masked; a gated tile's up rows would start mid-tile, so it needs whole ones
    w3 = _rand(48, k, seed=85, scale=0.05)
    assert torch.equal(skinny_linear(x, w3, None, LinearTile(bm, 32, 32, 4, 2, tma=True)),
                       skinny_linear(x, w3, None, LinearTile(bm, 32, 32, 4, 2)))
    with pytest.raises(AssertionError, match="tma"):
        skinny_linear(x, _rand(96, k, seed=86), None, LinearTile(bm, 32, 32, 4, 2, tma=True), gated=True)
    # ragged column groups (N = 48 as 5 groups of 8 or 16 columns in 16-wide tiles): a group's
    # TMA tile also loads the next group's first W rows (gated: up rows from N + its first
    # column), whose columns the stores mask
    for kw in ({}, {"gated": True}, {"split_k": 2}):
        wk = _rand(96 if kw.get("gated") else 48, k, seed=87, scale=0.05)
        assert torch.equal(skinny_linear(x, wk, None, LinearTile(bm, 16, 32, 4, 2, False, 5, tma=True), **kw),
                           skinny_linear(x, wk, None, LinearTile(bm, 16, 32, 4, 2, False, 5), **kw)), kw


def test_per_sm_groups_follow_the_device_and_fall_back_to_tiles():
    """groups=PER_SM: one ragged group per SM where groups of cdiv(N / 8, SMs) * 8 columns fit the
    tile (gate_up's 8192 columns on the 132 SMs the interpreter assumes: 64-column groups), plain
    block_n-wide tiles where they do not (a 16-wide tile)."""
    sms = num_sms(DEVICE)
    assert _column_groups(8192, LinearTile(64, 64, 128, 4, 4, True, PER_SM), torch.device(DEVICE)) == sms
    assert _column_groups(8192, LinearTile(64, 16, 128, 4, 4, True, PER_SM), torch.device(DEVICE)) == 0
    assert _column_groups(8192, LinearTile(64, 64, 128, 4, 4), torch.device(DEVICE)) == 0
    assert all(t.groups == PER_SM for m, t in REFERENCE.tuned[(GATED, 16384, 3072)] if m > 1)
    x, w, _ = _inputs(7, seed=120)
    torch.testing.assert_close(skinny_linear(x, w, None, LinearTile(16, 16, 32, 4, 2, groups=PER_SM)).float(),
                               skinny_linear(x, w, None, LinearTile(16, 16, 32, 4, 2)).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m", [5, 21])
def test_whole_column_tiles_store_by_row_mask_only(m):
    """N % block_n == 0 (EVEN_N): the stores and the residual load are masked by rows only (so
    they vectorise); the results are those of the column-masked path (a 16-wide tile over N = 48
    against the same tile over N = 40, whose last block is masked, on the same first 40 columns),
    and rows past M are never written (the outputs live inside larger buffers here)."""
    x, w, _ = _inputs(m, seed=130)
    res, g = _rand(m, N, seed=131), _rand(N, seed=132)
    tile = LinearTile(16, 16, 32, 4, 2)
    cut = N - 8  # 40: not a multiple of 16
    for split in (1, 2):
        even = skinny_linear(x, w, None, tile, split_k=split)
        masked = skinny_linear(x, w[:cut], None, tile, split_k=split)
        assert torch.equal(even[..., :cut], masked)
    h, xg, scale = residual_linear(x, w, res, g, 1e-5, tile)
    h_m, xg_m, _ = residual_linear(x, w[:cut], res[:, :cut].contiguous(), g[:cut].contiguous(), 1e-5, tile)
    assert torch.equal(h[:, :cut], h_m) and torch.equal(xg[:, :cut], xg_m)
    torch.testing.assert_close(scale.ssq.sum(1), h.float().square().sum(1), rtol=1e-5, atol=1e-5)
    # nothing past M rows or N columns is written: out is a view into a sentinel-filled buffer
    for n in (N, cut):
        big = torch.full((m + 16, N + 16), 7.0, device=DEVICE, dtype=torch.bfloat16)
        _launch(x, w[:n], None, big[:m, :n], tile, m, n, K, gated=False, pdl=False, split_k=1)
        assert torch.equal(big[:m, :n], skinny_linear(x, w[:n], None, tile))
        big[:m, :n] = 7.0
        assert bool((big == 7.0).all()), n


@pytest.mark.parametrize("m", [5, 40])
def test_residual_linear_is_the_gemm_plus_the_residual_and_its_norm_parts(m):
    """residual_linear: h is the same tile's GEMM rounded, plus the residual, rounded (the add +
    RMSNorm's sum, bit for bit); xg = h * w rounded; the per-column-block sums of squares add
    up to each row's sum of h^2 (N = 48 in 32-wide blocks: the second block is masked)."""
    tile = LinearTile(16, 32, 64, 4, 2)
    x, w, _ = _inputs(m, seed=80)
    res, g = _rand(m, N, seed=81), _rand(N, seed=82)
    h, xg, scale = residual_linear(x, w, res, g, 1e-5, tile)
    assert h.dtype == xg.dtype == torch.bfloat16 and scale.ssq.shape == (m, 2) and (scale.n, scale.eps) == (N, 1e-5)
    assert torch.equal(h, (skinny_linear(x, w, None, tile).float() + res.float()).to(torch.bfloat16))
    assert torch.equal(xg, (h.float() * g.float()).to(torch.bfloat16))
    hf = h.float()
    torch.testing.assert_close(scale.ssq, torch.stack([hf[:, :32].square().sum(1), hf[:, 32:].square().sum(1)], 1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_row_scale_multiplies_each_row_before_rounding(gated):
    """row_scale: row r of the result is the GEMM of rsqrt(sum(ssq[r]) / n + eps) * x[r]. With
    sums of squares whose factor is a power of two (1, 1/2, 2; eps 0) that scaling of x is exact,
    so the result must equal, bit for bit, the unscaled kernel on the scaled rows; the sums are
    spread over 3 column blocks (padded to 4)."""
    m, tile = 6, LinearTile(16, 32, 64, 4, 2)
    x = _rand(m, K, seed=90)
    w = _rand(2 * N if gated else N, K, seed=91, scale=0.05)
    factor = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.5, 2.0])
    n = 64
    ssq = (n / factor.square())[:, None] * torch.tensor([0.5, 0.25, 0.25])  # each row sums to n / factor^2
    got = skinny_linear(x, w, None, tile, gated=gated, row_scale=RowScale(ssq.to(DEVICE), n, 0.0))
    want = skinny_linear((x.float() * factor.to(DEVICE)[:, None]).to(x.dtype), w, None, tile, gated=gated)
    assert torch.equal(got, want)
    assert not torch.equal(got, skinny_linear(x, w, None, tile, gated=gated))


@pytest.mark.parametrize("m", [1, 7, 40])
def test_post_attention_folds_the_norm_where_the_table_says(m, monkeypatch):
    """TritonOps.post_attention: with a `fold` tile for o_proj's shape at M (here 2..64, as
    the real table's rows), o_proj runs as residual_linear and gate_up with the row scale (two
    launches, no norm kernel); M = 1 (a None row) keeps the add + RMSNorm. Either way the MLP output and the residual are TorchOps' within bf16
    tolerance, and folding off (norm_fold=False) takes the unfolded path."""
    import runner.layers.triton_ops as tfo

    q, h, inter = 128, 64, 96
    dt = torch.bfloat16
    tables = REFERENCE.with_entries(fold={(h, q): ((1, None), (64, LinearTile(16, 32, 64, 4, 2)))})
    calls = []
    real = tfo.residual_linear
    monkeypatch.setattr(tfo, "residual_linear", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    torch.manual_seed(3)
    with torch.no_grad():
        o_proj = torch.nn.Linear(q, h, bias=False).to(DEVICE, dt)
        gate_up = torch.nn.Linear(h, 2 * inter, bias=False).to(DEVICE, dt)
        down = torch.nn.Linear(inter, h, bias=False).to(DEVICE, dt)
        out, res = _rand(m, q, seed=100 + m), _rand(m, h, seed=101 + m)
        w = (1 + 0.1 * _rand(h, seed=102, dtype=torch.float32)).to(dt)
        args = (out, o_proj, res, w, 1e-5, gate_up, down)
        want_mlp, want_res = TorchOps().post_attention(*args)
        for ops in (TritonOps(tables=tables), TritonOps(norm_fold=False, tables=tables)):
            calls.clear()
            mlp_out, new_res = ops.post_attention(*args)
            assert len(calls) == (1 if m > 1 and ops.norm_fold else 0)
            torch.testing.assert_close(new_res.float(), want_res.float(), rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(tfo.materialize(mlp_out).float(), want_mlp.float(), rtol=3e-2, atol=3e-2)


# _skinny_linear_kernel's runtime arguments for compile_sm90, those a launch specialises as
# multiples of 16 at the engine's shapes (M and N never: do_not_specialize), and one launch's
# (signature, constexprs) from its tile (`launch`)
_KERNEL_SIG = textwrap.dedent(
    """
    ptr = "*bf16"
    sig = dict(x_ptr=ptr, w_ptr=ptr, b_ptr=ptr, out_ptr=ptr, M="i32", N="i32", K="i32", stride_xm="i32",
               stride_wn="i32", stride_om="i32", k_split="i32", res_ptr=ptr, g_ptr=ptr, xg_ptr=ptr,
               ssq_ptr="*fp32", stride_rm="i32", ssq_tiles="i32", norm_n="i32", eps="fp32", n_groups="i32",
               x_desc=ptr, w_desc=ptr)
    div = ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "K", "stride_xm", "stride_wn", "stride_om", "k_split", "res_ptr",
           "g_ptr", "xg_ptr", "ssq_ptr", "stride_rm")

    def launch(tile, split=1, tma=False, **mode):
        # mode: GATED / HAS_BIAS / RESIDUAL / ROW_SCALE / RAGGED / LATE_TRIGGER, else the tile's or off
        consts = dict(GATED=False, HAS_BIAS=False, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                      BLOCK_K=tile.block_k, USE_GDC=True, SPLIT_K=split, LATE_TRIGGER=tile.late_trigger,
                      RESIDUAL=False, ROW_SCALE=False, RAGGED=tile.groups != 0, TMA=tma)
        consts.update(mode)
        consts.setdefault("EVEN_N", not consts["RAGGED"])  # the engine's N are multiples of its tiles
        consts["SSQ_P"] = 128 if consts["ROW_SCALE"] else 1
        sig_ = dict(sig, out_ptr="*fp32") if split > 1 else dict(sig)
        if tma:
            sig_.update(x_desc=f"tensordesc<bf16[{tile.block_m}, {tile.block_k}]>",
                        w_desc=f"tensordesc<bf16[{tile.block_n}, {tile.block_k}]>")
        return sig_, consts
    """
)

_COMPILE_SCRIPT = _KERNEL_SIG + textwrap.dedent(
    """
    from runner.kernels import linear as m
    from tests.support.triton_interpreter import compile_sm90

    # (gated, bias, split, residual, row_scale, ragged)
    modes = ((False, False, 1, False, False, False), (False, True, 1, False, False, False),
             (True, False, 1, False, False, False), (False, False, 4, False, False, False),
             (False, False, 1, True, False, False), (True, False, 1, False, True, False),
             (False, False, 4, False, False, True), (True, False, 1, False, False, True),
             (True, False, 1, False, True, True))
    for tile in (m.LinearTile(1, 16, 1024, 4, 1), m.LinearTile(1, 4, 1024, 4, 1), m.LinearTile(16, 32, 256, 4, 4),
                 m.LinearTile(64, 64, 128, 8, 4), m.LinearTile(64, 32, 128, 4, 4)):
        for gated, bias, split, residual, row_scale, ragged in modes:
            if (split > 1 or residual or row_scale or ragged) and tile.block_m == 1:
                continue
            mode = dict(GATED=gated, HAS_BIAS=bias, LATE_TRIGGER=tile.block_m > 1 and gated, RESIDUAL=residual,
                        ROW_SCALE=row_scale, RAGGED=ragged)
            compile_sm90(m._skinny_linear_kernel, *launch(tile, split, **mode), num_warps=tile.num_warps,
                         num_stages=tile.num_stages, launch_pdl=True)
            if tile.block_m > 1:  # the TMA loads, with the arguments a launch specialises
                k = compile_sm90(m._skinny_linear_kernel, *launch(tile, split, tma=True, **mode), div,
                                 num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=True)
                # software-pipelined: one TMA copy per operand per stage (x, W, and W's up half)
                copies = (3 if gated else 2) * tile.num_stages
                assert k.asm["ttgir"].count("async_tma_copy_global_to_local") == copies, (tile, gated, split)
    print("compiled")
    """
)


@pytest.mark.skipif(not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_kernel_compiles_for_sm90_with_pdl():
    compile_offline(_COMPILE_SCRIPT, timeout=600)


# Every MMA tile the tables name, compiled as a GPU launch specialises it (M and N never, the
# pointers, K and the strides as multiples of 16), then run through Triton's own ptxas: no tile
# may have its MMAs serialised (ptxas C7514, "wgmma.mma_async instructions are serialized"), a
# silent ~0.24 us per K step (it once hid in the 64-row residual tile, whose xg row stride was
# N, never specialised: residual_linear at 64 rows then took ~1.5x its time). Nor may a tile
# store its outputs one element per instruction, as column-masked stores did (the split
# partials: 32 st.global.b32 per thread instead of 8 vectors).
_SERIALISED_SCRIPT = _KERNEL_SIG + textwrap.dedent(
    """
    import re

    from runner.kernels import linear as m
    from tests.support.triton_interpreter import assert_mma_not_serialised, compile_sm90

    cases = [(t, dict(split=s)) for rows in m.REFERENCE.split.values() for _, t, s in rows if t is not None]
    for (kind, _, _), rows in m.REFERENCE.tuned.items():
        gated = kind == m.GATED
        cases += [(t, dict(GATED=gated)) for _, t in rows if t is not None and t.block_m > 1]
        cases += [(t, dict(GATED=True, ROW_SCALE=True)) for _, t in rows if gated and t is not None and t.block_m > 1]
    cases += [(t, dict(RESIDUAL=True)) for rows in m.REFERENCE.fold.values() for _, t in rows if t is not None]
    cases.append((m.LinearTile(64, 32, 128, 4, 6, tma=True), dict(RESIDUAL=True)))  # the residual tile that hid C7514
    for tile, mode in cases:
        k = compile_sm90(m._skinny_linear_kernel, *launch(tile, tma=tile.tma, **mode), div,
                         num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=True)
        assert_mma_not_serialised(k.asm["ptx"], (tile, mode))
        # every table N is a multiple of its tiles: the outputs leave as vectors, one scalar
        # store per row only for residual_linear's sums of squares (EVEN_N)
        scalar = len(re.findall("st[.]global[.]b(?:16|32) ", k.asm["ptx"]))  # not .v2 / .v4
        assert scalar == (1 if mode.get("RESIDUAL") else 0), (tile, mode, scalar)
    print("compiled")
    """
)


@pytest.mark.skipif(not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_no_table_tile_has_its_mmas_serialised():
    compile_offline(_SERIALISED_SCRIPT, timeout=600)
