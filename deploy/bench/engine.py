"""GPU benchmark: everything side by side in one run, on an Orpheus-3B-shaped Llama with random
weights (hidden 3072, 28 layers, 24/8 heads, intermediate 8192, vocab 156940, bf16).

Sections (all by default; pick with --sections):
  bandwidth  device-to-device copy bandwidth (bytes read + written), the bound's denominator
  engine     omnistream decode step time at batch 1..256 (100-token prompts, 500 new tokens),
             CUDA graphs + async scheduling, next to the bandwidth bound
             (weight bytes + live KV bytes) / bandwidth; GPU idle gap between steps at batch 64
  decode     the engine section's greedy decode only (no sampling figures): quick A/B runs
  eager      the same engine without CUDA graphs and without async scheduling (reference)
  hf         transformers generate, static cache + torch.compile, same shapes
  codec      batched SNAC 24 kHz (random weights) window decode cost, and its share of GPU
             time at 256 real-time streams under the default window policy
  ttfa       in-process engine (same model folder as serving, no server): time from add_request
             to the first PCM of one audio request, and the host time per step phase; the
             floor under the serving TTFA (which adds the front end and two IPC hops)
  first_use  in-process serving engine after warm_up: requests that meet a shape for the first
             time (eager prefills alone and joining decodes, hidden states) against the same again
  hidden     decode step at batch 64 with one request streaming hidden states: eager steps
             against RunnerConfig.hidden_state_graphs, next to no such request
  boundary   what one dependency between two phases costs: a kernel boundary (launch chain in
             a CUDA graph, with and without PDL) against a grid barrier in one persistent
             kernel (deploy/boundary_probe.py)
  serving    the real server (engine process + aiohttp) with N concurrent WebSocket TTS
             clients reading in real time: TTFA p50/p99, RTF, largest real-time N
  gemm       tile sweep of the skinny decode GEMMs against cuBLAS (deploy/bench_gemm.py);
             writes gemm_tuned.json, the table runner/kernels/linear.py's TUNED holds
  splitk     split-K variants of o_proj / down at M = 16..64 against cuBLAS (bench_gemm.py)
  attn       the decode attention kernel alone: tile / split sweep at batch 1 and 64, context
             135 / 350 / 600, and the fused-RoPE launch
  attn_modes the decode attention kernel alone at 350 tokens, batch 1-128, as the engine
             launches it: block table per tile against read in chunks, pipeline depths
  variants   greedy decode per kernel variant (--variants), each on a fresh model, same run
  lm_head    the lm_head GEMM alone at M = 1 and 64: cuBLAS against Triton tiles

--skinny-linear 0 / --pdl 0 turn the decode kernels of runner/kernels/linear.py and
runner/kernels/pdl.py off for an A/B run of the engine sections; --tuned FILE replaces the
tile table with a sweep's gemm_tuned.json.

Writes results.json and results.md into --out and prints the table last.
Run on the lent H200 (see deploy/RESULTS.md for the exact command).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runner.codecs.snac import write_random_snac  # noqa: E402
from runner.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RopeConfig,
    RunnerConfig,
    SchedulerConfig,
)

ORPHEUS_3B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 156940,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 128258,
}
BATCHES = [1, 8, 32, 64, 128, 256]
# RunnerConfig kernel options of every engine this run builds (--skinny-linear, --pdl, ...)
KERNELS = {"skinny_linear": True, "pdl": True, "rope_in_attention": True, "attention_prefetch": True, "split_k": True,
           "norm_fold": True, "qkv_rope": True}
PROMPT, NEW = 100, 500


def log(*a):
    print(*a, flush=True)


def bench_bandwidth() -> float:
    n = 2 * 2**30  # 2 GiB per buffer: far above L2
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times)


def engine_config(max_seqs: int, graphs: bool, async_sched: bool) -> EngineConfig:
    m = ModelConfig.from_dict(ORPHEUS_3B, "orpheus-3b-random")
    return EngineConfig(
        model=m,
        cache=CacheConfig(block_size=16, num_blocks=max_seqs * ((PROMPT + NEW) // 16 + 2) + 64),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=8192, max_model_len=2048,
                                  async_scheduling=async_sched),
        runner=RunnerConfig(device="cuda", dtype="bfloat16", cuda_graphs=graphs, max_graph_batch_size=max_seqs,
                            **KERNELS),
    )


def build_orpheus_model():
    """The random Orpheus-3B-shaped model (bf16) with the current KERNELS options."""
    from runner.models.llama import build_random_model
    from runner.models.loader import kernels_for

    cfg = engine_config(1, True, True)
    attn, ops = kernels_for(cfg.runner)
    return build_random_model(cfg.model, "cuda", torch.bfloat16, attn=attn, ops=ops)


def weight_bytes(model) -> int:
    # bytes a decode step must read: every parameter once (the embedding only for B rows, ~0)
    tot = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    return tot


def all_decoding(eng) -> bool:
    """Whether the next step is pure decode: nothing waiting and every prompt computed
    (Request.is_prefill would also flag a sync-mode request whose newest token is known but not
    yet computed, so the eager run would time no step)."""
    return not eng.scheduler.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens for r in eng.scheduler.running)


def run_engine(model, batches, graphs: bool, async_sched: bool, sampling, timeline_at: int | None = None):
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
        out[B] = {
            "step_ms": step_ms,
            "tok_s": B / (step_ms / 1e3),
            "live_kv_bytes": statistics.mean(kv_live) * kv_bytes_per_token(model.cfg if hasattr(model, "cfg") else cfg.model, torch.bfloat16) if kv_live else 0,
            "gap": gap,
            "steps_timed": len(times),
        }
        log(f"  engine graphs={graphs} async={async_sched} B={B}: {step_ms:.2f} ms/step" + (f" gap {gap}" if gap else ""))
        if timeline_at == B:
            prof_path = Path(os.environ.get("OUT", "/tmp")) / f"profile_graphs{int(graphs)}_B{B}.txt"
            out[B]["critical_path"] = profile_steps(eng, prof_path, sampling=sampling)
        del eng
        torch.cuda.empty_cache()
    return out


def profile_steps(eng, path: Path, steps: int = 8, sampling=None) -> dict:
    """Kernel-level GPU time of a few decode steps (same shapes as the timed ones), and each
    kernel's share of the step's critical path (`critical_path`, written next to `path` as
    *_critical.md). `sampling` defaults to the Orpheus settings."""
    import msgspec
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(1)
    B = eng.cfg.scheduler.max_num_seqs
    sp = eng_sampling(steps + 40) if sampling is None else msgspec.structs.replace(sampling, max_tokens=steps + 40)
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


def parse_tile(fields: list[int]) -> "LinearTile":
    """bm, bn, bk, warps, stages[, late_trigger 0/1[, groups[, tma 0/1]]] -> LinearTile (late_trigger
    and tma as the bools they are; groups: ragged column groups, 0 = plain tiles)."""
    from runner.kernels.linear import LinearTile

    late = bool(fields[5]) if len(fields) > 5 else False
    groups = fields[6] if len(fields) > 6 else 0
    return LinearTile(*fields[:5], late, groups, bool(fields[7]) if len(fields) > 7 else False)


def parse_tile_override(item: str) -> tuple[tuple[int, int, int], int, "LinearTile | None"]:
    """'tile:KIND:N:K:MAX_M=bm/bn/bk/warps/stages[/late[/groups[/tma]]]' (or '=none': cuBLAS) -> the TUNED key,
    the row's max_m and its tile; KIND is plain or gated."""
    from runner.kernels.linear import GATED, PLAIN

    lhs, rhs = item.removeprefix("tile:").split("=")
    kind, n, k, max_m = lhs.split(":")
    tile = None if rhs == "none" else parse_tile([int(f) for f in rhs.split("/")])
    return ({"plain": PLAIN, "gated": GATED}[kind], int(n), int(k)), int(max_m), tile


