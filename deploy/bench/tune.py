"""Tile sweeps of the skinny decode GEMMs (deploy/bench/gemm.py), and the engine with the swept
table. Sections (pick with --sections):

  gemm      tile sweep of qkv / o_proj / gate_up / down / lm_head against cuBLAS at M = 1..64;
            writes gemm_tuned.json into --out (`python -m deploy.bench.engine --tuned FILE`
            runs the engine on it) and, with --write-table PATH, the winners into that tuning
            table (runner/kernels/tuning/NAME.json, the data the engine reads per device)
  splitk    split-K variants of o_proj / down at M = 16..64 against cuBLAS
  variants  greedy decode per kernel variant (--variants, as in deploy.bench.engine); the
            variant `swept` takes the tile table from this run's gemm section

    python -m deploy.bench.tune --sections gemm,variants --batches 1,64 --variants "default;swept"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deploy.bench.common import (
    BATCHES,
    add_kernel_args,
    add_out_arg,
    apply_kernel_args,
    bench_bandwidth,
    log,
    run_header,
    write_results,
)


def render(res: dict) -> str:
    lines = [f"date {res['date']}, GPU {res['gpu']}, torch {res['torch']}, command `{res['command']}`"]
    if "gemm" in res:
        lines += ["", "Skinny decode GEMMs, us per call in a CUDA graph (weights rotated past L2), TB/s of weight bytes:", "",
                  "| GEMM | M | cuBLAS | best Triton tile | tile (bm,bn,bk,warps,stages) | gated: GEMM + SiLU*mul kernel | gated kernel |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, rows in res["gemm"]["shapes"].items():
            for e in rows:
                fused = (f"{e['separate_us']:.1f}", f"{e['fused_best_us']:.1f} ({e['fused_best_tile']})") if "fused" in e else ("", "")
                lines.append(f"| {name} | {e['m']} | {e['cublas_us']:.1f} ({e['cublas_TBps']:.2f}) | {e['best_us']:.1f} "
                             f"({e['best_TBps']:.2f}) | {e['best_tile']} | {fused[0]} | {fused[1]} |")
    if "variants" in res:
        from deploy.bench.variants import render_variants

        lines += render_variants(res["variants"])
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="bandwidth,gemm", help="comma-separated: bandwidth, gemm, splitk, variants")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="variants section: batch sizes")
    ap.add_argument("--variants", default="default;swept", help="variants section: as in deploy.bench.engine")
    ap.add_argument("--write-table", default=None, metavar="PATH",
                    help="gemm section: write the winners into this tuning table's linear section "
                         "(runner/kernels/tuning/NAME.json; deploy.bench.gemm.write_table)")
    add_kernel_args(ap)
    add_out_arg(ap, "tune")
    args = ap.parse_args()
    secs = set(args.sections.split(","))
    out = Path(args.out)
    apply_kernel_args(args)
    res = run_header()
    if "bandwidth" in secs:
        res["bandwidth_Bps"] = bench_bandwidth()
        log(f"copy bandwidth: {res['bandwidth_Bps']/1e12:.2f} TB/s")
    if "gemm" in secs:
        from deploy.bench.gemm import run_gemm_sweep, tuned_literal, write_table

        res["gemm"] = run_gemm_sweep()
        out.mkdir(parents=True, exist_ok=True)
        (out / "gemm_tuned.json").write_text(json.dumps(res["gemm"]["tuned"]))
        log(tuned_literal(res["gemm"]["tuned"]))
        if args.write_table:
            write_table(args.write_table, res["gemm"]["tuned"])
            log(f"wrote the linear section of {args.write_table}")
    if "splitk" in secs:
        from deploy.bench.gemm import run_splitk_sweep

        res["splitk"] = {key: val for key, val in run_splitk_sweep().items() if key != "rows"}  # rows: tuple keys
    if "variants" in secs:
        from deploy.bench.variants import run_decode_variants

        res["variants"] = run_decode_variants(args.variants, [int(b) for b in args.batches.split(",")],
                                              res.get("gemm", {}).get("tuned"))
    write_results(out, res, render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
