"""Tile sweep of the skinny decode GEMMs (runner/triton_linear.py) against cuBLAS, on the
Orpheus-3B shapes, at the graph bucket sizes where the tile can change (M = 1, 16, 32, 64).

For each (shape, M) every candidate tile is timed, and so is cuBLAS (F.linear); for the fused
prologues (add+RMSNorm before qkv and gate_up, SiLU*mul before down) the fused kernel is timed
against "the separate Triton op + the faster of cuBLAS and the best plain tile". The winners
form a tile table in runner.triton_linear.TUNED's layout, written to gemm_tuned.json and printed
as the Python literal that goes into the source.

Timing: a CUDA graph of 24 launches, replayed; weights rotate over enough copies (>= 256 MB in
all) that no launch finds its weight in L2, as in a real decode step. Launches are without PDL,
so a figure is kernel time + the graph's launch gap, like a step's GEMM without its neighbours.
Compiling ~400 variants one by one would take ~10 min: worker processes compile them first (a
JIT launch on the real shapes fills Triton's on-disk cache), then this process times them.

    python3 deploy/bench_gemm.py --out DIR          # or bench_gpu.py --sections gemm
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runner.triton_linear import (  # noqa: E402
    ADD_RMSNORM,
    PLAIN,
    PROLOGUE_NAMES,
    SILU_MUL,
    LinearTile,
    skinny_linear,
)

# name: (N, K, fused prologue worth measuring)
SHAPES = {"qkv": (5120, 3072, ADD_RMSNORM), "o": (3072, 3072, None), "gate_up": (16384, 3072, ADD_RMSNORM),
          "down": (3072, 8192, SILU_MUL)}
MS = (1, 16, 32, 64)  # bucket thresholds of runner.triton_linear.tile_for
LAUNCHES = 24
SMEM_BUDGET = 200 * 1024


def candidates(m: int, k: int) -> list[LinearTile]:
    tiles = []
    if m == 1:
        for bn, bk in ((8, 512), (8, 1024), (8, 2048), (16, 512), (16, 1024), (32, 512)):
            for w in (4, 8):
                tiles.append(LinearTile(1, bn, bk, w, 1))
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    if m <= 32:
        for bn in (16, 32, 64):
            for bk in (128, 256, 512) if m <= 16 else (128, 256):
                for st in (3, 5):
                    tiles.append(LinearTile(bm, bn, bk, 4, st))
    else:
        for bn in (16, 32, 64, 128):
            for bk in (64, 128, 256):
                for st, w in ((3, 4), (5, 4), (4, 8)):
                    tiles.append(LinearTile(bm, bn, bk, w, st))
    return [t for t in tiles if k % t.block_k == 0 and t.block_k <= k
            and (t.block_m == 1 or t.num_stages * (t.block_m + t.block_n) * t.block_k * 2 <= SMEM_BUDGET)]


def _inputs(n: int, k: int, m: int, prologue: int, copies: int = 1):
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
    x = torch.randn(m, 2 * k if prologue == SILU_MUL else k, device="cuda", dtype=torch.bfloat16, generator=g)
    res = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    return ws, x, res, nw


def _call(x, w, res, nw, prologue, tile):
    return skinny_linear(x, w, None, tile, prologue, residual=res if prologue == ADD_RMSNORM else None,
                         norm_weight=nw if prologue == ADD_RMSNORM else None, eps=1e-5)[0]


def _compile_one(job) -> str | None:
    """Worker: one launch on the real shapes (fills the Triton cache); the error, if any."""
    n, k, m, prologue, tile = job
    try:
        ws, x, res, nw = _inputs(n, k, m, prologue)
        _call(x, ws[0], res, nw, prologue, tile)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result of the sweep
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


def _time_graph(fn, copies: int) -> float:
    """µs per launch: a graph of LAUNCHES calls fn(i % copies), median of 5 replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(LAUNCHES):
            fn(i % copies)
    for _ in range(2):
        g.replay()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / LAUNCHES)
    del g
    return statistics.median(times)


def _tile_key(t: LinearTile) -> str:
    return f"{t.block_m},{t.block_n},{t.block_k},{t.num_warps},{t.num_stages}"


