"""Kernel-level profiles of decode steps and each kernel's share of the step's critical path
(the engine section's `profile` and `--profile-batches`)."""

from __future__ import annotations

from pathlib import Path

import torch

from deploy.bench.common import PROMPT, orpheus_sampling


def profile_steps(eng, path: Path, steps: int = 8, sampling=None) -> dict:
    """Kernel-level GPU time of a few decode steps (same shapes as the timed ones), and each
    kernel's share of the step's critical path (`critical_path`, written next to `path` as
    *_critical.md). `sampling` defaults to the Orpheus settings."""
    import msgspec
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(1)
    B = eng.cfg.scheduler.max_num_seqs
    sp = orpheus_sampling(steps + 40) if sampling is None else msgspec.structs.replace(sampling, max_tokens=steps + 40)
    for i in range(B):
        eng.add_request(f"prof-{i}", torch.randint(0, 128000, (PROMPT,), generator=g).tolist(), sp)
    for _ in range(30):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    chain = critical_path(prof, steps)
    path.with_name(path.stem + "_critical.md").write_text(render_critical_path(chain, B))
    while eng.has_unfinished:
        eng.step()
    return chain


def critical_path(prof, steps: int) -> dict:
    """Each GPU activity's share of the profiled span: activities sorted by end time, each
    charged end - the latest earlier end (the time by which it pushed the frontier; 0 if it
    ended inside an earlier one's span). With PDL a kernel starts before its predecessor ends and waits, so
    its own duration overstates it; this share does not. The shares sum to the span. Kernels
    that repeat within a layer are told apart by their ordinal since the last attention kernel
    (e.g. _skinny_linear_kernel#1 = o_proj, #2 = gate_up, #3 = down at batch 1)."""
    from torch.autograd import DeviceType

    evs = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == DeviceType.CUDA), key=lambda t: t[0])
    seen: dict[str, int] = {}
    labelled = []
    for start, end, name in evs:
        short = name.split("(")[0].split("<")[0].strip()[:48]
        if "_paged_decode_kernel" in short:
            seen.clear()
        seen[short] = seen.get(short, 0) + 1
        labelled.append((start, end, f"{short}#{seen[short]}"))
    rows: dict[str, list[float]] = {}
    first = frontier = labelled[0][0] if labelled else 0.0
    for start, end, label in sorted(labelled, key=lambda t: t[1]):
        share = max(0.0, end - frontier)
        frontier = max(frontier, end)
        r = rows.setdefault(label, [0, 0.0, 0.0])
        r[0] += 1
        r[1] += share
        r[2] += end - start
    span = frontier - first
    return {"span_us_per_step": span / steps, "steps": steps,
            "kernels": {k: {"calls_per_step": n / steps, "us_per_step": sh / steps, "share_us": sh / n,
                            "duration_us": d / n} for k, (n, sh, d) in rows.items()}}


def render_critical_path(chain: dict, batch: int) -> str:
    lines = [f"Critical path per decode step, batch {batch}: {chain['span_us_per_step']:.1f} us per step "
             f"(profiled span / {chain['steps']} steps; shares sum to it)", "",
             "| kernel (#: ordinal since the attention kernel) | calls / step | us / step | share us / call | duration us / call |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for k, r in sorted(chain["kernels"].items(), key=lambda kv: -kv[1]["us_per_step"]):
        lines.append(f"| {k} | {r['calls_per_step']:.1f} | {r['us_per_step']:.1f} | {r['share_us']:.2f} | "
                     f"{r['duration_us']:.2f} |")
    return "\n".join(lines) + "\n"
