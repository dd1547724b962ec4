"""Tile sweep of the skinny decode GEMMs (runner/kernels/linear.py) against cuBLAS, on one
model's shapes (`--shapes`: Orpheus-3B, CSM-1B's backbone and depth decoder, Qwen3-TTS 1.7B's
talker and code predictor), at the graph bucket
sizes where the tile can change (M = 1, 16, 32, 64).

For each (GEMM, M) every candidate tile is timed, and so is cuBLAS (F.linear); gate_up with
the SiLU*mul epilogue (gated) is timed against the faster plain GEMM + the SiLU*mul kernel.
The winners form the `linear` section of a tuning table (runner/kernels/tuning, the JSON the
engine reads for the device it runs on): `--write-table PATH` writes it into PATH (the other
sections of an existing table are kept; a new file is named after this GPU), e.g.
runner/kernels/tuning/nvidia_h200.json. The raw sweep goes to gemm_sweep.json and its rows to
gemm_tuned.json (what `python -m deploy.bench.engine --tuned FILE` runs on).

Timing: a CUDA graph of 24 launches, replayed; weights rotate over enough copies (>= 256 MB in
all) that no launch finds its weight in L2, as in a real decode step. Launches are without PDL,
so a figure is kernel time + the graph's launch gap, like a step's GEMM without its neighbours.
Worker processes compile every variant first (a JIT launch on the real shapes fills Triton's
on-disk cache), then this process times them.

    python -m deploy.bench.gemm --out DIR [--shapes csm] [--write-table runner/kernels/tuning/nvidia_h200.json]
    python -m deploy.bench.gemm --shapes csm --split-only --write-table ...  # split-K rows alone
    python -m deploy.bench.tune --sections gemm     # the same sweep inside the tuning bench
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

from runner.kernels.linear import GATED, PLAIN, LinearTile, skinny_linear
from runner.kernels.tuning import (
    TABLES_DIR,
    LinearTables,
    dumps_table,
    linear_to_json,
    with_linear_rows,
    with_split_rows,
)

# name: (weight rows, K, whether the gated kind is timed too), per model whose decode GEMMs a
# table row serves (`--shapes`)
SHAPE_SETS = {
    "orpheus": {"qkv": (5120, 3072, False), "o": (3072, 3072, False), "gate_up": (16384, 3072, True),
                "down": (3072, 8192, False)},
    # CSM-1B: the backbone (Llama 1B) and the depth decoder (hidden 1024, 8 / 2 heads of 128,
    # intermediate 8192) with its input projector (backbone width -> 1024, position 0 each frame);
    # the heads of codebook 0 (backbone) and of codebooks 1..31 (depth decoder, one per sub-step)
    "csm": {"qkv": (3072, 2048, False), "o": (2048, 2048, False), "gate_up": (16384, 2048, True),
            "down": (2048, 8192, False), "depth_qkv": (1536, 1024, False), "depth_o": (1024, 1024, False),
            "depth_gate_up": (16384, 1024, True), "depth_down": (1024, 8192, False),
            "depth_projector": (1024, 2048, False), "lm_head": (2051, 2048, False), "depth_head": (2051, 1024, False)},
    # Qwen3-TTS 12 Hz 1.7B (deploy/bench/frame_models.py QWEN3_TTS_1B7): the talker (Qwen3, hidden 2048,
    # 16 / 8 heads of 128, intermediate 6144), the code predictor (hidden 1024, the same heads,
    # intermediate 3072) with its input projection, code 0's head (3072 ids) and a group's (2048)
    "qwen3_tts": {"qkv": (4096, 2048, False), "o": (2048, 2048, False), "gate_up": (12288, 2048, True),
                  "down": (2048, 6144, False), "depth_qkv": (4096, 1024, False), "depth_o": (1024, 2048, False),
                  "depth_gate_up": (6144, 1024, True), "depth_down": (1024, 3072, False),
                  "depth_projector": (1024, 2048, False), "lm_head": (3072, 2048, False),
                  "depth_head": (2048, 1024, False)},
}
SHAPES = SHAPE_SETS["orpheus"]
MS = (1, 16, 32, 64)  # bucket thresholds of the linear table's rows
LAUNCHES = 24
SMEM_BUDGET = 200 * 1024


def candidates(m: int, k: int) -> list[LinearTile]:
    tiles = []
    if m == 1:
        for bn, bk in ((4, 512), (4, 1024), (8, 512), (8, 1024), (8, 2048), (16, 512), (16, 1024), (32, 512)):
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


def _inputs(n: int, k: int, m: int, copies: int = 1):
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
    return ws, torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)


def _compile_one(job) -> str | None:
    """Worker: one launch on the real shapes (fills the Triton cache); the error, if any."""
    n, k, m, kind, tile = job
    try:
        ws, x = _inputs(n, k, m)
        skinny_linear(x, ws[0], None, tile, gated=kind == GATED)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result of the sweep
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


def _time_graph(fn, copies: int, launches: int = LAUNCHES) -> float:
    """µs per launch: a graph of `launches` calls fn(i % copies), median of 5 replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(launches):
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
        times.append(a.elapsed_time(b) * 1e3 / launches)
    del g
    return statistics.median(times)


