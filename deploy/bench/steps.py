"""Timed decode steps of the Orpheus-3B-shaped engine: the loop behind the engine, decode,
eager, profile, variants and hidden sections."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from deploy.bench.common import (
    PROMPT,
    all_decoding,
    build_orpheus_model,
    engine_config,
    log,
)


def run_engine(model, batches, graphs: bool, async_sched: bool, sampling, timeline_at: int | None = None,
               out_dir: Path | None = None) -> dict:
    """Per batch size B: B requests of PROMPT random tokens decoding together on `model`; the
    median wall time of the pure-decode steps with all B running (after 20 steps), tokens/s,
    live KV bytes, and the GPU busy time and idle gaps between steps (CUDA events). At
    `timeline_at` also a kernel profile and critical path, written into `out_dir`."""
    from runner.engine.engine import Engine
    from runner.layers.attention import kv_bytes_per_token

    out = {}
    for B in batches:
        cfg = engine_config(max(B, 1), graphs, async_sched)
        eng = Engine(cfg, model=model)
        g = torch.Generator().manual_seed(B)
        for i in range(B):
            prompt = torch.randint(0, 128000, (PROMPT,), generator=g).tolist()
            eng.add_request(f"b{B}-{i}", prompt, sampling)
        times, kv_live = [], []
        record = torch.cuda.is_available()  # GPU busy time and idle gaps at every batch size
        step = 0
        while eng.has_unfinished:
            decoding = all_decoding(eng)
            if record and decoding and step > 20:
                eng.runner.record_timeline = True
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            step += 1
            if decoding and step > 20 and len(eng.scheduler.running) == B:
                times.append(dt)
                kv_live.append(sum(r.num_computed_tokens for r in eng.scheduler.running))
        torch.cuda.synchronize()
        gap = None
        if record and eng.runner.timeline:
            tl = eng.runner.timeline
            gaps = [tl[i][1].elapsed_time(tl[i + 1][0]) * 1e3 for i in range(len(tl) - 1)]  # us
            busy = [s.elapsed_time(e) for s, e in tl]
            gap = {"median_us": statistics.median(gaps), "p90_us": sorted(gaps)[int(0.9 * len(gaps))],
                   "gpu_step_ms": statistics.median(busy)}
        step_ms = statistics.median(times) * 1e3 if times else float("nan")
        kv_per_token = kv_bytes_per_token(cfg.model, torch.bfloat16)
        out[B] = {
            "step_ms": step_ms,
            "tok_s": B / (step_ms / 1e3),
            "live_kv_bytes": statistics.mean(kv_live) * kv_per_token if kv_live else 0,
            "gap": gap,
            "steps_timed": len(times),
        }
        log(f"  engine graphs={graphs} async={async_sched} B={B}: {step_ms:.2f} ms/step" + (f" gap {gap}" if gap else ""))
        if timeline_at == B:
            from deploy.bench.critical_path import profile_steps

            prof_path = Path(out_dir or ".") / f"profile_graphs{int(graphs)}_B{B}.txt"
            prof_path.parent.mkdir(parents=True, exist_ok=True)
            out[B]["critical_path"] = profile_steps(eng, prof_path, sampling=sampling)
        del eng
        torch.cuda.empty_cache()
    return out


def run_hidden_steps(batch: int = 64, new: int = 120) -> dict:
    """Decode step time at `batch` greedy rows (100-token prompts) when one of them streams its
    last hidden state (hidden_state_layers=(-1,)): with the plain graphs only (such steps run
    eagerly) and with RunnerConfig.hidden_state_graphs (an all-layers graph), next to the same
    batch without a hidden-state request. Median ms over the pure-decode steps."""
    from runner.engine.engine import Engine
    from streaming.sampling_params import SamplingParams

    model = build_orpheus_model()
    greedy = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    out, build_s = {}, {}
    for label, hidden, graphs in (("no hidden-state request", False, False),
                                  ("hidden states, eager steps", True, False),
                                  ("hidden states, all-layers graphs", True, True)):
        cfg = engine_config(batch, True, True)
        t_build = time.perf_counter()
        eng = Engine(cfg.with_(runner=replace(cfg.runner, hidden_state_graphs=graphs)), model=model)
        build_s[label] = time.perf_counter() - t_build
        g = torch.Generator().manual_seed(batch)
        for i in range(batch):
            eng.add_request(f"h{i}", torch.randint(0, 128000, (PROMPT,), generator=g).tolist(), greedy,
                            hidden_state_layers=(-1,) if hidden and i == 0 else ())
        times = []
        while eng.has_unfinished:
            decoding = all_decoding(eng)
            t0 = time.perf_counter()
            eng.step()
            if decoding and len(eng.scheduler.running) == batch:
                times.append(1e3 * (time.perf_counter() - t0))
        out[label] = statistics.median(times)
        log(f"  B={batch} {label}: {out[label]:.2f} ms/step (engine build, graph capture included: "
            f"{build_s[label]:.1f} s)")
        del eng
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    return {"step_ms": out, "engine_build_s": build_s}
