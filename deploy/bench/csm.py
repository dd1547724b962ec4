"""CSM-1B-shaped multi-codebook talker on the GPU (random weights, bf16): frame step against its
bound and against transformers, and real-time streams through the real server. Sections:

  frames    (--model csm: CSM-1B's shape; qwen3_tts: Qwen3-TTS 12 Hz 1.7B's talker and code
            predictor, 16 codebooks of 2048, every row in the streaming-text layout with a
            trailing text; code-0 window and repetition penalty 1.05, the groups' own sampling)
            in-process engine, CUDA graphs + async scheduling, every row decoding: ms per frame
            step at each batch, the host idle gap between steps (wall minus GPU time per step),
            and the bound: bytes a frame step must read over the copy bandwidth measured in the
            same run. Bytes per step = backbone weights (its layers, final norm and codebook-0
            head; the embeddings are a gather of B rows, ~0) + (K - 1) x the depth decoder's
            body (layers, norm, input projector: one forward per sub-step, counted each time
            since its 2 x 4 layers and projector (~0.3 GB in bf16) do not stay in the 50 MB L2
            across the step) + every codebook head once (sub-step k reads head k only) + the
            live backbone KV (B x context x layers x 2 x kv heads x head dim x 2 bytes).
  hf        transformers' CsmForConditionalGeneration.generate on the same shapes: ms per frame
            ((t(n2) - t(n1)) / (n2 - n1) frames, so the prompt's prefill cancels).
  profile   eager frame steps under torch.profiler: the kernels the step's GPU time goes to.
  host      (CPU, no GPU) a tiny random CSM with its Mimi codec and N audio streams in process:
            host ms per step phase, emit among them.
  serving   the real server (`omnistream serve --random-weights`, random Mimi codec) and the
            serving benchmark: N WebSocket TTS streams (12.5 frames/s each) read in real time,
            TTFA p50 / p99, underruns; levels started together or spread over --ramp-s.

    python -m deploy.bench.csm --sections frames,hf,serving
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from deploy.bench.common import ROOT, add_out_arg, bench_bandwidth, log, run_header, scratch, served, write_results
from deploy.bench.frame_models import (FRAME_MODELS, PROMPT, PREFIXES, csm_folder, frame_request, mimi_folder,
                                       qwen3_tts_served_folder, qwen12hz_folder)

FRAME_S = 0.08  # audio per frame (12.5 frames/s)


def frame_bytes(model, batch: int, context: int, kind: str = "csm") -> dict:
    """Bytes one frame step must read (see the module doc)."""
    k = model.num_codebooks

    def size(prefixes: tuple[str, ...]) -> int:
        return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith(prefixes))

    backbone, depth_body, heads = (size(p) for p in PREFIXES[kind])
    c = model.backbone.cfg
    kv = batch * context * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
    return {"backbone": backbone, "depth_body_x_subs": (k - 1) * depth_body, "heads": heads, "kv": kv,
            "total": backbone + (k - 1) * depth_body + heads + kv}


def run_frames(batches: list[int], steps: int, bandwidth: float, variant: str = "default",
               kind: str = "csm") -> list[dict]:
    """ms per frame step at each batch on one model (`kind`: FRAME_MODELS) built for `variant`
    (deploy.bench.variants' syntax: RunnerConfig kernel switches, `tuning=none`, tile / fold /
    split / head rows)."""
    from deploy.bench.variants import parse_variant, variant_tables
    from runner.kernels.tuning import load_tables

    from runner.config import EngineConfig
    from runner.engine.engine import Engine
    from runner.families import family_for
    from runner.layers import make_backends
    from streaming.profile import read_profile
    from streaming.sampling_params import SamplingParams

    v = parse_variant(variant)
    if v.skips or v.attn_splits is not None or v.fp32_greedy or v.torch_argmax or v.swept:
        raise ValueError(f"variant {variant!r}: the frames section takes switches and table rows only")
    name, make_folder = FRAME_MODELS[kind]
    folder = make_folder(scratch(name))
    top = max(batches)
    ctx = PROMPT + 16 + 2 * steps
    cfg = EngineConfig.build(folder, device="cuda", dtype="bfloat16", max_num_seqs=top, max_model_len=2048,
                             max_num_batched_tokens=8192, block_size=16, num_blocks=top * (ctx // 16 + 2) + 64,
                             max_graph_batch_size=top, **v.switches)
    family = family_for(read_profile(folder), str(folder))
    attn, ops = make_backends(cfg.runner, variant_tables(v, load_tables(cfg.runner.torch_device, cfg.runner.tuning)))
    model = family.load_model(cfg, attn, ops, random_weights=True)
    eng = Engine(cfg, model=model, family=family, codec=None)
    rows = []
    for b in batches:
        sp = SamplingParams(temperature=0.9, top_k=50, max_tokens=16 + 2 * steps, ignore_eos=True, seed=0,
                            repetition_penalty=1.05 if kind == "qwen3_tts" else 1.0)
        for i in range(b):
            eng.add_request(f"b{b}-{i}", sampling=sp, **frame_request(kind, i))
        while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
            eng.step()
        for _ in range(8):
            eng.step()
        eng.runner.record_timeline, eng.runner.timeline = True, []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
        eng.runner.record_timeline = False
        gpu = statistics.median(s.elapsed_time(e) for s, e in eng.runner.timeline) / 1e3
        context = PROMPT + 8 + steps // 2  # mean context over the timed steps
        by = frame_bytes(model, b, context, kind)
        bound = by["total"] / bandwidth
        rows.append({"model": kind, "variant": variant, "batch": b, "ms_per_frame": 1e3 * wall, "gpu_ms": 1e3 * gpu, "idle_gap_us": 1e6 * max(0.0, wall - gpu),
                     "bound_ms": 1e3 * bound, "x_bound": wall / bound, "bytes": by,
                     "frames_per_s": b / wall, "realtime_streams": b * FRAME_S / wall})
        log(f"frames {variant} batch {b}: {1e3 * wall:.2f} ms/frame (GPU {1e3 * gpu:.2f}), bound {1e3 * bound:.2f} ms, "
            f"x{wall / bound:.2f}")
        for rid in list(eng.requests):
            eng.abort_request(rid)
        while eng.has_unfinished:
            eng.step()
    return rows


def run_profile(batches: list[int], steps: int = 5) -> str:
    """Eager frame steps (no graphs) under torch.profiler: the kernels a frame step spends its
    GPU time in, per batch (top 25 by total CUDA time)."""
    from torch.profiler import ProfilerActivity, profile

    from runner.config import EngineConfig
    from runner.engine.engine import Engine
    from runner.families import family_for
    from runner.layers import make_backends
    from streaming.profile import read_profile
    from streaming.sampling_params import SamplingParams

    folder = csm_folder(scratch("csm1b-random"))
    top = max(batches)
    cfg = EngineConfig.build(folder, device="cuda", dtype="bfloat16", max_num_seqs=top, max_model_len=512,
                             block_size=16, num_blocks=top * 8 + 64, cuda_graphs=False)
    family = family_for(read_profile(folder), str(folder))
    attn, ops = make_backends(cfg.runner)
    eng = Engine(cfg, model=family.load_model(cfg, attn, ops, random_weights=True), family=family, codec=None)
    text = []
    for b in batches:
        sp = SamplingParams(temperature=0.9, top_k=50, max_tokens=40, ignore_eos=True, seed=0)
        for i in range(b):
            eng.add_request(f"p{b}-{i}", [(7 * i + j) % 400 + 1 for j in range(PROMPT)], sp)
        for _ in range(6):
            eng.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
        text.append(f"### eager frame step, batch {b}, {steps} steps\n\n```\n"
                    + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25) + "\n```\n")
        for rid in list(eng.requests):
            eng.abort_request(rid)
        while eng.has_unfinished:
            eng.step()
    return "\n".join(text)


def run_host(streams: int, steps: int = 20) -> dict:
    """The engine's host work per step for `streams` audio requests of a tiny random CSM with its
    Mimi codec, on the CPU (no GPU): ms per phase (Engine.PHASES). The model and codec compute are
    the tiny model's; `emit` (frames accepted, handed to the codec) is the part that scales with
    the streams as on the GPU."""
    from runner.config import EngineConfig
    from runner.engine.engine import Engine
    from runner.families import family_for
    from streaming.profile import read_profile
    from streaming.sampling_params import SamplingParams
    from tests.support.tiny_models import make_tiny_csm

    torch.set_num_threads(1)
    folder = make_tiny_csm(scratch("csm-tiny-host"), seed=3, hidden=32, depth_hidden=32, layers=1, depth_layers=1)
    cfg = EngineConfig.build(folder, device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=4096,
                             max_num_seqs=streams, block_size=16, num_blocks=streams * 8 + 64)
    family = family_for(read_profile(folder), str(folder))
    eng = Engine(cfg, family=family, codec=family.build_codec(torch.device("cpu"), torch.float32))
    sp = SamplingParams(temperature=0.9, top_k=20, max_tokens=steps + 10, ignore_eos=True, seed=1)
    for i in range(streams):
        eng.add_request(f"h{i}", [1, 5, 6, 7], sp, audio=True)
    for _ in range(5):
        eng.step()
    eng.phase_s = [0.0] * len(eng.PHASES)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    res = {"streams": streams, "ms_per_step": 1e3 * (time.perf_counter() - t0) / steps,
           **{f"{name}_ms": 1e3 * v / steps for name, v in zip(eng.PHASES, eng.phase_s)}}
    log(f"host, {streams} tiny-CSM streams: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items() if k.endswith("_ms")))
    return res


def run_hf(batches: list[int], budget_s: float) -> list[dict]:
    from transformers import CsmConfig, CsmForConditionalGeneration

    torch.manual_seed(0)
    model = CsmForConditionalGeneration(CsmConfig()).to("cuda", torch.bfloat16).eval()
    rows, t_start = [], time.perf_counter()
    for b in batches:
        if time.perf_counter() - t_start > budget_s:
            break
        ids = torch.randint(1, 400, (b, PROMPT), device="cuda")

        def timed(n: int) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=True,
                               depth_decoder_do_sample=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t

        timed(2)
        t1, t2 = timed(2), timed(8)
        ms = 1e3 * (t2 - t1) / 6
        rows.append({"batch": b, "ms_per_frame": ms})
        log(f"transformers batch {b}: {ms:.1f} ms/frame")
    del model
    torch.cuda.empty_cache()
    return rows


STALL_LINE = "engine loop: no progress"  # runner/engine/process.py's watchdog report


def dump_stacks(pid: int, path: Path) -> None:
    """Where the server and its engine process are (py-spy, when installed) and what the GPU is
    doing, into `path`, when the engine's watchdog has reported a stuck loop (a dump says
    whether the host waits on the GPU or on itself; the GPU's load whether a kernel spins)."""
    parts = []
    spy = shutil.which("py-spy")
    if spy is None:
        parts.append("py-spy is not installed: no Python stacks")
    else:
        r = subprocess.run([spy, "dump", "--pid", str(pid), "--subprocesses"], capture_output=True, text=True, timeout=60)
        parts.append(r.stdout + r.stderr)
    r = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv"], capture_output=True,
                       text=True)
    parts.append(r.stdout + r.stderr)
    path.write_text("\n".join(parts))
    log(f"the engine reported a stuck loop: stacks in {path}")