def _tile_key(t: LinearTile) -> str:
    return f"{t.block_m},{t.block_n},{t.block_k},{t.num_warps},{t.num_stages}"


def _best(results: dict) -> tuple[str | None, float, LinearTile | None]:
    if not results:
        return None, math.inf, None
    key = min(results, key=lambda kk: results[kk][0])
    return key, results[key][0], results[key][1]


def _compile_all(label: str, compile_one, jobs: list, workers: int) -> dict:
    """Compile every job in worker processes (each fills Triton's on-disk cache): job -> error."""
    t0 = time.perf_counter()
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        errors = dict(zip(jobs, pool.map(compile_one, jobs)))
    print(f"{label}: compiled {len(jobs)} variants in {time.perf_counter() - t0:.0f} s "
          f"({sum(e is not None for e in errors.values())} failed)", flush=True)
    return errors


def run_gemm_sweep(workers: int = 14, shapes: dict = SHAPES) -> dict:
    from runner.kernels.fused_ops import silu_and_mul

    jobs = [(n, k, m, kind, t) for n, k, gated in shapes.values() for m in MS
            for kind in ((PLAIN, GATED) if gated else (PLAIN,)) for t in candidates(m, k)]
    t0 = time.perf_counter()
    errors = _compile_all("gemm sweep", _compile_one, jobs, workers)

    def sweep(n, k, m, kind, x, ws, copies):
        res = {}
        for t in candidates(m, k):
            if errors[(n, k, m, kind, t)] is None:
                res[_tile_key(t)] = (_time_graph(lambda i, t=t: skinny_linear(x, ws[i], None, t, gated=kind == GATED),
                                                 copies), t)
        return res

    out: dict = {"shapes": {}, "tuned": []}
    for name, (n, k, gated) in shapes.items():
        copies = max(2, math.ceil(256e6 / (n * k * 2)))
        wbytes = n * k * 2
        rows = {PLAIN: []} | ({GATED: []} if gated else {})
        for m in MS:
            ws, x = _inputs(n, k, m, copies)
            cublas = _time_graph(lambda i: F.linear(x, ws[i]), copies)
            best_key, best_us, best_tile = _best(sweep(n, k, m, PLAIN, x, ws, copies))
            entry = {"m": m, "cublas_us": cublas, "cublas_TBps": wbytes / cublas / 1e6,
                     "best_tile": best_key, "best_us": best_us, "best_TBps": wbytes / best_us / 1e6}
            rows[PLAIN].append((m, best_tile if best_us < cublas else None))
            if gated:
                if best_us < cublas:
                    separate = _time_graph(lambda i: silu_and_mul(skinny_linear(x, ws[i], None, best_tile)), copies)
                else:
                    separate = _time_graph(lambda i: silu_and_mul(F.linear(x, ws[i])), copies)
                fkey, fus, ftile = _best(sweep(n, k, m, GATED, x, ws, copies))
                entry.update({"fused": "gated", "separate_us": separate, "fused_best_tile": fkey, "fused_best_us": fus})
                rows[GATED].append((m, ftile if fus < separate else None))
            out["shapes"].setdefault(name, []).append(entry)
            print(f"  {name} N={n} K={k} M={m}: cuBLAS {cublas:.1f} us ({entry['cublas_TBps']:.2f} TB/s), "
                  f"best {best_key} {best_us:.1f} us ({entry['best_TBps']:.2f} TB/s)"
                  + (f"; gated: GEMM + SiLU*mul kernel {entry['separate_us']:.1f} us, fused {entry['fused_best_tile']} "
                     f"{entry['fused_best_us']:.1f} us" if gated else ""), flush=True)
            del ws
            torch.cuda.empty_cache()
        for kind, rr in rows.items():
            out["tuned"].append([kind, n, k, [[m, None if t is None else list(dataclasses.astuple(t))] for m, t in rr]])
    out["compile_s"] = time.perf_counter() - t0
    return out