SKIPPABLE = ("norm", "norm_in", "norm_post", "attn", "qkv", "o", "gate_up", "down")


def skip_op(model, name: str) -> None:
    """Timing-only: make one per-layer op of `model` launch nothing (a same-shaped empty tensor
    instead of its result), so that step time minus this variant's step time is what that op
    costs on the step's critical path, PDL overlap included. Tokens become meaningless; shapes,
    the graphs and every other kernel stay as they are. `name` is one of SKIPPABLE."""
    ops, attn, cfg = model.ops, model.attn, model.cfg
    if name in ("norm", "norm_post", "o", "gate_up"):
        # the folded o_proj + norm + gate_up launches none of the ops patched below: time the
        # unfolded path (a `norm_fold=1` step has no post-attention norm launch to skip; the
        # bench's model always has TritonOps)
        ops.norm_fold = False
    if name in ("attn", "qkv"):
        # likewise the qkv GEMM with RoPE and the KV write (ops.qkv_rope_write): time the
        # separate qkv GEMM and attention launches it replaces
        ops.qkv_rope = False
    weight_shapes = {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size),
                     "o": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
                     "down": (cfg.hidden_size, cfg.intermediate_size)}  # nn.Linear [N, K]
    if name == "norm":
        def add_rmsnorm(x, residual, weight, eps):
            return residual, residual
        ops.add_rmsnorm = add_rmsnorm
    elif name in ("norm_in", "norm_post"):  # one of the layer's two norms (the final norm stays)
        which = "input_layernorm" if name == "norm_in" else "post_attention_layernorm"
        skipped = {getattr(layer, which).weight.data_ptr() for layer in model.layers}
        add_rmsnorm_all = ops.add_rmsnorm

        def add_rmsnorm(x, residual, weight, eps):
            if weight.data_ptr() in skipped:
                return residual, residual
            return add_rmsnorm_all(x, residual, weight, eps)
        ops.add_rmsnorm = add_rmsnorm
    elif name == "attn":
        def no_attention(q, *a, **k):
            return torch.empty(q.shape, dtype=q.dtype, device=q.device)
        attn.forward_decode_rope = attn.forward_prewritten_kv = no_attention
    elif name in ("qkv", "o", "down"):
        linear = ops.linear

        def skipped_linear(x, lin, into_norm=False, _shape=weight_shapes[name]):
            if tuple(lin.weight.shape) == _shape:
                return torch.empty(x.shape[0], _shape[0], dtype=x.dtype, device=x.device)
            return linear(x, lin, into_norm)
        ops.linear = skipped_linear
    elif name == "gate_up":
        def mlp(x, gate_up, down, into_norm=False):
            act = torch.empty(x.shape[0], cfg.intermediate_size, dtype=x.dtype, device=x.device)
            return ops.linear(act, down, into_norm)
        ops.mlp = mlp
    else:
        raise ValueError(f"skip={name}: one of {SKIPPABLE}")


def parse_split_override(item: str) -> tuple[tuple[int, int], tuple]:
    """'split:N:K=MAX_M:bm/bn/bk/warps/stages[/late[/groups[/tma]]]/splits+MAX_M:none+...' -> the SPLIT_TUNED key
    and its rows (all of them, in increasing MAX_M; 'none': not split up to that M)."""
    lhs, rhs = item.removeprefix("split:").split("=")
    n, k = map(int, lhs.split(":"))
    rows = []
    for cell in rhs.split("+"):
        max_m, spec = cell.split(":")
        if spec == "none":
            rows.append((int(max_m), None, 1))
        else:
            *t, splits = map(int, spec.split("/"))
            rows.append((int(max_m), parse_tile(t), splits))
    return (n, k), tuple(rows)


def run_decode_variants(variants: str, batches, swept: list | None = None) -> dict:
    """Greedy decode step time per kernel variant, each on a freshly built model (one run, same
    GPU state): `variants` = ';'-separated variants, each ','-separated RunnerConfig kernel
    overrides and tile-table rows, e.g. "default;rope_in_attention=0;tile:plain:3072:3072:1=1/8/1024/4/1";
    `split:N:K=...` replaces a SPLIT_TUNED entry (parse_split_override); `fold:N:K:MAX_M=bm/bn/bk/warps/stages[/late]`
    (or `=none`) replaces that row of FOLD_TUNED; `head:V:K:MAX_M=...` (or `=none`) that row of
    runner/kernels/head_argmax.py's HEAD_TUNED;
    `swept` takes TUNED from this run's gemm sweep (`swept`, its "tuned" rows); `skip=OP`
    times the step without one per-layer op (skip_op: its critical-path cost); `attn:NAME=INT`
    sets a constant of runner/kernels/attention.py (PREFETCH_MIN_SPLITS, TABLE_CHUNK,
    SHORT_WAVE_PROGRAMS_PER_SM, SHORT_WAVE_STAGES, NUM_STAGES, DEFAULT_BLOCK_N, SPLIT_BLOCK_N,
    _NUM_WARPS); `attn_splits=N`
    fixes the decode attention's split count at every batch size; `fp32_greedy` takes greedy ids
    as argmax over the fp32 logits copy (the path before greedy_ids, s12 and earlier);
    `torch_argmax` takes them with torch.argmax instead of runner/kernels/argmax.py (at row counts
    where HEAD_TUNED leaves the head unfused)."""
    from bench_gemm import load_tuned_rows
    from triton.runtime.errors import OutOfResources

    from runner.kernels import attention as triton_attention
    from runner.kernels import head_argmax as triton_head_argmax
    from runner.kernels import linear as triton_linear
    from streaming.sampling_params import SamplingParams

    base = dict(KERNELS)
    base_tuned = dict(triton_linear.TUNED)
    base_split = dict(triton_linear.SPLIT_TUNED)
    base_fold = dict(triton_linear.FOLD_TUNED)
    base_head = dict(triton_head_argmax.HEAD_TUNED)
    base_attn = {name: getattr(triton_attention, name) for name in
                 ("PREFETCH_MIN_SPLITS", "TABLE_CHUNK", "SHORT_WAVE_PROGRAMS_PER_SM", "SHORT_WAVE_STAGES",
                  "NUM_STAGES", "DEFAULT_BLOCK_N", "SPLIT_BLOCK_N", "_NUM_WARPS")}

    def reset() -> None:  # every variant starts from the run's options, and the run ends there
        for name, value in base_attn.items():
            setattr(triton_attention, name, value)
        KERNELS.clear()
        KERNELS.update(base)
        triton_linear.TUNED.clear()
        triton_linear.TUNED.update(base_tuned)
        triton_linear.SPLIT_TUNED.clear()
        triton_linear.SPLIT_TUNED.update(base_split)
        triton_linear.FOLD_TUNED.clear()
        triton_linear.FOLD_TUNED.update(base_fold)
        triton_head_argmax.HEAD_TUNED.clear()
        triton_head_argmax.HEAD_TUNED.update(base_head)

    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    out = {}
    try:
        for spec in variants.split(";"):
            reset()
            skips, attn_splits, fp32_greedy, torch_argmax = [], None, False, False
            for kv in filter(None, (x.strip() for x in spec.split(","))):
                if kv == "fp32_greedy":
                    fp32_greedy = True
                elif kv == "torch_argmax":
                    torch_argmax = True
                elif kv.startswith("tile:"):
                    key, max_m, tile = parse_tile_override(kv)
                    triton_linear.TUNED[key] = tuple((mm, tile if mm == max_m else t) for mm, t in triton_linear.TUNED[key])
                elif kv.startswith("fold:"):
                    (_, n, k), max_m, tile = parse_tile_override("tile:plain:" + kv.removeprefix("fold:"))
                    rows = triton_linear.FOLD_TUNED[(n, k)]
                    triton_linear.FOLD_TUNED[(n, k)] = tuple((mm, tile if mm == max_m else t) for mm, t in rows)
                elif kv.startswith("head:"):
                    (_, n, k), max_m, tile = parse_tile_override("tile:plain:" + kv.removeprefix("head:"))
                    rows = triton_head_argmax.HEAD_TUNED[(n, k)]
                    triton_head_argmax.HEAD_TUNED[(n, k)] = tuple((mm, tile if mm == max_m else t) for mm, t in rows)
                elif kv.startswith("split:"):
                    key, rows = parse_split_override(kv)
                    triton_linear.SPLIT_TUNED[key] = rows
                elif kv == "swept":
                    if swept is None:
                        raise ValueError("variant 'swept' needs the gemm section in the same run")
                    triton_linear.TUNED.clear()
                    triton_linear.TUNED.update(load_tuned_rows(swept))
                elif kv.startswith("skip="):
                    skips.append(kv.removeprefix("skip="))
                elif kv.startswith("attn:"):
                    name, value = kv.removeprefix("attn:").split("=")
                    if name not in base_attn:
                        raise ValueError(f"attn:{name}: not one of {sorted(base_attn)}")
                    setattr(triton_attention, name, int(value))
                elif kv.startswith("attn_splits="):
                    attn_splits = int(kv.removeprefix("attn_splits="))
                elif kv != "default":
                    k, v = kv.split("=")
                    KERNELS[k] = bool(int(v))
            model = build_orpheus_model()
            for name in skips:
                skip_op(model, name)
            if attn_splits is not None:
                model.attn.num_splits = attn_splits  # the one backend every layer shares
            if fp32_greedy:
                model.greedy_ids = lambda h, m=model: m.compute_logits(h).argmax(dim=-1)
            if torch_argmax:  # greedy ids by torch's reduction (before runner/kernels/argmax.py, s14 and earlier)
                model.ops.argmax = lambda x: x.argmax(dim=-1)
            try:
                res = run_engine(model, batches, graphs=True, async_sched=True, sampling=greedy)
            except OutOfResources as e:  # a tile that does not fit is this variant's result, not the run's end
                log(f"  variant {spec}: {e}")
                del model
                torch.cuda.empty_cache()
                continue
            key = spec if spec not in out else f"{spec} #{sum(k.split(' #')[0] == spec for k in out) + 1}"
            out[key] = {B: r["step_ms"] for B, r in res.items()}
            log(f"  variant {key}: " + ", ".join(f"B={B} {v:.3f} ms" for B, v in out[key].items()))
            del model
            torch.cuda.empty_cache()
    finally:
        reset()
    return out


