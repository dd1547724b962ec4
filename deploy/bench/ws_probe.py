"""Does a warp-specialised, TMA-fed Triton GEMM stream a decode GEMM's weights faster than the
engine's pointer tiles? Each decode GEMM alone at one M, in a CUDA graph of 28 launches over 8
weight copies (deploy/bench/gemm_alone.py's timing): cuBLAS, the engine's tile (runner/kernels/linear.py
tile tables), and this probe's kernel with and without `warp_specialize`.

    python -m deploy.bench.ws_probe --m 64

Why: Nsight Compute (python -m deploy.bench.ncu_layer) has each program of the engine's tiles streaming
weights at ~30-45 GB/s, and the tiles lose a few microseconds to ramp and drain. In Triton 3.6 a
`tl.range(..., warp_specialize=True)` loop over tensor-descriptor loads compiles for sm_90 into a
producer partition that issues TMA loads into a ring of shared-memory stages and consumer warps
that run the MMAs (the engine's own TMA tiles have no producer warps). Every probe variant checks its output
against cuBLAS before it is timed.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args() -> argparse.Namespace:
    from deploy.bench.common import add_out_arg

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=64)
    add_out_arg(ap, "ws_probe")
    return ap.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()  # before triton is imported: --help answers on a machine without it

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deploy.bench.gemm import _inputs, _time_graph
from runner.kernels.linear import (
    GATED,
    PLAIN,
    silu_mul,
    skinny_linear,
    split_tile_for,
    tile_for,
)


@triton.jit
def _probe_kernel(x_desc, w_desc, out_ptr, M, N, k_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr, WS: tl.constexpr,
                  STAGES: tl.constexpr):
    # out: GATED [M, N] bf16 silu(gate) * up; SPLIT_K > 1 fp32 partials [S, M, N]; else [M, N] bf16
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k_lo = split * k_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(k_lo, k_lo + k_split, BLOCK_K, num_stages=STAGES, warp_specialize=WS):
        a = x_desc.load([0, k])  # rows past M are zero-filled by the TMA unit
        w = w_desc.load([n0, k])
        acc = tl.dot(a, w.T, acc)
        if GATED:
            wu = w_desc.load([N + n0, k])
            acc_u = tl.dot(a, wu.T, acc_u)
    rows = tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows[:, None] * N + cols[None, :]
    if SPLIT_K > 1:
        tl.store(out_ptr + split * M * N + offs, acc, mask=mask)
    elif GATED:  # the engine's SiLU*mul roundings (runner/kernels/linear.py silu_mul)
        tl.store(out_ptr + offs, silu_mul(acc.to(tl.bfloat16), acc_u.to(tl.bfloat16)), mask=mask)
    else:
        tl.store(out_ptr + offs, acc.to(tl.bfloat16), mask=mask)


def _probe(x, w, bn: int, bk: int, stages: int, warps: int, gated: bool, splits: int, ws: bool):
    """A launcher for one weight copy (descriptors built once, outside the graph)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = w.shape[0] // 2 if gated else w.shape[0]
    bm = max(16, triton.next_power_of_2(m))
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w, [bn, bk])
    shape = (splits, m, n) if splits > 1 else (m, n)
    dtype = torch.float32 if splits > 1 else torch.bfloat16

    def launch():
        out = torch.empty(shape, device=x.device, dtype=dtype)
        _probe_kernel[(triton.cdiv(n, bn), splits)](xd, wd, out, m, n, k // splits, BLOCK_M=bm, BLOCK_N=bn,
                                                    BLOCK_K=bk, GATED=gated, SPLIT_K=splits, WS=ws, STAGES=stages,
                                                    num_warps=warps, num_stages=stages)
        return out
    return launch


# (name, weight N x K, gated, probe tiles bn/bk/stages/warps/splits)
SHAPES = (
    ("qkv", 5120, 3072, False, ("64/128/4/4/1", "64/128/6/4/1", "64/128/4/4/2", "32/128/6/4/1")),
    ("o_proj", 3072, 3072, False, ("64/128/4/4/2", "64/128/6/4/2", "64/128/4/4/1", "32/128/6/4/1")),
    ("gate_up", 16384, 3072, True, ("64/128/4/4/1", "64/64/6/4/1", "64/128/3/4/1", "32/128/6/4/1")),
    ("down", 3072, 8192, False, ("128/128/4/4/4", "64/128/4/4/4", "64/128/6/4/2", "128/128/3/4/4")),
)


def main(args: argparse.Namespace) -> None:

    def alloc(size: int, align: int, stream):  # device-side descriptor scratch (unused with host descriptors)
        return torch.empty(size, device="cuda", dtype=torch.int8)

    triton.set_allocator(alloc)
    copies, launches, m = 8, 28, args.m
    lines = []
    for name, n, k, gated, tiles in SHAPES:
        ws, x = _inputs(n, k, m, copies)
        gb = n * k * 2 / 1e9
        ref = F.linear(x, ws[0])
        if gated:
            g_, u_ = ref.float().split(n // 2, dim=-1)
            ref = (F.silu(g_.bfloat16()).float() * u_.bfloat16().float()).bfloat16()
        res = {"cuBLAS": _time_graph(lambda i, x=x, ws=ws: F.linear(x, ws[i]), copies, launches)}
        split = None if gated else split_tile_for(n, k, m)
        tile = tile_for(GATED if gated else PLAIN, n, k, m)
        if split is not None and name in ("o_proj", "down"):
            def engine(i, x=x, ws=ws, t=split[0], s=split[1]):
                return skinny_linear(x, ws[i], None, t, split_k=s)
            res[f"engine split {split[1]}"] = _time_graph(engine, copies, launches)
        elif tile is not None:
            def engine(i, x=x, ws=ws, t=tile, g=gated):
                return skinny_linear(x, ws[i], None, t, gated=g)
            res["engine tile"] = _time_graph(engine, copies, launches)
        for spec in tiles:
            bn, bk, stages, warps, splits = map(int, spec.split("/"))
            for wsp in (False, True):
                key = f"{spec}{' ws' if wsp else ''}"
                try:
                    fns = [_probe(x, w, bn, bk, stages, warps, gated, splits, wsp) for w in ws]
                    out = fns[0]()
                    got = out.sum(0) if splits > 1 else out.float()
                    torch.testing.assert_close(got, ref.float(), atol=2e-2, rtol=2e-2)
                    res[key] = _time_graph(lambda i, f=fns: f[i](), copies, launches)
                except Exception as e:  # noqa: BLE001 - a variant that does not compile or fit is a result
                    res[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        for key, us in res.items():
            shown = f"{us:.2f} us ({gb / us * 1e3:.2f} TB/s)" if isinstance(us, float) else us
            lines.append(f"{name} {n}x{k} M={m} {key}: {shown}")
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(ARGS)
