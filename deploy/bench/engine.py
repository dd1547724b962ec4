"""Engine decode step on an Orpheus-3B-shaped Llama with random weights (hidden 3072, 28 layers,
24/8 heads, intermediate 8192, vocab 156940, bf16). Sections (pick with --sections):

  bandwidth  device-to-device copy bandwidth (bytes read + written), the bound's denominator
  engine     decode step time at each --batches size (100-token prompts, 500 new tokens), CUDA
             graphs + async scheduling, next to the bandwidth bound (weight bytes + live KV
             bytes) / bandwidth; GPU idle gap between steps; Orpheus sampling at batch 1/64/256
  decode     the engine section's greedy decode only (no sampling figures): quick A/B runs
  eager      the same engine without CUDA graphs and without async scheduling (reference)
  hf         transformers generate, static cache + torch.compile, same shapes
  profile    with engine / eager: kernel profiles and critical paths (batch 64 sampled, batch 1
             eager); --profile-batches B,... adds greedy graph-mode ones
  variants   greedy decode per kernel variant (--variants), each on a fresh model, same run
             (deploy/bench/variants.py)
  hidden     decode step at batch 64 with one request streaming hidden states: eager steps
             against RunnerConfig.hidden_state_graphs, next to no such request
  first_use  in-process serving engine after warm_up: requests that meet a shape for the first
             time against the same again (deploy/bench/first_use.py)

--skinny-linear 0 / --pdl 0 / ... turn decode kernels off for an A/B run; --tuning none builds
every model on the generic tables (RunnerConfig.tuning: cuBLAS GEMMs, default attention and
sampling launches) for the tuned-vs-untuned table; --tuned FILE replaces the tables' GEMM tile
rows with a sweep's gemm_tuned.json (python -m deploy.bench.tune).

    python -m deploy.bench.engine --sections bandwidth,engine,hf --batches 1,8,16,32,48,64,128,256 \\
        --hf-batches 32,64 --hf-budget-s 60
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from deploy.bench.common import (
    BATCHES,
    KERNELS,
    NEW,
    ORPHEUS_3B,
    PROMPT,
    TUNED_ROWS,
    add_kernel_args,
    add_out_arg,
    apply_kernel_args,
    bench_bandwidth,
    bench_tables,
    build_orpheus_model,
    log,
    orpheus_sampling,
    run_header,
    weight_bytes,
    write_results,
)
from deploy.bench.steps import run_engine, run_hidden_steps


def run_hf(batches, budget_s: float) -> dict:
    """transformers generate with a static cache and torch.compile, same shapes, greedy: median ms
    per step after 10 steps, per batch size in the given order until `budget_s` is spent."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        StoppingCriteria,
        StoppingCriteriaList,
    )

    cfg = LlamaConfig(
        vocab_size=ORPHEUS_3B["vocab_size"], hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        max_position_embeddings=2048, rope_theta=500000.0, tie_word_embeddings=False,
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()

    class Stamp(StoppingCriteria):
        def __init__(self, stop_after=None):
            self.t, self.stop_after = [], stop_after

        def __call__(self, input_ids, scores, **kw):
            self.t.append(time.perf_counter())  # generate syncs every step on its own finished check
            done = self.stop_after is not None and len(self.t) >= self.stop_after
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    out = {}
    t_start = time.perf_counter()
    for B in batches:
        if time.perf_counter() - t_start > budget_s:
            log(f"  hf: time budget spent, skipping B={B}")
            break
        ids = torch.randint(0, 128000, (B, PROMPT), device="cuda")
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                  cache_implementation="static", pad_token_id=0, eos_token_id=None)
        with torch.inference_mode():
            model.generate(ids, stopping_criteria=StoppingCriteriaList([Stamp(stop_after=12)]), **kw)  # compile + warm
            st = Stamp()
            model.generate(ids, stopping_criteria=StoppingCriteriaList([st]), **kw)
        d = [b - a for a, b in zip(st.t, st.t[1:])][10:]
        out[B] = {"step_ms": statistics.median(d) * 1e3}
        log(f"  hf static+compile B={B}: {out[B]['step_ms']:.2f} ms/step")
    del model
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="bandwidth,engine,eager,hf")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--hf-budget-s", type=float, default=240)
    ap.add_argument("--hf-batches", default="32,1,64,8,128,256", help="in this order until the budget is spent")
    ap.add_argument("--variants", default="default;rope_in_attention=0",
                    help="variants section: ';'-separated kernel overrides, each timed on its own model")
    ap.add_argument("--profile-batches", default="", help="greedy graph-mode kernel profiles at these batch sizes")
    ap.add_argument("--tuned", default=None, help="gemm_tuned.json of a deploy.bench.tune run: use its tile table")
    ap.add_argument("--prefill-warm-up", type=int, default=1,
                    help="0: Engine.warm_up skips warm_up_eager_prefill (A/B of the first_use section; run each in its own process)")
    add_kernel_args(ap)
    add_out_arg(ap, "engine")
    args = ap.parse_args()
    secs = set(args.sections.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    out = Path(args.out)
    apply_kernel_args(args)
    if not args.prefill_warm_up:
        from runner.engine.engine import Engine

        Engine.warm_up_eager_prefill = lambda self: None  # the A/B baseline: warm-up without eager prefills
    if args.tuned:
        from deploy.bench.gemm import load_tuned

        TUNED_ROWS.update(load_tuned(args.tuned))
    res = run_header() | {"kernels": dict(KERNELS, tuned=args.tuned), "prefill_warm_up": bool(args.prefill_warm_up),
                          "tables": bench_tables().name}
    t0 = time.perf_counter()
    from streaming.sampling_params import SamplingParams

    if "bandwidth" in secs:
        res["bandwidth_Bps"] = bench_bandwidth()
        log(f"copy bandwidth: {res['bandwidth_Bps']/1e12:.2f} TB/s")
    if "variants" in secs:
        from deploy.bench.variants import run_decode_variants

        res["variants"] = run_decode_variants(args.variants, batches)
    if secs & {"engine", "eager", "decode"}:
        model = build_orpheus_model()
        res["weight_bytes"] = weight_bytes(model)
        greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        if secs & {"engine", "decode"}:
            res["engine"] = run_engine(model, batches, graphs=True, async_sched=True, sampling=greedy)
        if "engine" in secs:
            res["engine_orpheus_sampling"] = run_engine(model, [b for b in batches if b in (1, 64, 256)], True, True,
                                                        orpheus_sampling(NEW),
                                                        timeline_at=64 if "profile" in secs else None, out_dir=out)
        for B in (int(b) for b in args.profile_batches.split(",") if b):
            res.setdefault("critical_path", {})[B] = run_engine(model, [B], True, True, greedy, timeline_at=B,
                                                                 out_dir=out)[B]["critical_path"]
        if "eager" in secs:
            res["eager"] = run_engine(model, [b for b in batches if b in (1, 64)], graphs=False, async_sched=False,
                                      sampling=greedy, timeline_at=1 if "profile" in secs else None, out_dir=out)
        del model
        torch.cuda.empty_cache()
    if "hf" in secs:
        res["hf"] = run_hf([int(b) for b in args.hf_batches.split(",")], args.hf_budget_s)
    if "first_use" in secs:
        from deploy.bench.first_use import run_first_use

        res["first_use"] = run_first_use()
    if "hidden" in secs:
        res["hidden"] = run_hidden_steps()
    res["wall_s"] = time.perf_counter() - t0
    write_results(out, res, render(res))
    return 0


def render(res: dict) -> str:
    lines = [f"date {res['date']}, GPU {res['gpu']}, torch {res['torch']}, command `{res['command']}`", ""]
    bw = res.get("bandwidth_Bps")
    if "engine" in res:
        lines += ["| batch | omnistream ms/step | bound ms/step | x bound | eager ms/step | HF static+compile ms/step | speed-up vs HF | tok/s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for B, r in res["engine"].items():
            bound = (res["weight_bytes"] + r["live_kv_bytes"]) / bw * 1e3 if bw else float("nan")
            hf = res.get("hf", {}).get(B, {}).get("step_ms", float("nan"))
            ea = res.get("eager", {}).get(B, {}).get("step_ms", float("nan"))
            lines.append(f"| {B} | {r['step_ms']:.2f} | {bound:.2f} | {r['step_ms']/bound:.2f} | {ea:.2f} | {hf:.2f} | {hf/r['step_ms']:.2f} | {r['tok_s']:.0f} |")
        lines += ["", "GPU time per decode step and idle gap between consecutive steps (CUDA events):", "",
                  "| batch | GPU busy ms/step | idle gap median us | idle gap p90 us |", "| --- | --- | --- | --- |"]
        for B, r in res["engine"].items():
            g = r.get("gap")
            if g:
                lines.append(f"| {B} | {g['gpu_step_ms']:.2f} | {g['median_us']:.0f} | {g['p90_us']:.0f} |")
    if "variants" in res:
        from deploy.bench.variants import render_variants

        lines += render_variants(res["variants"], ORPHEUS_3B["num_hidden_layers"])
    if "engine_orpheus_sampling" in res:
        lines += ["", "Orpheus sampling (temperature 0.6, top-p 0.8, repetition penalty 1.1): " + ", ".join(
            f"B={B}: {r['step_ms']:.2f} ms/step" for B, r in res["engine_orpheus_sampling"].items())]
    if "hidden" in res:
        lines += ["", "Decode step, batch 64, one request streaming hidden states: "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in res["hidden"]["step_ms"].items())
                  + "; engine build, graph capture included: "
                  + ", ".join(f"{k} {v:.1f} s" for k, v in res["hidden"]["engine_build_s"].items())]
    if bw:
        lines += ["", f"copy bandwidth {bw/1e12:.2f} TB/s; weights {res.get('weight_bytes', 0)/1e9:.2f} GB"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