def run_gemm_sweep(workers: int = 14) -> dict:
    from runner.triton_fused_ops import rmsnorm, silu_and_mul

    jobs = []
    for name, (n, k, fused) in SHAPES.items():
        for m in MS:
            for p in (PLAIN, fused) if fused is not None and m <= 16 else (PLAIN,):
                jobs += [(n, k, m, p, t) for t in candidates(m, k)]
    t0 = time.perf_counter()
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        errors = dict(zip(jobs, pool.map(_compile_one, jobs)))
    print(f"gemm sweep: compiled {len(jobs)} variants in {time.perf_counter() - t0:.0f} s "
          f"({sum(e is not None for e in errors.values())} failed)", flush=True)

    out: dict = {"shapes": {}, "tuned": []}
    for name, (n, k, fused) in SHAPES.items():
        copies = max(2, math.ceil(256e6 / (n * k * 2)))
        wbytes = n * k * 2
        rows_plain, rows_fused = [], []
        for m in MS:
            ws, x, res, nw = _inputs(n, k, m, PLAIN, copies)
            cublas = _time_graph(lambda i: F.linear(x, ws[i]), copies)
            results = {}
            for t in candidates(m, k):
                if errors[(n, k, m, PLAIN, t)] is None:
                    results[_tile_key(t)] = (_time_graph(lambda i, t=t: _call(x, ws[i], res, nw, PLAIN, t), copies), t)
            best_key = min(results, key=lambda key: results[key][0]) if results else None
            best_us, best_tile = results[best_key] if best_key else (math.inf, None)
            entry = {"m": m, "cublas_us": cublas, "cublas_TBps": wbytes / cublas / 1e6,
                     "best_tile": best_key, "best_us": best_us, "best_TBps": wbytes / best_us / 1e6,
                     "all_us": {key: round(v[0], 2) for key, v in sorted(results.items(), key=lambda kv: kv[1][0])}}
            rows_plain.append((m, best_tile if best_us < cublas else None))
            if fused is not None and m <= 16:
                wsf, xf, resf, nwf = _inputs(n, k, m, fused, copies)
                if fused == SILU_MUL:
                    def separate_op():
                        return silu_and_mul(xf)
                else:
                    def separate_op():
                        return rmsnorm(xf, nwf, 1e-5, residual=resf)[0]
                act = separate_op()
                sep_gemm = (lambda i: _call(act, wsf[i], None, None, PLAIN, best_tile)) if best_us < cublas else (
                    lambda i: F.linear(act, wsf[i]))
                separate = _time_graph(lambda i: (separate_op(), sep_gemm(i)), copies)
                fres = {}
                for t in candidates(m, k):
                    if errors[(n, k, m, fused, t)] is None:
                        fres[_tile_key(t)] = (_time_graph(lambda i, t=t: _call(xf, wsf[i], resf, nwf, fused, t), copies), t)
                fkey = min(fres, key=lambda key: fres[key][0]) if fres else None
                fus, ftile = fres[fkey] if fkey else (math.inf, None)
                entry.update({"fused": PROLOGUE_NAMES[fused], "separate_us": separate, "fused_best_tile": fkey,
                              "fused_best_us": fus})
                rows_fused.append((m, ftile if fus < separate else None))
                del wsf
            out["shapes"].setdefault(name, []).append(entry)
            print(f"  {name} N={n} K={k} M={m}: cuBLAS {cublas:.1f} us ({entry['cublas_TBps']:.2f} TB/s), "
                  f"best {best_key} {best_us:.1f} us ({entry['best_TBps']:.2f} TB/s)"
                  + (f"; {entry['fused']}: separate {entry['separate_us']:.1f} us, fused {fkey} {fus:.1f} us"
                     if "fused" in entry else ""), flush=True)
            del ws
            torch.cuda.empty_cache()
        out["tuned"].append([PLAIN, n, k, [[m, None if t is None else list(dataclasses.astuple(t))] for m, t in rows_plain]])
        if fused is not None:
            out["tuned"].append([fused, n, k, [[m, None if t is None else list(dataclasses.astuple(t))] for m, t in rows_fused]])
    out["compile_s"] = time.perf_counter() - t0
    return out


def load_tuned(path: str | Path) -> dict:
    """gemm_tuned.json (the sweep's "tuned") -> runner.triton_linear.TUNED entries."""
    table = {}
    for prologue, n, k, rows in json.loads(Path(path).read_text()):
        table[(prologue, n, k)] = tuple((m, None if t is None else LinearTile(*t)) for m, t in rows)
    return table


def tuned_literal(tuned: list) -> str:
    lines = ["TUNED = {"]
    for prologue, n, k, rows in tuned:
        cells = ", ".join(f"({m}, {'None' if t is None else 'LinearTile(' + ', '.join(map(str, t)) + ')'})" for m, t in rows)
        lines.append(f"    ({PROLOGUE_NAMES[prologue].upper()}, {n}, {k}): ({cells},),")
    return "\n".join(lines + ["}"])


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--workers", type=int, default=14)
    args = ap.parse_args()
    res = run_gemm_sweep(args.workers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_sweep.json").write_text(json.dumps(res, indent=1))
    (out / "gemm_tuned.json").write_text(json.dumps(res["tuned"]))
    print(tuned_literal(res["tuned"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
