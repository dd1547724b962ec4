"""The fused codebook sampler (runner/kernels/codebook_sampling.py) against the general path it
replaced (CodecRange(RaceCodebooks(the triton Sampler)) on float32 logits), per codebook of a
CSM-shaped frame: 32 codebooks of 2051 codes (Mimi decodes 2048), bf16 logits, captured in one
CUDA graph as the frame step runs them, µs per codebook. Each case also checks that the fused
launches draw the very frames the general path draws (same seeds and counters); a launch
configuration that does not prints MISMATCH. Last, the host time of an eager call.

    python -m deploy.bench.codebook_sampler [--batches 1,64]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import torch

from deploy.bench.common import add_out_arg, log, run_header, write_results

V, K, LIMIT = 2051, 32, 2048
CASES = {  # name -> SamplingParams fields, every row alike
    "T0.9 top-k 50": dict(temperature=0.9, top_k=50),
    "T0.9": dict(temperature=0.9),
    "top-k 50 top-p 0.8": dict(temperature=0.9, top_k=50, top_p=0.8),
    "top-p 0.9": dict(temperature=1.0, top_p=0.9),
    "greedy": dict(temperature=0.0),
}
# (pivots per search round, warps; None: the kernel's choice, num_warps / max_registers); its default first
CONFIGS = ((4, None), (4, 16), (8, None))


def graph_batch(b: int, fields: dict, dev: torch.device):
    """b rows as a frame graph's batch holds them: every sampling stage on."""
    from runner.layers.sampling_batch import SamplingBatch
    from streaming.sampling_params import SamplingParams

    batch = SamplingBatch.build([SamplingParams(**fields)] * b, list(range(b)), list(range(7, 7 + b)), [3] * b, [], dev)
    return replace(batch, all_greedy=False, any_top_k=True, any_top_p=True, any_min_p=True, any_greedy=True)


def time_graph(frame) -> float:
    """µs per codebook of frame() (K codebooks), replayed from a CUDA graph (gemm's timing)."""
    from deploy.bench.gemm import _time_graph

    return _time_graph(lambda i: frame(), copies=1, launches=1) / K


def run(batches: list[int]) -> dict:
    from runner.kernels.codebook_sampling import codebook_sample
    from runner.layers.noise import NOISE_SALTS
    from runner.layers.sampler import Sampler
    from runner.models.csm_sampling import CodecRange, FusedCodebooks, RaceCodebooks

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for b in batches:
        xs = [(torch.randn(b, V, device=dev, generator=gen) * 2.5).to(torch.bfloat16) for _ in range(K)]
        audio = torch.ones(b, dtype=torch.bool, device=dev)
        frames = torch.empty(b, K, dtype=torch.int64, device=dev)
        for name, fields in CASES.items():
            batch = graph_batch(b, fields, dev)
            general = CodecRange(RaceCodebooks(Sampler(dev, backend="triton"), batch, K), LIMIT, audio, V)

            def run_general():
                for c in range(K):
                    frames[:, c] = general(xs[c].float(), c)

            row = {"batch": b, "case": name, "general_us": time_graph(run_general)}
            ref = frames.clone()
            for pivots, warps in CONFIGS:
                def run_fused(pivots=pivots, warps=warps):
                    for c in range(K):
                        codebook_sample(xs[c], batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seeds,
                                        batch.counters, K, c, NOISE_SALTS, rows=audio, limit=LIMIT, out=frames[:, c],
                                        np_pivots=pivots, warps=warps)

                key = f"fused np{pivots} w{warps}"
                row[f"{key} us"] = time_graph(run_fused)
                row[f"{key} mismatches"] = int((frames != ref).sum())
            rows_out.append(row)
            log(f"batch {b} {name}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                   for k, v in row.items() if k not in ("batch", "case")))
    # host time of an eager call (a step with prompt chunks past the largest graph bucket)
    b = 8
    batch = graph_batch(b, CASES["T0.9 top-k 50"], dev)
    xs = [(torch.randn(b, V, device=dev, generator=gen) * 2.5).to(torch.bfloat16) for _ in range(K)]
    audio = torch.ones(b, dtype=torch.bool, device=dev)
    host = {}
    samplers = {"fused": (FusedCodebooks(batch, K, LIMIT, audio), False),
                "general": (CodecRange(RaceCodebooks(Sampler(dev, backend="triton"), batch, K), LIMIT, audio, V), True)}
    for name, (sampler, cast) in samplers.items():
        def frame(sampler=sampler, cast=cast):
            for c in range(K):
                sampler(xs[c].float() if cast else xs[c], c)

        for _ in range(3):
            frame()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            frame()
        host[name] = 1e6 * (time.perf_counter() - t) / 20 / K
        torch.cuda.synchronize()
    log(f"eager host µs per codebook: fused {host['fused']:.1f}, general {host['general']:.1f}")
    return {"rows": rows_out, "eager_host_us": host}


def render(res: dict) -> str:
    rows = res["sampler"]["rows"]
    keys = [k for k in rows[0] if k not in ("batch", "case")]
    lines = [f"# Codebook sampler, {res['gpu']}, {res['date']}", "", "µs per codebook (32 in a CUDA graph); "
             "mismatches: codes that differ from the general path's", "",
             "| batch | case | " + " | ".join(keys) + " |", "| ---: | --- |" + " ---: |" * len(keys)]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['case']} | " + " | ".join(
            f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    h = res["sampler"]["eager_host_us"]
    lines += ["", f"Eager host µs per codebook: fused {h['fused']:.1f}, general {h['general']:.1f}."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64")
    add_out_arg(ap, "codebook_sampler")
    args = ap.parse_args()
    res = run_header()
    res["sampler"] = run([int(x) for x in args.batches.split(",")])
    write_results(args.out, res, render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