def run_serving(streams: str, ramps: str, max_frames: int, max_num_seqs: int, out: Path,
                server_args: list[str] = (), kind: str = "csm") -> str:
    """The serving benchmark against a real server; `server_args` are appended to its command
    line (e.g. ["--ws-max-inflight-utterances", "1"] for an A/B of a server setting). When the
    engine's watchdog reports a stuck loop in the server's log, the stacks and the GPU's load
    are dumped at once (csm-stall.txt), while the engine is still stuck: it gives up only after
    --stall-exit-s."""
    if kind == "csm":
        folder, codec = csm_folder(scratch("csm1b-random")), mimi_folder(scratch("mimi-random"))
    else:
        folder, codec = qwen3_tts_served_folder(scratch("qwen3tts-1b7-cv")), qwen12hz_folder(scratch("qwen12hz-random"))
    serve_args = ["--model", str(folder), "--codec", str(codec), "--random-weights", "--device", "cuda",
                  "--max-num-seqs", str(max_num_seqs), "--max-concurrent-requests", str(2 * max_num_seqs),
                  "--max-open-sessions", str(2 * max_num_seqs), "--zmq-endpoint", "none", *server_args]
    with served(serve_args, out / f"{kind}-server.log", env=dict(os.environ, PYTHONUNBUFFERED="1"),
                timeout_s=400) as srv:
        log(f"server up in {srv.up_s:.0f} s")
        table = out / f"{kind}-serving.md"
        bench = subprocess.Popen([sys.executable, "-m", "server.cli", "bench", "--url", srv.url,
                                  "--streams", streams, "--ramp-s", ramps, "--max-tokens", str(max_frames),
                                  "--out", str(table)], cwd=ROOT)
        with open(out / f"{kind}-server.log", "rb") as log_file:  # read as it grows: only the new bytes
            seen, dumped = b"", False
            while bench.poll() is None:
                time.sleep(1.0)
                seen = seen[-len(STALL_LINE):] + log_file.read()  # (the line may straddle two reads)
                if not dumped and STALL_LINE.encode() in seen:
                    dump_stacks(srv.proc.pid, out / f"{kind}-stall.txt")
                    dumped = True
        if bench.wait() != 0:
            raise RuntimeError(f"bench exited with {bench.returncode}")
        return table.read_text()


