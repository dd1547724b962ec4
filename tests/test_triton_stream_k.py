"""Stream-K split GEMM (runner/triton_stream_k.py) and its route through TritonOps.

Compiled on CUDA; under Triton's interpreter on CPU; skipped without `triton` (CPU CI).

What is checked:
* the slot count is the most program runs that meet one column tile (against a plain simulation
  of the partition);
* every slot of every column tile is exactly the fp32 GEMM over that segment's K range, unused
  slots are zeros (the output buffer starts as NaN), and the slots sum to x @ W^T, for run
  lengths shorter than a tile, spanning several tiles, one program, more programs than tiles,
  masked columns and several row blocks;
* a row's partials do not depend on the other rows (graph padding cannot move them);
* TritonOps sends a SPLIT_TUNED row with STREAM_K here and the add + RMSNorm sums the slots;
* the sm_90 compile software-pipelines the K loop across column tiles (cp.async stages).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.triton_interpreter import compile_offline, has_nvidia_backend, interpret_without_cuda, interpreted_or_skip

_CUDA = interpret_without_cuda()
triton = pytest.importorskip("triton", reason="triton not installed (CPU torch wheel does not bring it)")

from runner.fused_ops import TorchOps  # noqa: E402
from runner.triton_fused_ops import TritonOps  # noqa: E402
from runner.triton_linear import STREAM_K, SPLIT_TUNED, LinearTile, Partials, materialize  # noqa: E402
from runner.triton_stream_k import _stream_k_kernel, stream_k_linear, stream_k_slots  # noqa: E402

DEVICE = "cuda" if _CUDA else "cpu"
if not _CUDA:
    interpreted_or_skip(_stream_k_kernel, "runner.triton_stream_k")


def _rand(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(DEVICE, torch.bfloat16)


def _segments(n_tiles: int, k_steps: int, programs: int) -> dict[int, list[tuple[int, int]]]:
    """Plain simulation of the partition: tile -> its (k_step_lo, k_step_hi) segments in slot order."""
    u = n_tiles * k_steps
    out: dict[int, list[tuple[int, int]]] = {t: [] for t in range(n_tiles)}
    for p in range(programs):
        lo, hi = p * u // programs, (p + 1) * u // programs
        i = lo
        while i < hi:
            t = i // k_steps
            end = min(hi, (t + 1) * k_steps)
            out[t].append((i - t * k_steps, end - t * k_steps))
            i = end
    return out


@pytest.mark.parametrize("n_tiles,k_steps", [(48, 24), (24, 64), (3, 4), (5, 1), (1, 9)])
def test_slot_count_is_the_most_runs_meeting_a_tile(n_tiles, k_steps):
    for programs in range(1, n_tiles * k_steps + 1, max(1, n_tiles * k_steps // 40)):
        segs = _segments(n_tiles, k_steps, programs)
        assert stream_k_slots(n_tiles, k_steps, programs) == max(len(s) for s in segs.values()), programs


# (M, N, K, tile, programs): runs shorter than a tile, runs over several tiles, one program, more
# programs than column tiles, N not a multiple of block_n (masked columns), two row blocks
CASES = [
    (5, 48, 128, LinearTile(16, 16, 32, 4, 2, False, 5), 5),
    (16, 96, 256, LinearTile(16, 32, 64, 4, 3, False, 7), 7),
    (3, 40, 64, LinearTile(16, 16, 32, 4, 2, False, 3), 3),
    (7, 48, 128, LinearTile(16, 16, 32, 4, 2, False, 12), 12),
    (20, 64, 512, LinearTile(16, 32, 64, 4, 2, False, 1), 1),
    (33, 48, 256, LinearTile(32, 16, 64, 4, 2, False, 9), 9),
]


@pytest.mark.parametrize("m,n,k,tile,programs", CASES)
def test_each_slot_is_the_gemm_over_its_segment(m, n, k, tile, programs, monkeypatch):
    x, w = _rand(m, k, seed=1), _rand(n, k, seed=2, scale=0.05)
    empty = torch.empty

    def nan_empty(*shape, **kw):  # the partials buffer starts as garbage: unused slots must be written
        return empty(*shape, **kw).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", nan_empty)
    parts = stream_k_linear(x, w, tile)
    monkeypatch.undo()
    n_tiles, k_steps = -(-n // tile.block_n), k // tile.block_k
    segs = _segments(n_tiles, k_steps, programs)
    assert parts.shape == (max(len(s) for s in segs.values()), m, n) and parts.dtype == torch.float32
    xf, wf, bk = x.float(), w.float(), tile.block_k
    for t, tile_segs in segs.items():
        cols = slice(t * tile.block_n, min(n, (t + 1) * tile.block_n))
        for slot in range(parts.shape[0]):
            if slot < len(tile_segs):
                lo, hi = tile_segs[slot]
                want = xf[:, lo * bk:hi * bk] @ wf[cols, lo * bk:hi * bk].T
                torch.testing.assert_close(parts[slot, :, cols], want, atol=1e-4, rtol=1e-4)
            else:
                assert torch.equal(parts[slot, :, cols], torch.zeros_like(parts[slot, :, cols])), (t, slot)
    torch.testing.assert_close(parts.sum(0), xf @ wf.T, atol=1e-3, rtol=1e-3)


def test_row_partials_do_not_depend_on_other_rows():
    tile = LinearTile(16, 16, 32, 4, 2, False, 7)
    x, w = _rand(9, 128, seed=3), _rand(48, 128, seed=4, scale=0.05)
    all_rows = stream_k_linear(x, w, tile)
    one = stream_k_linear(x[4:5].contiguous(), w, tile)
    if _CUDA:  # tensor-core rows are independent; the interpreter's numpy matmul may block by M
        assert torch.equal(one[:, 0], all_rows[:, 4])
    else:
        torch.testing.assert_close(one[:, 0], all_rows[:, 4], atol=1e-6, rtol=1e-6)


def test_triton_ops_route_a_stream_k_row_into_the_norm(monkeypatch):
    n, k, m = 64, 256, 12
    tile = LinearTile(16, 32, 64, 4, 2, False, 5)
    monkeypatch.setitem(SPLIT_TUNED, (n, k), ((16, tile, STREAM_K),))
    lin = torch.nn.Linear(k, n, bias=False).to(DEVICE, torch.bfloat16)
    x, residual = _rand(m, k, seed=5), _rand(m, n, seed=6)
    norm_w = _rand(n, seed=7)
    ops, ref = TritonOps(), TorchOps()
    h = ops.linear(x, lin, into_norm=True)
    assert isinstance(h, Partials) and h.parts.shape[0] == stream_k_slots(2, 4, 5)
    torch.testing.assert_close(materialize(h).float(), ref.linear(x, lin).float(), atol=2e-2, rtol=2e-2)
    normed, new_res = ops.add_rmsnorm(h, residual, norm_w, 1e-6)
    want_normed, want_res = ref.add_rmsnorm(materialize(h), residual, norm_w, 1e-6)
    assert torch.equal(new_res, want_res)  # the norm sums the slots as materialize does
    torch.testing.assert_close(normed.float(), want_normed.float(), atol=2e-2, rtol=2e-2)


_COMPILE_SCRIPT = textwrap.dedent(
    """
    from runner import triton_stream_k as m
    from tests.triton_interpreter import compile_sm90

    sig = dict(x_ptr="*bf16", w_ptr="*bf16", parts_ptr="*fp32", M="i32", N="i32", stride_xm="i32",
               stride_wn="i32", U="i32", KS="i32", G="i32")
    div = ("x_ptr", "w_ptr", "parts_ptr", "N", "stride_xm", "stride_wn")
    for bm, bn, bk, stages in ((64, 64, 128, 4), (64, 128, 128, 4), (16, 32, 128, 5)):
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, S_MAX=4, USE_GDC=True, LATE_TRIGGER=False,
                      NUM_STAGES=stages)
        k = compile_sm90(m._stream_k_kernel, sig, consts, div, num_warps=4, num_stages=stages, launch_pdl=True)
        ttgir = k.asm["ttgir"]
        # two async copies (x and W) per stage: the flat loop is pipelined across tile boundaries
        assert ttgir.count("async_copy_global_to_local") == 2 * stages, (bm, bn, bk, stages)
        assert "griddepcontrol.wait" in k.asm["ptx"]
    print("compiled")
    """
)


@pytest.mark.skipif(not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_kernel_compiles_for_sm90_pipelined():
    compile_offline(_COMPILE_SCRIPT, timeout=600)