ATTN_TILES = [(64, 4, 3), (32, 4, 3), (32, 4, 4), (16, 4, 4), (64, 4, 2), (64, 8, 3), (128, 4, 2), (128, 8, 3)]


def _attn_case(B: int, ctx: int, layers: int, table_width: int, seed: int):
    """The attention benchmarks' inputs, Orpheus heads (24/8, D 128, bf16, block 16): one random
    cache per layer ([2, blocks, 16, 8, 128], so KV comes from HBM as in a step), block tables
    scrambled per layer and as wide as the engine's graphs, every sequence at `ctx` tokens, and
    q [B, 24, 128]. Returns (caches, tables, seq_lens, q)."""
    hq, hkv, d, bs = 24, 8, 128, 16
    nblk = -(-ctx // bs)
    g = torch.Generator().manual_seed(seed)
    caches, tables = [], []
    for _ in range(layers):
        caches.append(torch.randn(2, B * nblk + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16))
        t = torch.zeros(B, max(nblk, table_width), dtype=torch.int32)  # graph tables are full width
        t[:, :nblk] = (torch.randperm(B * nblk, generator=g) + 1).view(B, nblk)
        tables.append(t.cuda())
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16)
    return caches, tables, seq_lens, q


def run_attn_modes(batches=(1, 8, 32, 64, 128), ctx: int = 350, layers: int = 28, table_width: int = 128) -> dict:
    """The decode attention kernel alone, Orpheus heads at `ctx` tokens (as run_attn_sweep: one
    cache per layer, scrambled full-width tables, a graph of `layers` launches), launched as the
    engine launches it (PDL; the fused RoPE + KV write where the engine fuses it), us per launch:
    the automatic tiling (choose_tiling), the s16 kernel (block table read per tile, 3 stages),
    and the table read in chunks ahead of the tile loop with several tiles and stage counts."""
    from bench_gemm import _time_graph

    from runner.kernels.attention import (
        DecodeRope,
        TritonPagedAttention,
        paged_decode_attention,
    )
    from runner.kernels.gpu_info import num_sms
    from runner.kernels.pdl import pdl_available
    from runner.models.llama import RotaryEmbedding

    hkv, d, bs = 8, 128, 16  # _attn_case's shapes
    pdl = pdl_available("cuda")
    rot = RotaryEmbedding(d, 2048, RopeConfig(theta=ORPHEUS_3B["rope_theta"]))
    cos, sin = rot.cos.cuda(), rot.sin.cuda()
    chunk = {"table_chunk": 128}
    out = {}
    for B in batches:
        split_bn = 32 if B * hkv < num_sms("cuda") else 64
        modes = {"automatic": {}, "table per tile (s16)": {"table_chunk": 0, "block_n": split_bn, "num_stages": 3},
                 "chunked": dict(chunk, block_n=split_bn, num_stages=3), "chunked st4": dict(chunk, num_stages=4),
                 "chunked bn32 st4": dict(chunk, block_n=32, num_stages=4),
                 "chunked bn32 st5": dict(chunk, block_n=32, num_stages=5),
                 "chunked bn64 st4": dict(chunk, block_n=64, num_stages=4)}
        nblk = -(-ctx // bs)
        caches, tables, seq_lens, q = _attn_case(B, ctx, layers, table_width, seed=B)
        k, v = (torch.randn(B, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        slots = tables[0][:, nblk - 1].long() * bs + (ctx - 1) % bs
        fused = TritonPagedAttention().decode_rope_fused(B, hkv, q.device)
        rope = DecodeRope(k, v, cos, sin, seq_lens.long() - 1, slots) if fused else None
        kvbytes = B * ctx * hkv * d * 2 * 2
        res = {}
        for name, kw in modes.items():
            def fn(i, kw=kw, caches=caches, tables=tables, q=q, seq_lens=seq_lens, rope=rope):
                paged_decode_attention(q, caches[i], tables[i], seq_lens, d**-0.5, pdl=pdl, rope=rope, **kw)
            try:
                us = _time_graph(fn, layers, launches=layers)
            except Exception as e:  # noqa: BLE001 - a variant that does not fit is a result
                log(f"  attn modes B={B} {name}: {type(e).__name__}")
                continue
            res[name] = {"us": us, "TBps": kvbytes / us / 1e6}
        out[f"B{B}_ctx{ctx}"] = {"kv_bytes": kvbytes, "fused_rope": fused, "modes": res}
        log(f"  attn modes B={B} ctx={ctx}{' +rope' if fused else ''}: "
            + ", ".join(f"{kk} {vv['us']:.1f}" for kk, vv in res.items()))
        del caches
        torch.cuda.empty_cache()
    return out


def run_attn_sweep(batches=(1, 64), ctxs=(135, 350, 600), layers: int = 28, table_width: int = 128,
                   tiles=ATTN_TILES, all_splits: bool = True) -> dict:
    """Decode attention kernel alone (runner/kernels/attention.py), Orpheus heads (24/8, D 128,
    bf16, block 16), every sequence at `ctx` tokens with scrambled block tables, one cache per
    layer (a graph of `layers` launches, so KV comes from HBM as in a step), block tables as wide
    as the engine's graphs (max_model_len 2048 / block 16; the split count follows the width):
    us per launch and TB/s of live KV bytes, per (block_n, warps, stages, splits) variant, each
    also with the fused RoPE + KV write."""
    from bench_gemm import _time_graph

    from runner.kernels.attention import DecodeRope, paged_decode_attention
    from runner.models.llama import RotaryEmbedding

    hkv, d, bs = 8, 128, 16  # _attn_case's shapes
    rot = RotaryEmbedding(d, 2048, RopeConfig(theta=ORPHEUS_3B["rope_theta"]))
    cos, sin = rot.cos.cuda(), rot.sin.cuda()
    out = {}
    for B in batches:
        for ctx in ctxs:
            caches, tables, seq_lens, q = _attn_case(B, ctx, layers, table_width, seed=ctx)
            kvbytes = B * ctx * hkv * d * 2 * 2
            pos = seq_lens.long() - 1
            slots = tables[0][:, -1].long() * bs + (ctx - 1) % bs
            k = torch.randn(B, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            splits_opts = [None] if not all_splits else [None, 1, 2, 4, 8, 16] if B * hkv < 132 else [None, 2]
            res = {}
            for bn, w, st in tiles:
                for sp in splits_opts:
                    for fused in (False, True):
                        rope = DecodeRope(k, v, cos, sin, pos, slots) if fused else None

                        def fn(i, bn=bn, w=w, st=st, sp=sp, rope=rope):
                            paged_decode_attention(q, caches[i], tables[i], seq_lens, d**-0.5, block_n=bn or None,
                                                   num_warps=w, num_stages=st, num_splits=sp, rope=rope)
                        try:
                            us = _time_graph(fn, layers, launches=layers)
                        except Exception as e:  # noqa: BLE001 - a variant that does not fit is a result
                            log(f"  attn B={B} ctx={ctx} {bn},{w},{st} s{sp}: {type(e).__name__}")
                            continue
                        key = f"bn{bn} w{w} st{st} s{sp or 'auto'}" + (" +rope" if fused else "")
                        res[key] = {"us": us, "TBps": kvbytes / us / 1e6}
            best = min((kk for kk in res if "rope" not in kk), key=lambda kk: res[kk]["us"])
            best_r = min((kk for kk in res if "rope" in kk), key=lambda kk: res[kk]["us"])
            out[f"B{B}_ctx{ctx}"] = {"kv_bytes": kvbytes, "best": best, "best_rope": best_r, "variants": res}
            log(f"  attn B={B} ctx={ctx}: " + ", ".join(f"{kk} {vv['us']:.1f}" for kk, vv in res.items()
                                                      if kk.split(" +")[0] in (best, f"bn{tiles[0][0]} w{tiles[0][1]} st{tiles[0][2]} sauto"))
                + f"; best {best}, best with rope {best_r} {res[best_r]['us']:.1f} us")
            del caches
            torch.cuda.empty_cache()
    return out


LM_HEAD_TILES = {1: ["1,4,1024,4,1", "1,8,1024,4,1", "1,16,1024,4,1", "1,8,512,4,1", "1,16,512,4,1", "1,32,512,8,1",
                     "1,8,2048,4,1", "16,64,128,4,4", "16,128,128,4,4"],
                 64: ["64,64,64,4,5", "64,128,64,4,4", "64,128,128,4,3", "64,64,128,4,4", "64,256,64,8,3"]}


def run_lm_head(tiles=LM_HEAD_TILES, launches: int = 8) -> dict:
    """The Orpheus lm_head GEMM alone ([M, 3072] x [156940, 3072]^T, bf16) at M = 1 and 64: cuBLAS
    on the padded weight (the engine's path, LlamaForCausalLM.pad_lm_head) against Triton tiles of
    runner/kernels/linear.py on the unpadded rows; us per launch and TB/s of weight bytes. The
    weight (0.96 GB) is far above L2, so every launch streams it from HBM."""
    from bench_gemm import _time_graph

    from runner.kernels.linear import skinny_linear

    v, k = ORPHEUS_3B["vocab_size"], 3072
    vp = -(-v // 64) * 64
    g = torch.Generator(device="cuda").manual_seed(0)
    padded = torch.randn(vp, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w = padded[:v]
    out = {}
    for m, specs in tiles.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = torch.nn.functional.linear(x, padded)[:, :v].float()
        res = {"cublas": _time_graph(lambda i: torch.nn.functional.linear(x, padded), 1, launches)}
        for spec in specs:
            tile = parse_tile([int(f) for f in spec.split(",")])
            try:
                got = skinny_linear(x, w, None, tile).float()
                assert torch.allclose(got, ref, atol=2e-2, rtol=2e-2), (got - ref).abs().max().item()
                res[spec] = _time_graph(lambda i, t=tile: skinny_linear(x, w, None, t), 1, launches)
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result
                log(f"  lm_head M={m} {spec}: {type(e).__name__}: {str(e)[:120]}")
        out[m] = {kk: {"us": us, "TBps": v * k * 2 / us / 1e6} for kk, us in res.items()}
        log(f"  lm_head M={m}: " + ", ".join(f"{kk} {r['us']:.1f} us ({r['TBps']:.2f} TB/s)" for kk, r in out[m].items()))
    return out


def eng_sampling(n: int):
    from streaming.sampling_params import SamplingParams

    return SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=n, ignore_eos=True, seed=0)


def run_hf(batches, budget_s: float):
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


def time_decode(dec, frames: int, B: int, repeats: int = 10) -> float:
    codes = torch.randint(0, 4096, (B, frames, 7), device="cuda")
    starts = torch.zeros(B, dtype=torch.int64, device="cuda")
    seeds = torch.arange(B, dtype=torch.int64, device="cuda")
    return time_decode_inputs(dec, codes, starts, seeds, repeats)


def run_codec():
    from runner.codecs.snac import CodecConfig, CodecStage

    folder = write_random_snac(Path("/tmp/snac24_random"))  # snac_24khz, random weights
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        cfg = CodecConfig(path=str(folder))
        stage = CodecStage(cfg, torch.device("cuda"), dtype)
        pol = cfg.policy
        tag = str(dtype).removeprefix("torch.")
        for frames in sorted({4, pol.max_window_frames}):
            for B in (1, 64, 256):
                t = time_decode(stage.decoder, frames, B)
                res[f"{tag}_window{frames}_B{B}_ms"] = t * 1e3
                log(f"  codec {tag} window={frames} frames B={B}: {t*1e3:.2f} ms")
        # each real-time stream needs 24000/2048 = 11.72 frames/s; a steady window emits
        # `steady_chunk` frames, so 256 streams need 256*11.72/steady windows per second,
        # decoded 256 at a time
        calls_per_s = (24000 / 2048) / pol.steady_chunk
        res[f"{tag}_gpu_share_256_streams"] = calls_per_s * res[f"{tag}_window{pol.max_window_frames}_B256_ms"] / 1e3
        res["policy"] = {"left": pol.left_context, "right": pol.right_context, "chunks": list(pol.chunk_frames)}
        log(f"  codec {tag}: share of GPU time at 256 real-time streams: {res[f'{tag}_gpu_share_256_streams']*100:.1f}%")
        del stage
        torch.cuda.empty_cache()
    return res


def make_orpheus_random_folder(root: Path, snac: Path) -> Path:
    """A model folder the real server can serve: Orpheus-3B's config.json (weights random via
    --random-weights), the embedded default's tokenizer (its ids are valid in this vocab) and
    an omnistream.json with Orpheus-3B's token layout and the random SNAC 24 kHz."""
    import shutil

    from runner.models.default_model import ensure_default_model

    tiny = ensure_default_model("/tmp/omnistream-cache")
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(ORPHEUS_3B | {"bos_token_id": 500}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, root / f)
    profile = json.loads((tiny / "omnistream.json").read_text())
    profile.update(prefix_token_ids=[128259], suffix_token_ids=[128009, 128260, 128261, 128257])
    profile["sampling"] = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.1, "max_tokens": 1200,
                           "stop_token_ids": [128258]}
    profile["codec"] = {"path": str(snac), "audio_token_offset": 128266, "codebook_size": 4096, "end_token_id": 128258}
    (root / "omnistream.json").write_text(json.dumps(profile))
    return root


def serving_model_folder() -> Path:
    """The random Orpheus-3B + SNAC 24 kHz folder that serving, ttfa and profile_serving use."""
    return make_orpheus_random_folder(Path("/tmp/orpheus3b-random"), write_random_snac(Path("/tmp/snac24_random")))


def in_process_engine(max_num_seqs: int):
    """The serving engine (as `serve` builds it, random weights) in this process."""
    from runner.engine.process import EngineProcArgs, build_engine

    return build_engine(EngineProcArgs(model_path=str(serving_model_folder()), input_addr="", output_addr="",
                                       device="cuda", max_num_seqs=max_num_seqs, max_model_len=1024, random_weights=True))


def run_ttfa(repeats: int = 8, prompt: list[int] | None = None) -> dict:
    """Engine-only time to first audio at one stream, on the serving model folder."""
    from streaming.sampling_params import SamplingParams

    eng = in_process_engine(8)
    prompt = prompt or [128259, *range(1000, 1024), 128009, 128260, 128261, 128257]  # ~Orpheus prompt length
    sp = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=60, seed=1)
    res = {"first_audio_ms": [], "steps_to_first_audio": []}
    for i in range(repeats + 2):  # two warm-ups
        eng.phase_s = [0.0] * len(eng.PHASES)
        t0 = time.perf_counter()
        eng.add_request(f"ttfa-{i}", prompt, sp, audio=True)
        steps, first, step_ms = 0, None, []
        while eng.has_unfinished:
            ts = time.perf_counter()
            outs = eng.step()
            step_ms.append(1e3 * (time.perf_counter() - ts))
            steps += 1
            if first is None and any(o.audio is not None for o in outs):
                first = time.perf_counter() - t0
                if i >= 2:
                    res["first_audio_ms"].append(first * 1e3)
                    res["steps_to_first_audio"].append(steps)
                    res.setdefault("phase_ms_per_step", []).append(
                        {n: 1e3 * v / steps for n, v in zip(eng.PHASES, eng.phase_s)})
                    res.setdefault("step_ms", []).append([round(x, 2) for x in step_ms])
    fa = sorted(res["first_audio_ms"])
    res["p50_ms"] = statistics.median(fa)
    log(f"  engine-only time to first audio: p50 {res['p50_ms']:.1f} ms (min {fa[0]:.1f}, max {fa[-1]:.1f}), "
        f"{res['steps_to_first_audio'][0]} steps; phases/step {res['phase_ms_per_step'][0]}; "
        f"step ms of the last request {res['step_ms'][-1]}")
    del eng
    torch.cuda.empty_cache()
    return res


def run_hidden_steps(batch: int = 64, new: int = 120) -> dict:
    """Decode step time at `batch` greedy rows (100-token prompts) when one of them streams its
    last hidden state (hidden_state_layers=(-1,)): with the plain graphs only (such steps run
    eagerly) and with RunnerConfig.hidden_state_graphs (an all-layers graph), next to the same
    batch without a hidden-state request. Median ms over the pure-decode steps."""
    from dataclasses import replace

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


def run_first_use(max_num_seqs: int = 64) -> dict:
    """After Engine.warm_up: host time of requests whose steps meet a shape for the first time,
    next to the same kind of request again (new tokens, so no prefix-cache hit). A first-use
    cost (a CUDA module loaded on first launch, a Triton compile) shows as first >> again, and
    in serving every stream waits for it. Cases: eager prefills (prompts past the 128-token
    token-row limit) alone and joining 8 running decodes, and a hidden-state request."""
    from runner.engine.compile_log import recording
    from streaming.sampling_params import SamplingParams

    eng = in_process_engine(max_num_seqs)
    t_warm = time.perf_counter()
    eng.warm_up()
    log(f"  first use: Engine.warm_up took {time.perf_counter() - t_warm:.1f} s")
    with recording() as compiled:  # every Triton compile after warm-up
        g = torch.Generator().manual_seed(7)
        hi = min(100000, eng.cfg.model.vocab_size)
        text = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=2, ignore_eos=True)
        audio = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=300, seed=1)
        n = 0

        def timed(length: int, hidden: bool = False) -> tuple[float, float]:
            """(ms from add_request to its end, longest step ms while it ran)."""
            nonlocal n
            n += 1
            rid = f"first-use-{n}"
            eng.add_request(rid, torch.randint(10, hi, (length,), generator=g).tolist(), text,
                            hidden_state_layers=(-1,) if hidden else ())
            t0, longest, done = time.perf_counter(), 0.0, False
            while not done:
                ts = time.perf_counter()
                done = any(o.request_id == rid and o.finished for o in eng.step())
                longest = max(longest, time.perf_counter() - ts)
            return 1e3 * (time.perf_counter() - t0), 1e3 * longest

        res: dict = {}
        for label, length, hidden in (("prompt 300 alone", 300, False), ("prompt 517 alone", 517, False),
                                      ("hidden states, prompt 50", 50, True)):
            res[label] = {"first": timed(length, hidden), "again": timed(length, hidden), "third": timed(length + 3, hidden)}
        for i in range(8):
            eng.add_request(f"dec-{i}", torch.randint(10, hi, (24,), generator=g).tolist(), audio, audio=True)
        for _ in range(10):
            eng.step()
        res["prompt 400 joining 8 decodes"] = {"first": timed(400), "again": timed(400), "third": timed(403)}
        for r in list(eng.requests):
            eng.abort_request(r)
        while eng.has_unfinished:
            eng.step()
    res["compiled_after_warm_up"] = compiled
    for label, r in res.items():
        if label != "compiled_after_warm_up":
            log(f"  first use: {label}: " + ", ".join(f"{k} {v[0]:.1f} ms (longest step {v[1]:.1f})" for k, v in r.items()))
    log(f"  Triton compiles after warm-up: {compiled or 'none'}")
    del eng
    torch.cuda.empty_cache()
    res["sdpa"] = sdpa_first_use()
    return res


def sdpa_first_use(lengths=(611, 614, 777)) -> dict:
    """The prefill path's SDPA call alone (runner/layers/attention.py's shapes: one sequence of L
    tokens, 8 KV heads x 3 query heads folded into the query axis, boolean causal mask, bf16)
    at prompt lengths not seen before: ms of the first call and of the second, with SDPA's own
    backend choice and with runner.layers.attention.NO_PLAN_BACKENDS."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from runner.layers.attention import NO_PLAN_BACKENDS

    out = {}
    for name, backends in (("default", None), ("no_plan", NO_PLAN_BACKENDS)):
        for L in lengths:
            L += 0 if name == "default" else 1  # a length this process has not met either
            q = torch.randn(1, 8, 3 * L, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, 8, L, 128, device="cuda", dtype=torch.bfloat16)
            pos = torch.arange(L, device="cuda")
            mask = (pos[None, :] <= pos[:, None]).repeat(3, 1)[None, None]  # [1, 1, 3L, L]
            times = []
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                    F.scaled_dot_product_attention(q, k, k, attn_mask=mask, scale=0.088)
                torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t0))
            out[f"{name} L={L}"] = times
            log(f"  SDPA {name} L={L}: first {times[0]:.1f} ms, again {times[1]:.2f} ms")
    return out


def run_codec_tiles(tiles_list: list[str]) -> dict:
    """Fused SNAC decoder per tile shape, bf16 model: ms per call at the serving shapes and the
    int16 distance from the current default tiles (a tile shape only changes float rounding)."""
    from runner.codecs.snac import (
        CodecConfig,
        SnacWindowDecoder,
        float_to_s16,
        load_snac,
    )
    from runner.kernels.snac import Tiles

    folder = write_random_snac(Path("/tmp/snac24_random"))  # snac_24khz, random weights
    model = load_snac(CodecConfig(path=str(folder)), torch.device("cuda"), torch.bfloat16)
    shapes = [(256, 12), (64, 12), (256, 5), (1, 3)]
    inputs = {bw: (torch.randint(0, 4096, (bw[0], bw[1], 7), device="cuda"),
                   torch.arange(bw[0], device="cuda") * 3, torch.arange(bw[0], device="cuda")) for bw in shapes}
    res, ref = {}, None
    for t in tiles_list:
        try:
            dec = SnacWindowDecoder(model, 2048, kernels="triton", tiles=Tiles.parse(t))
        except Exception as e:  # OutOfResources etc.: report, go on with the next shape
            res[t] = {"error": f"{type(e).__name__}: {e}"[:300]}
            log(f"  codec tiles {t}: {res[t]['error']}")
            continue
        row = {}
        for (B, W), (codes, starts, seeds) in inputs.items():
            row[f"B{B}xW{W}_ms"] = time_decode_inputs(dec, codes, starts, seeds) * 1e3
        codes, starts, seeds = inputs[(64, 12)]
        pcm = float_to_s16(dec.decode(codes, starts, seeds)).int()
        ref = pcm if ref is None else ref
        row["max_lsb_vs_first"] = (pcm - ref).abs().max().item()
        if ref is pcm:  # the first (default) tiles: which layers the time goes to
            row["kernel_timeline_us"] = codec_kernel_timeline(dec, *inputs[(256, 12)])
        res[t] = row
        log(f"  codec tiles {t}: {row}")
        del dec
    return res


def codec_kernel_timeline(dec, codes, starts, seeds) -> list[tuple[str, float]]:
    """Kernels of one window decode in launch order (= decoder layer order) and their µs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dec.decode(codes, starts, seeds)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.decode(codes, starts, seeds)
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    return [(e.name[:40], round(e.time_range.elapsed_us(), 1)) for e in ev]


def time_decode_inputs(dec, codes, starts, seeds, repeats: int = 10) -> float:
    for _ in range(2):
        dec.decode(codes, starts, seeds)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(repeats):
        dec.decode(codes, starts, seeds)
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / repeats / 1e3


def run_profile_serving(n: int, out_dir: Path, steps: int = 10) -> dict:
    """The serving engine (Orpheus-3B-shaped random model, random SNAC 24 kHz, bf16 codec) with
    n audio requests in decode, as a burst of TTS clients leaves it: host ms per phase and the
    kernel-level profile of a few steps (model, sampler and codec streams)."""
    # The same per-request Python on every machine (deploy/bench_host.py, no GPU): the serving
    # edge moves with the host's speed (deploy/RESULTS.md, s7), so each run records it.
    import bench_host
    from torch.profiler import ProfilerActivity, profile

    from runner.engine.process import freeze_startup_heap
    from streaming.sampling_params import SamplingParams

    probe = bench_host.measure(400, 200)
    log(f"  host probe (bench_host.py, 400 rows, ms): {probe}")
    eng = in_process_engine(max(n, 8))
    eng.warm_up()  # as the engine process does before it serves: no compiles in the timed burst
    freeze_startup_heap()
    sp = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=350)
    t0 = time.perf_counter()
    for i in range(n):
        eng.add_request(f"p{i}", [128259, *range(1000 + i % 7, 1024), 128009, 128260, 128261, 128257], sp, audio=True)
    # the burst's timeline: every step's wall time and composition until all have audio
    first: dict[str, float] = {}
    timeline = []
    # which calls the burst's slow steps spend their host time in (s8: this found compute_logits
    # blocked ~19 ms per prefill step, see ModelRunner.warm_sampling)
    with timed_calls(eng) as acc:
        while len(first) < n and eng.has_unfinished:
            ph0, c0 = list(eng.phase_s), dict(acc)
            ts = time.perf_counter()
            outs = eng.step()
            now = time.perf_counter()
            sc = eng.last_scheduled
            calls = {k: round(1e3 * (v - c0[k]), 2) for k, v in acc.items() if v - c0[k] > 5e-4}
            timeline.append({"ms": round((now - ts) * 1e3, 2), "seqs": len(sc.scheduled), "tokens": sc.num_batched_tokens,
                             "audio_outs": sum(o.audio is not None for o in outs), "codec_inflight": eng.codec.num_inflight,
                             "phase_ms": {k: round(1e3 * (v - v0), 2) for k, v, v0 in zip(eng.PHASES, eng.phase_s, ph0)},
                             "calls_ms": calls})
            for o in outs:
                if o.audio is not None:
                    first.setdefault(o.request_id, now - t0)
    t_prefill = max(first.values()) if first else float("nan")
    fa = sorted(first.values())
    ttfa = {"p50_ms": 1e3 * fa[len(fa) // 2], "p99_ms": 1e3 * fa[min(len(fa) - 1, int(0.99 * len(fa)))]} if fa else {}
    log(f"  serving engine burst of {n}: engine-side time to first audio {ttfa}; steps {timeline}")
    for _ in range(40):  # into steady decode
        eng.step()
    torch.cuda.synchronize()
    eng.phase_s = [0.0] * len(eng.PHASES)
    t0 = time.perf_counter()
    for _ in range(steps * 3):
        eng.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / (steps * 3)
    phases = {name: 1e3 * v / (steps * 3) for name, v in zip(eng.PHASES, eng.phase_s)}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    (out_dir / f"profile_serving_B{n}.txt").write_text(
        ka.table(sort_by="cuda_time_total", row_limit=45) + "\n\n" + ka.table(sort_by="self_cpu_time_total", row_limit=25))
    gpu_ms = sum(e.self_device_time_total for e in ka) / 1e3 / steps
    calls_ms = host_ms_by_call(eng, steps * 3)
    log(f"  serving engine B={n}: host ms/step by call {calls_ms}")
    # Where the host time goes (Python functions): cProfile over the same kind of steps. Its
    # own overhead inflates Python-heavy code, so read it for ranking, not for totals.
    import cProfile
    import io
    import pstats

    prof_py = cProfile.Profile()
    prof_py.enable()
    for _ in range(steps * 3):
        eng.step()
    prof_py.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    st = pstats.Stats(prof_py, stream=buf)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(45)
    (out_dir / f"host_profile_serving_B{n}.txt").write_text(buf.getvalue())
    res = {"batch": n, "prefill_s": t_prefill, "step_ms": wall_ms, "gpu_ms_per_step": gpu_ms, "host_ms_per_step": phases,
           "host_ms_by_call": calls_ms, "host_probe_400_ms": probe,
           "running": len(eng.scheduler.running), "burst_ttfa": ttfa, "burst_timeline": timeline}
    log(f"  serving engine B={n}: {wall_ms:.2f} ms/step (GPU kernels {gpu_ms:.2f} ms), host {phases}")
    while eng.has_unfinished:
        eng.step()
    del eng
    torch.cuda.empty_cache()
    return res


@contextlib.contextmanager
def timed_calls(eng):
    """Wrap the step's main calls (nested: sample_tokens includes the sampler's calls) while
    the block runs; yields {call: host seconds summed}, then unwraps them (bench_host.timed_calls)."""
    import bench_host

    import runner.engine.model_runner as mr

    r = eng.runner
    targets = {
        "schedule": (eng.scheduler, "schedule"), "update_from_output": (eng.scheduler, "update_from_output"),
        "execute_model": (r, "execute_model"), "graphs.run": (r.graphs, "run"), "sample_tokens": (r, "sample_tokens"),
        "sampling_batch": (r, "_sampling_batch"), "compute_logits": (r.model, "compute_logits"),
        "penalize": (r.sampler, "penalize"), "gather_window": (r.constraint, "gather_window"),
        "sample": (r.sampler, "sample"), "window_ids": (r.constraint, "window_ids"), "record": (r.slots, "record"),
        "copy_out": (r.copier, "copy"), "emit": (eng, "_emit"), "output_get": (mr.AsyncOutput, "get"),
        "codec_step": (eng.codec, "step"),
    }
    with bench_host.timed_calls(targets) as (wall, _):
        yield wall


def host_ms_by_call(eng, steps: int) -> dict[str, float]:
    """Host ms per step spent in each of the step's main calls over `steps` steps."""
    with timed_calls(eng) as acc:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    return {k: round(v * 1e3 / steps, 3) for k, v in acc.items()}


def run_serving(streams: str, max_seqs: int, max_tokens: int, ramps: str = "0", admission_wait_ms: float = 20.0,
                server_args: str = "", tag: str = "", server_root: str = "") -> dict:
    """Start the real server on the Orpheus-3B-shaped random model (plus `server_args`, e.g. an
    option to A/B; from the checkout `server_root` if given, e.g. the previous version's code)
    and run `omnistream bench` (this checkout's) against it: N concurrent WebSocket TTS sessions
    read in real time."""
    import socket
    import subprocess
    import urllib.request

    folder = serving_model_folder()
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    srv_root = Path(server_root).resolve() if server_root else root
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    tag = f"-wait{admission_wait_ms:g}{tag}"
    server_log = open(out_dir / f"server{tag}.log", "wb")  # the engine's per-5 s step / phase / first-audio log
    srv = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", str(folder), "--random-weights",
                            "--device", "cuda", "--max-num-seqs", str(max_seqs), "--max-model-len", "1024", "--port", str(port),
                            "--zmq-endpoint", "none", "--max-concurrent-requests", "4096",
                            "--admission-wait-ms", str(admission_wait_ms), *server_args.split()], cwd=srv_root,
                           stdout=server_log, stderr=subprocess.STDOUT)  # `-m` imports from cwd first
    try:
        t0 = time.time()
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if srv.poll() is not None or time.time() - t0 > 300:
                    raise RuntimeError("server did not start")
                time.sleep(1)
        log(f"  server up in {time.time() - t0:.0f}s")
        out = out_dir / f"serving{tag}.md"
        subprocess.run([sys.executable, "-m", "server.cli", "bench", "--url", f"http://127.0.0.1:{port}",
                        "--streams", streams, "--max-tokens", str(max_tokens), "--out", str(out), "--ramp-s", ramps,
                        "--text", "Hello there, this is one sentence of streaming speech for the benchmark."],
                       cwd=root, check=True)
        return {"table": out.read_text(), "admission_wait_ms": admission_wait_ms, "server_args": server_args,
                "server_root": server_root}
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
        server_log.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="bandwidth,engine,eager,hf,codec")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--hf-budget-s", type=float, default=240)
    ap.add_argument("--hf-batches", default="32,1,64,8,128,256", help="in this order until the budget is spent")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--streams", default="1,32,128,256,400,512")
    ap.add_argument("--serving-max-seqs", type=int, default=512)
    ap.add_argument("--serving-max-tokens", type=int, default=350)
    ap.add_argument("--serving-ramp-s", default="0", help="bench --ramp-s: 0 = all streams start together")
    ap.add_argument("--serving-admission-wait-ms", default="20", help="serve --admission-wait-ms; several: one server each")
    ap.add_argument("--serving-server-args", default="",
                    help="';'-separated sets of extra `serve` arguments, one server each (A/B; '' = defaults)")
    ap.add_argument("--serving-roots", default="",
                    help="';'-separated checkouts whose server to run, one server each, in turn ('' = this one): "
                         "an A/B against another version's code on the same machine")
    ap.add_argument("--profile-serving-batch", type=int, default=400)
    ap.add_argument("--skinny-linear", type=int, default=1, help="0: decode GEMMs in cuBLAS (A/B)")
    ap.add_argument("--pdl", type=int, default=1, help="0: no programmatic dependent launch (A/B)")
    ap.add_argument("--rope-in-attention", type=int, default=1, help="0: RoPE + KV write in their own launch (A/B)")
    ap.add_argument("--attn-tiles", default="", help="attn section: 'bn,warps,stages;...' at the automatic split only")
    ap.add_argument("--split-k", type=int, default=1, help="0: o_proj / down never as split-K partials (A/B)")
    ap.add_argument("--norm-fold", type=int, default=1, help="0: the post-attention RMSNorm always in its own launch (A/B)")
    ap.add_argument("--prefill-warm-up", type=int, default=1,
                    help="0: Engine.warm_up skips warm_up_eager_prefill (A/B of the first_use section; run each in its own process)")
    ap.add_argument("--variants", default="default;rope_in_attention=0",
                    help="section variants: ';'-separated kernel overrides, each timed on its own model")
    ap.add_argument("--tuned", default=None, help="gemm_tuned.json of a --sections gemm run: use its tile table")
    ap.add_argument("--profile-batches", default="", help="greedy graph-mode kernel profiles at these batch sizes")
    ap.add_argument("--codec-tiles", nargs="*", default=["64,128,32,4,3", "64,128,32,4,3,1", "128,128,32,8,3,1", "64,64,32,4,2,1",
                                                          "64,256,32,8,3,1"],
                    help="bm,bn,bk,warps,stages[,fast_sin]; the first is the reference (and gets a kernel timeline)")
    args = ap.parse_args()
    secs = set(args.sections.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    KERNELS.update(skinny_linear=bool(args.skinny_linear), pdl=bool(args.pdl),
                   rope_in_attention=bool(args.rope_in_attention), split_k=bool(args.split_k),
                   norm_fold=bool(args.norm_fold))
    if not args.prefill_warm_up:
        from runner.engine.engine import Engine

        Engine.warm_up_eager_prefill = lambda self: None  # the A/B baseline: warm-up as before s10
    if args.tuned:
        from bench_gemm import load_tuned

        from runner.kernels import linear as triton_linear

        triton_linear.TUNED.clear()
        triton_linear.TUNED.update(load_tuned(args.tuned))
    res: dict = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "command": " ".join(sys.argv), "kernels": dict(KERNELS, tuned=args.tuned),
                 "prefill_warm_up": bool(args.prefill_warm_up)}
    t0 = time.perf_counter()
    from streaming.sampling_params import SamplingParams

    if "bandwidth" in secs:
        res["bandwidth_Bps"] = bench_bandwidth()
        log(f"copy bandwidth: {res['bandwidth_Bps']/1e12:.2f} TB/s")
    if "gemm" in secs:
        from bench_gemm import run_gemm_sweep, tuned_literal

        res["gemm"] = run_gemm_sweep()
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gemm_tuned.json").write_text(json.dumps(res["gemm"]["tuned"]))
        log(tuned_literal(res["gemm"]["tuned"]))
    if "attn_modes" in secs:
        res["attn_modes"] = run_attn_modes()
    if "attn" in secs:
        tiles = [tuple(int(x) for x in t.split(",")) for t in args.attn_tiles.split(";")] if args.attn_tiles else ATTN_TILES
        res["attn"] = run_attn_sweep(tiles=tiles, all_splits=not args.attn_tiles)
    if "lm_head" in secs:
        res["lm_head"] = run_lm_head()
    if "splitk" in secs:
        from bench_gemm import run_splitk_sweep

        res["splitk"] = run_splitk_sweep()
    if "variants" in secs:
        res["variants"] = run_decode_variants(args.variants, batches, res.get("gemm", {}).get("tuned"))
    if secs & {"engine", "eager", "decode"}:
        model = build_orpheus_model()
        res["weight_bytes"] = weight_bytes(model)
        greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        if secs & {"engine", "decode"}:
            res["engine"] = run_engine(model, batches, graphs=True, async_sched=True, sampling=greedy)
        if "engine" in secs:
            orpheus = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=NEW, ignore_eos=True, seed=0)
            res["engine_orpheus_sampling"] = run_engine(model, [b for b in batches if b in (1, 64, 256)], True, True, orpheus,
                                                        timeline_at=64 if "profile" in secs else None)
        for B in (int(b) for b in args.profile_batches.split(",") if b):
            res.setdefault("critical_path", {})[B] = run_engine(model, [B], True, True, greedy, timeline_at=B)[B]["critical_path"]
        if "eager" in secs:
            res["eager"] = run_engine(model, [b for b in batches if b in (1, 64)], graphs=False, async_sched=False, sampling=greedy,
                                      timeline_at=1 if "profile" in secs else None)
        del model
        torch.cuda.empty_cache()
    if "codec" in secs:
        res["codec"] = run_codec()
    if "hf" in secs:
        res["hf"] = run_hf([int(b) for b in args.hf_batches.split(",")], args.hf_budget_s)
    if "codec_tiles" in secs:
        res["codec_tiles"] = run_codec_tiles(args.codec_tiles)
    if "profile_serving" in secs:
        res["profile_serving"] = run_profile_serving(args.profile_serving_batch, Path(args.out))
    if "ttfa" in secs:
        res["ttfa"] = run_ttfa()
    if "first_use" in secs:
        res["first_use"] = run_first_use()
    if "hidden" in secs:
        res["hidden"] = run_hidden_steps()
    if "boundary" in secs:
        from boundary_probe import measure

        res["boundary"] = measure()
        log("  us per dependency: " + ", ".join(f"{k} {v:.2f}" for k, v in res["boundary"]["us_per_dependency"].items()))
    if "serving" in secs:
        # one server per (admission wait, server-args set, checkout), in that order
        sets = [(w, extra.strip(), root.strip()) for w in args.serving_admission_wait_ms.split(",")
                for extra in args.serving_server_args.split(";") for root in args.serving_roots.split(";")]
        res["serving"] = [run_serving(args.streams, args.serving_max_seqs, args.serving_max_tokens, args.serving_ramp_s, float(w),
                                      extra, f"-{i}" if i else "", root)
                          for i, (w, extra, root) in enumerate(sets)]
    res["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    md = render(res)
    (out / "results.md").write_text(md)
    print(md)
    return 0


def render_variants(variants: dict, num_layers: int = ORPHEUS_3B["num_hidden_layers"]) -> list[str]:
    """Greedy decode ms/step per variant and batch; for `skip=OP` variants also the op's
    critical-path cost per layer: (mean of the `default` runs - the variant) / num_layers, in us."""
    batches = sorted({B for r in variants.values() for B in r}, key=int)
    base = {B: statistics.mean(r[B] for k, r in variants.items() if k.split(" #")[0] == "default" and B in r)
            for B in batches if any(k.split(" #")[0] == "default" and B in r for k, r in variants.items())}
    lines = ["", "Decode variants, greedy ms/step (skip=OP: that op's critical-path cost, us per layer):", "",
             "| variant | " + " | ".join(f"B={B}" for B in batches) + " |", "| --- |" + " --- |" * len(batches)]
    for k, r in variants.items():
        cells = []
        for B in batches:
            if B not in r:
                cells.append("")
            elif k.startswith("skip=") and B in base:
                cells.append(f"{r[B]:.3f} ({1e3 * (base[B] - r[B]) / num_layers:.1f} us)")
            else:
                cells.append(f"{r[B]:.3f}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


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
        lines += render_variants(res["variants"])
    if "engine_orpheus_sampling" in res:
        lines += ["", "Orpheus sampling (temperature 0.6, top-p 0.8, repetition penalty 1.1): " + ", ".join(
            f"B={B}: {r['step_ms']:.2f} ms/step" for B, r in res["engine_orpheus_sampling"].items())]
    if "codec" in res:
        c = res["codec"]
        lines += ["", "codec window decode (ms): " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in c.items() if k.endswith("_ms")),
                  "codec share of GPU time at 256 real-time streams: " + ", ".join(
                      f"{k.split('_')[0]} {v*100:.1f}%" for k, v in c.items() if k.endswith("share_256_streams")) + f" (policy {c['policy']})"]
    if "codec_tiles" in res:
        lines += ["", "fused SNAC decoder (bf16) per tile shape (bm,bn,bk,warps,stages), ms per call:", ""]
        shapes = next(([k for k in r if k != "kernel_timeline_us"] for r in res["codec_tiles"].values() if "error" not in r), [])
        lines += ["| tiles | " + " | ".join(shapes) + " |", "| --- |" + " --- |" * len(shapes)]
        for t, r in res["codec_tiles"].items():
            cells = [r["error"]] if "error" in r else [f"{r[k]:.2f}" if k.endswith("_ms") else str(r[k]) for k in shapes]
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        for t, r in res["codec_tiles"].items():
            if "kernel_timeline_us" in r:
                lines += ["", f"kernels of one 256 x 12-frame decode, tiles {t}, in layer order (us): "
                          + ", ".join(f"{n} {us:.0f}" for n, us in r["kernel_timeline_us"])]
    if "profile_serving" in res:
        p = res["profile_serving"]
        lines += ["", f"serving engine in-process at {p['running']} audio requests: {p['step_ms']:.2f} ms/step "
                      f"(GPU kernels {p['gpu_ms_per_step']:.2f} ms), host ms/step "
                      + ", ".join(f"{k} {v:.2f}" for k, v in p["host_ms_per_step"].items())
                      + f"; burst of {p['batch']} requests: engine-side time to first audio {p['burst_ttfa']} "
                      f"(kernel profile: profile_serving_B{p['batch']}.txt); host probe (deploy/bench_host.py, "
                      "400 rows, ms): " + ", ".join(f"{k} {v:.2f}" for k, v in p["host_probe_400_ms"].items())]
    if "hidden" in res:
        lines += ["", "Decode step, batch 64, one request streaming hidden states: "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in res["hidden"]["step_ms"].items())
                  + "; engine build, graph capture included: "
                  + ", ".join(f"{k} {v:.1f} s" for k, v in res["hidden"]["engine_build_s"].items())]
    if "boundary" in res:
        bd = res["boundary"]
        lines += ["", f"One dependency between two phases ({bd['programs']} programs, {bd['phases']} phases), us: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in bd["us_per_dependency"].items())]
    if "ttfa" in res:
        t = res["ttfa"]
        lines += ["", f"engine-only time to first audio (one stream, in-process): p50 {t['p50_ms']:.1f} ms over "
                      f"{len(t['first_audio_ms'])} requests, {t['steps_to_first_audio'][0]} engine steps; host ms/step "
                      + ", ".join(f"{k} {v:.2f}" for k, v in t["phase_ms_per_step"][0].items())]
    if "serving" in res:
        for sv in res["serving"]:
            extra = f" {sv['server_args']}" if sv.get("server_args") else ""
            extra += f"; server from {sv['server_root']}" if sv.get("server_root") else ""
            lines += ["", f"Serving (real server, `--admission-wait-ms {sv['admission_wait_ms']:g}{extra}`, WebSocket TTS clients "
                          "reading in real time):", "", sv["table"]]
    if "gemm" in res:
        lines += ["", "Skinny decode GEMMs, us per call in a CUDA graph (weights rotated past L2), TB/s of weight bytes:", "",
                  "| GEMM | M | cuBLAS | best Triton tile | tile (bm,bn,bk,warps,stages) | gated: GEMM + SiLU*mul kernel | gated kernel |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, rows in res["gemm"]["shapes"].items():
            for e in rows:
                fused = (f"{e['separate_us']:.1f}", f"{e['fused_best_us']:.1f} ({e['fused_best_tile']})") if "fused" in e else ("", "")
                lines.append(f"| {name} | {e['m']} | {e['cublas_us']:.1f} ({e['cublas_TBps']:.2f}) | {e['best_us']:.1f} "
                             f"({e['best_TBps']:.2f}) | {e['best_tile']} | {fused[0]} | {fused[1]} |")
    if bw:
        lines += ["", f"copy bandwidth {bw/1e12:.2f} TB/s; weights {res.get('weight_bytes', 0)/1e9:.2f} GB"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