def render(res: dict) -> str:
    shape = {"csm": "CSM-1B shape", "qwen3_tts": "Qwen3-TTS 12 Hz 1.7B shape"}[res.get("model", "csm")]
    lines = [f"# {shape}, random weights, {res['gpu']}, {res['date']}", "", f"`{res['command']}`", ""]
    if "bandwidth_tb_s" in res:
        lines += [f"Bound = bytes a frame step reads / copy bandwidth {res['bandwidth_tb_s']:.2f} TB/s (bytes read + "
                  "written per second by a device copy, measured in this run).", ""]
    hf = {r["batch"]: r["ms_per_frame"] for r in res.get("hf", [])}
    if res.get("frames"):
        lines += ["| variant | batch | ms/frame | GPU ms | idle gap µs | bound ms | x bound | transformers ms/frame | speed-up | real-time streams |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in res["frames"]:
            h = hf.get(r["batch"])
            hf_ms = "" if h is None else f"{h:.1f}"
            speedup = "" if h is None else f"{h / r['ms_per_frame']:.0f}x"
            lines.append(f"| {r['variant']} | {r['batch']} | {r['ms_per_frame']:.2f} | {r['gpu_ms']:.2f} | {r['idle_gap_us']:.0f} | "
                         f"{r['bound_ms']:.2f} | {r['x_bound']:.2f} | {hf_ms} | {speedup} | {r['realtime_streams']:.0f} |")
        lines.append("")
    if res.get("host"):
        h = res["host"]
        lines += ["## Host work per step (tiny CSM, CPU)", "", f"{h['streams']} streams: " +
                  ", ".join(f"{k.removesuffix('_ms')} {v:.2f} ms" for k, v in h.items() if k.endswith("_ms")), ""]
    if res.get("profile"):
        lines += ["## Kernel profile", "", res["profile"]]
    if res.get("serving"):
        lines += ["## Serving", "", res["serving"]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="frames,hf,serving")
    ap.add_argument("--model", choices=tuple(FRAME_MODELS), default="csm",
                    help="frames and serving: the model's shape (serving qwen3_tts: a CustomVoice folder)")
    ap.add_argument("--batches", default="1,8,32,64,128,256,512")
    ap.add_argument("--variants", default="default",
                    help="frames: ';'-separated variants, one model each (deploy.bench.variants: kernel switches, "
                         "tuning=none, tile: / fold: / split: / head: rows), e.g. \"default;fold:1024:1024:64=16/32/128/4/5\"")
    ap.add_argument("--steps", type=int, default=40, help="timed frame steps per batch")
    ap.add_argument("--hf-batches", default="1,8,32,64")
    ap.add_argument("--hf-budget-s", type=float, default=90)
    ap.add_argument("--profile-batches", default="1,64")
    ap.add_argument("--host-streams", type=int, default=512)
    ap.add_argument("--streams", default="1,512,1000")
    ap.add_argument("--ramp-s", default="2")
    ap.add_argument("--max-frames", type=int, default=150, help="frames per utterance (12 s)")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--server-args", default="", help="serving: more `omnistream serve` arguments, one string")
    add_out_arg(ap, "csm")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = set(args.sections.split(","))
    res = run_header()
    res["model"] = args.model
    if "frames" in sections:
        bw = bench_bandwidth()
        res["bandwidth_tb_s"] = bw / 1e12
        res["frames"] = [row for t in args.variants.split(";")
                         for row in run_frames([int(x) for x in args.batches.split(",")], args.steps, bw, t,
                                               args.model)]
        write_results(out, res, render(res))
    if "hf" in sections:
        res["hf"] = run_hf([int(x) for x in args.hf_batches.split(",")], args.hf_budget_s)
        write_results(out, res, render(res))
    if "host" in sections:
        res["host"] = run_host(args.host_streams)
        write_results(out, res, render(res))
    if "profile" in sections:
        res["profile"] = run_profile([int(x) for x in args.profile_batches.split(",")])
        write_results(out, res, render(res))
    if "serving" in sections:
        res["serving"] = run_serving(args.streams, args.ramp_s, args.max_frames, args.max_num_seqs, out,
                                     shlex.split(args.server_args), args.model)
    write_results(out, res, render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