SPLITK_SHAPES = {"o": (3072, 3072), "down": (3072, 8192)}
# the GEMMs whose output only feeds the add + RMSNorm (TritonOps.linear(into_norm=True)), per set
SPLIT_NAMES = ("o", "down", "depth_o", "depth_down")
SPLIT_GAIN = 0.9  # a split row must beat cuBLAS by 10%: its consumer reads the fp32 partials too


def splitk_candidates(m: int, k: int) -> list[tuple[LinearTile, int]]:
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    out = []
    for split in (2, 4, 8):
        for bn in (32, 64, 128):
            for bk in (64, 128):
                for st in (4, 6):
                    t = LinearTile(bm, bn, bk, 4, st)
                    if k % (split * bk) == 0 and st * (bm + bn) * bk * 2 <= SMEM_BUDGET:
                        out.append((t, split))
    return out


def _compile_splitk(job) -> str | None:
    n, k, m, tile, split = job
    try:
        ws, x = _inputs(n, k, m)
        skinny_linear(x, ws[0], None, tile, split_k=split)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result of the sweep
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


def run_splitk_sweep(workers: int = 14, ms: tuple[int, ...] = (16, 32, 64), shapes: dict = SPLITK_SHAPES) -> dict:
    """Split-K variants of o_proj and down (fp32 partials [S, M, N], summed by the consumer)
    against cuBLAS at M = 16, 32, 64: the GEMM alone (the consumer's extra reads are not in it).
    "rows": the split section's entries, (N, K) -> [[M, tile or None, splits]]."""
    jobs = [(n, k, m, t, sp) for n, k in shapes.values() for m in ms for t, sp in splitk_candidates(m, k)]
    errors = _compile_all("split-K sweep", _compile_splitk, jobs, workers)
    out: dict = {"rows": {}}
    for name, (n, k) in shapes.items():
        copies = max(2, math.ceil(256e6 / (n * k * 2)))
        for m in ms:
            ws, x = _inputs(n, k, m, copies)
            cublas = _time_graph(lambda i: F.linear(x, ws[i]), copies)
            res, tiles = {}, {}
            for t, sp in splitk_candidates(m, k):
                if errors[(n, k, m, t, sp)] is None:
                    key = f"{_tile_key(t)} s{sp}"
                    tiles[key] = (t, sp)
                    res[key] = _time_graph(lambda i, t=t, sp=sp: skinny_linear(x, ws[i], None, t, split_k=sp), copies)
            best = min(res, key=res.get) if res else None
            won = best is not None and res[best] < SPLIT_GAIN * cublas
            out["rows"].setdefault((n, k), []).append((m, *tiles[best]) if won else (m, None, 1))
            top = sorted(res.items(), key=lambda kv: kv[1])[:5]
            out[f"{name}_M{m}"] = {"cublas_us": cublas, "best": best, "best_us": res.get(best), "top5": top,
                                   "wbytes": n * k * 2}
            print(f"  split-K {name} M={m}: cuBLAS {cublas:.1f} us; best {best} {res.get(best, float('nan')):.1f} us; "
                  f"top {[(kk, round(v, 1)) for kk, v in top]}", flush=True)
            del ws
            torch.cuda.empty_cache()
    return out


def load_tuned_rows(tuned: list) -> dict:
    """The sweep's "tuned" rows -> a linear table's `tuned` entries ((kind, N, K) -> rows)."""
    table = {}
    for kind, n, k, rows in tuned:
        table[(kind, n, k)] = tuple((m, None if t is None else LinearTile(*t)) for m, t in rows)
    return table


def load_tuned(path: str | Path) -> dict:
    """gemm_tuned.json (the sweep's "tuned") -> a linear table's `tuned` entries."""
    return load_tuned_rows(json.loads(Path(path).read_text()))


def tuned_literal(tuned: list) -> str:
    """The sweep's rows as the `linear` section of a tuning table (JSON text, for the log)."""
    section = linear_to_json(LinearTables(load_tuned_rows(tuned), default_tiles=True))["linear"]
    return dumps_table({"linear": section})


def _joined(old: str | None, line: str) -> str:
    """A section's provenance with one more sweep's line (a line it already holds is not repeated)."""
    return line if not old else old if line in old else f"{old}; {line}"


