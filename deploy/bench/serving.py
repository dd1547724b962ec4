"""Serving: the real server (engine process + aiohttp) on the Orpheus-3B-shaped random model
with random SNAC 24 kHz. Sections (pick with --sections):

  serving          N concurrent WebSocket TTS clients reading in real time (`omnistream bench`):
                   TTFA p50/p99, RTF, underruns, largest real-time N; one server per
                   (admission wait, --serving-server-args set, --serving-roots checkout)
  ttfa             in-process engine (no server): time from add_request to the first PCM of one
                   audio request, and host time per step phase; the floor under the serving TTFA
  profile_serving  in-process engine with N audio requests as a burst leaves it: host ms per
                   phase and per call, kernel profile, cProfile of the host

The front end alone on an instant fake engine (no GPU): `python -m deploy.bench.frontend`.

    python -m deploy.bench.serving --sections serving --streams 1,400 --serving-ramp-s 0
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

from deploy.bench.common import (
    ROOT,
    add_out_arg,
    in_process_engine,
    log,
    run_header,
    served,
    serving_model_folder,
    write_results,
)


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


def run_profile_serving(n: int, out_dir: Path, steps: int = 10) -> dict:
    """The serving engine (Orpheus-3B-shaped random model, random SNAC 24 kHz, bf16 codec) with
    n audio requests in decode, as a burst of TTS clients leaves it: host ms per phase and the
    kernel-level profile of a few steps (model, sampler and codec streams)."""
    # The same per-request Python on every machine (deploy/bench/host.py, no GPU): the serving
    # edge moves with the host's speed, so each run records it.
    from torch.profiler import ProfilerActivity, profile

    from deploy.bench import host as bench_host
    from streaming.gc_pause import freeze_startup_heap
    from streaming.sampling_params import SamplingParams

    probe = bench_host.measure(400, 200)
    log(f"  host probe (deploy/bench/host.py, 400 rows, ms): {probe}")
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
    # which calls the burst's slow steps spend their host time in (this found compute_logits
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
    import runner.engine.model_runner as mr
    from deploy.bench import host as bench_host

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
                server_args: str = "", tag: str = "", server_root: str = "", out_dir: Path = Path(".")) -> dict:
    """Start the real server on the Orpheus-3B-shaped random model (plus `server_args`, e.g. an
    option to A/B; from the checkout `server_root` if given, e.g. the previous version's code)
    and run `omnistream bench` (this checkout's) against it: N concurrent WebSocket TTS sessions
    read in real time."""
    import subprocess

    srv_root = Path(server_root).resolve() if server_root else ROOT
    tag = f"-wait{admission_wait_ms:g}{tag}"
    serve_args = ["--model", str(serving_model_folder()), "--random-weights", "--device", "cuda", "--max-num-seqs",
                  str(max_seqs), "--max-model-len", "1024", "--zmq-endpoint", "none", "--max-concurrent-requests",
                  "4096", "--admission-wait-ms", str(admission_wait_ms), *server_args.split()]
    # the server's log: the engine's per-5 s step / phase / first-audio lines
    with served(serve_args, out_dir / f"server{tag}.log", cwd=srv_root, timeout_s=300) as srv:
        log(f"  server up in {srv.up_s:.0f}s")
        out = out_dir / f"serving{tag}.md"
        subprocess.run([sys.executable, "-m", "server.cli", "bench", "--url", srv.url,
                        "--streams", streams, "--max-tokens", str(max_tokens), "--out", str(out), "--ramp-s", ramps,
                        "--text", "Hello there, this is one sentence of streaming speech for the benchmark."],
                       cwd=ROOT, check=True)
        return {"table": out.read_text(), "admission_wait_ms": admission_wait_ms, "server_args": server_args,
                "server_root": server_root}


def render(res: dict) -> str:
    lines = [f"date {res['date']}, GPU {res['gpu']}, torch {res['torch']}, command `{res['command']}`"]
    if "profile_serving" in res:
        p = res["profile_serving"]
        lines += ["", f"serving engine in-process at {p['running']} audio requests: {p['step_ms']:.2f} ms/step "
                      f"(GPU kernels {p['gpu_ms_per_step']:.2f} ms), host ms/step "
                      + ", ".join(f"{k} {v:.2f}" for k, v in p["host_ms_per_step"].items())
                      + f"; burst of {p['batch']} requests: engine-side time to first audio {p['burst_ttfa']} "
                      f"(kernel profile: profile_serving_B{p['batch']}.txt); host probe (deploy/bench/host.py, "
                      "400 rows, ms): " + ", ".join(f"{k} {v:.2f}" for k, v in p["host_probe_400_ms"].items())]
    if "ttfa" in res:
        t = res["ttfa"]
        lines += ["", f"engine-only time to first audio (one stream, in-process): p50 {t['p50_ms']:.1f} ms over "
                      f"{len(t['first_audio_ms'])} requests, {t['steps_to_first_audio'][0]} engine steps; host ms/step "
                      + ", ".join(f"{k} {v:.2f}" for k, v in t["phase_ms_per_step"][0].items())]
    for sv in res.get("serving", []):
        extra = f" {sv['server_args']}" if sv.get("server_args") else ""
        extra += f"; server from {sv['server_root']}" if sv.get("server_root") else ""
        lines += ["", f"Serving (real server, `--admission-wait-ms {sv['admission_wait_ms']:g}{extra}`, WebSocket TTS clients "
                      "reading in real time):", "", sv["table"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="serving", help="comma-separated: serving, ttfa, profile_serving")
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
    add_out_arg(ap, "serving")
    args = ap.parse_args()
    secs = set(args.sections.split(","))
    out = Path(args.out)
    res = run_header()
    if "profile_serving" in secs:
        out.mkdir(parents=True, exist_ok=True)
        res["profile_serving"] = run_profile_serving(args.profile_serving_batch, out)
    if "ttfa" in secs:
        res["ttfa"] = run_ttfa()
    if "serving" in secs:
        # one server per (admission wait, server-args set, checkout), in that order
        sets = [(w, extra.strip(), root.strip()) for w in args.serving_admission_wait_ms.split(",")
                for extra in args.serving_server_args.split(";") for root in args.serving_roots.split(";")]
        res["serving"] = [run_serving(args.streams, args.serving_max_seqs, args.serving_max_tokens, args.serving_ramp_s,
                                      float(w), extra, f"-{i}" if i else "", root, out)
                          for i, (w, extra, root) in enumerate(sets)]
    write_results(out, res, render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