def write_table(path: str | Path, tuned: list | None, provenance: str | None = None, split: dict | None = None,
                split_provenance: str | None = None) -> dict:
    """Put the sweep's rows into the `linear` section of the tuning table at `path` (tuned None:
    that section is left as it is), and split-K
    rows ((N, K) -> rows, run_splitk_sweep's "rows") into its `split` section, each section's
    provenance extended by one line: the swept entries are replaced, the table's other entries
    and sections (fold, head, attention, ...) kept. A new file is named after this GPU and serves
    it by name (provenance None: this GPU and this sweep). Returns the table written."""
    if provenance is None:
        provenance = (f"{torch.cuda.get_device_name()}, bf16: decode GEMMs swept alone against cuBLAS "
                      "(python -m deploy.bench.gemm), the faster per row; null rows: cuBLAS")
    path = Path(path)
    if path.is_file():
        raw = json.loads(path.read_text())
    else:
        raw = {"name": path.stem, "gpu_names": [torch.cuda.get_device_name()]}
    if tuned is not None:
        raw = with_linear_rows(raw, load_tuned_rows(tuned), _joined(raw.get("linear", {}).get("provenance"), provenance))
    if split is not None:
        raw = with_split_rows(raw, split, _joined(raw.get("split", {}).get("provenance"), split_provenance))
    path.write_text(dumps_table(raw))
    return raw


def new_shapes(path: str | Path, shapes: dict) -> dict:
    """The entries of `shapes` (name -> (N, K, gated)) whose plain (N, K) the linear section of
    the table at `path` has no rows for."""
    from runner.kernels.tuning import tables_from_json

    named = {(n, k) for _, n, k in tables_from_json(json.loads(Path(path).read_text())).linear.tuned}
    return {name: shape for name, shape in shapes.items() if shape[:2] not in named}


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--write-table", default=None, metavar="PATH",
                    help=f"write the winners as the linear section of this tuning table (e.g. {TABLES_DIR}/NAME.json)")
    ap.add_argument("--shapes", default="orpheus", choices=sorted(SHAPE_SETS),
                    help="the model whose decode GEMMs are swept (the table keeps other shapes' rows)")
    ap.add_argument("--split", action="store_true",
                    help="also sweep split-K for the GEMMs feeding the add + RMSNorm and write the split rows")
    ap.add_argument("--split-only", action="store_true",
                    help="sweep (and write) only the split-K rows; the table's linear rows are kept")
    ap.add_argument("--new-only", action="store_true",
                    help="sweep only the shapes --write-table's table has no rows for (models share shapes: CSM's "
                         "rows for 2048x2048 stay as measured when Qwen3-TTS's are swept)")
    args = ap.parse_args()
    args.split |= args.split_only
    shapes = SHAPE_SETS[args.shapes]
    if args.new_only:
        if not args.write_table:
            raise SystemExit("--new-only needs --write-table (the table whose shapes are kept)")
        shapes = new_shapes(args.write_table, shapes)
        print(f"new shapes: {', '.join(shapes) or 'none'}")
    res = {"tuned": None} if args.split_only or not shapes else run_gemm_sweep(args.workers, shapes)
    split = None
    if args.split:
        names = [nm for nm in SPLIT_NAMES if nm in SHAPE_SETS[args.shapes]]
        split = run_splitk_sweep(args.workers, shapes={nm: SHAPE_SETS[args.shapes][nm][:2] for nm in names})
        res["split"] = {key: val for key, val in split.items() if key != "rows"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_sweep.json").write_text(json.dumps(res, indent=1))
    if res["tuned"] is not None:
        (out / "gemm_tuned.json").write_text(json.dumps(res["tuned"]))
        print(tuned_literal(res["tuned"]))
    if args.write_table:
        gpu = torch.cuda.get_device_name()
        swept = ", ".join(f"{name} {n}x{k}" for name, (n, k, _) in shapes.items())
        write_table(args.write_table, res["tuned"],
                    f"{gpu}, bf16: {args.shapes} decode GEMMs ({swept}) swept alone against cuBLAS (python -m "
                    f"deploy.bench.gemm --shapes {args.shapes}), the faster per row; null rows: cuBLAS",
                    split=None if split is None else split["rows"],
                    split_provenance=f"{gpu}: {args.shapes} split-K rows where the GEMM alone beat cuBLAS by "
                                     f"{round(100 * (1 - SPLIT_GAIN))}% (gemm --shapes {args.shapes} --split)")
        written = [name for name, part in (("linear", res["tuned"]), ("split", split)) if part is not None]
        print(f"wrote the {' and '.join(written)} section(s) of {args.write_table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
