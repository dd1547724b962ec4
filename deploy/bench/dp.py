"""Data-parallel serving: one engine against N engines behind one front end, and one engine
killed under load (issue 36). Sections (pick with --sections):

  capacity  one real server per --data-parallel-sizes value (engine i on GPU i), each running
            `omnistream bench` levels (WebSocket TTS sessions read by real-time players) for
            every (--max-tokens, --ramp-s): TTFA p50/p99, underruns, errors, the largest
            real-time N (no underrun, TTFA p99 < 300 ms) and its ratio to the first size's
  kill      on a server of the largest size: --kill-streams sessions; --kill-engine-after-s
            after they start, SIGKILL engine 0 (its pid from /health). Per stream: failed (error
            code, seconds after the kill) or completed (underruns, TTFA); requests in flight per
            engine at the kill; when /health showed the engine down and healthy again; whether
            the restarted engine takes new work

On the GPU machine (the Orpheus-3B-shaped random model, as deploy/bench/serving.py):

    python -m deploy.bench.dp --data-parallel-sizes 1,2 --streams 64,128,256,400,512,640,800 \\
        --max-tokens 350,1000 --ramp-s 0,2 --kill-streams 400 --kill-engine-after-s 6

On the CPU (the embedded tiny model, two CPU engines; checks the harness, not a figure):

    python -m deploy.bench.dp --cpu --streams 2,4 --max-tokens 70 --kill-streams 4 --kill-engine-after-s 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from deploy.bench.common import (
    add_out_arg,
    free_port,
    http_json,
    log,
    run_header,
    serve_command,
    served,
    serving_model_folder,
    write_results,
)
from server.bench import LEVEL_TIMEOUT_S, LevelResult, bench, percentile, run_level

TEXT = "Hello there, this is one sentence of streaming speech for the benchmark."
STARTUP_TIMEOUT_S = 600.0


@contextlib.contextmanager
def running_server(dp: int, args: argparse.Namespace, out: Path) -> Iterator[str]:
    """The real server with `dp` engines; yields its base URL once /health says every engine is
    up ("ok", not "degraded"), stops it on exit."""
    with tempfile.TemporaryDirectory(prefix="omnistream-dp-", ignore_cleanup_errors=True) as tmp:
        model = (["--device", "cpu", "--cache-dir", str(Path(tmp) / "cache")] if args.cpu else
                 ["--model", str(serving_model_folder()), "--random-weights", "--device", "cuda"])
        serve_args = ["--zmq-endpoint", "none", *model, "--max-num-seqs", str(args.max_num_seqs),
                      "--max-model-len", str(args.max_model_len), "--max-concurrent-requests", "4096",
                      "--max-open-sessions", "4096", "--data-parallel-size", str(dp), *args.server_args.split()]
        port = free_port()
        log(f"  starting: {' '.join(serve_command(port, serve_args)[2:])}")
        with served(serve_args, out / f"server-dp{dp}.log", port=port, timeout_s=STARTUP_TIMEOUT_S,
                    ready=lambda health: health.get("status") == "ok", stop_s=60) as srv:
            log(f"  {dp} engine(s) up in {srv.up_s:.0f} s")
            yield srv.url


def _row(dp: int, max_tokens: int, lv: LevelResult) -> dict:
    return {"dp": dp, "max_tokens": max_tokens, "ramp_s": lv.ramp_s, "n": lv.n,
            "ttfa_p50_ms": 1e3 * percentile(lv.ttfas, 50), "ttfa_p99_ms": 1e3 * percentile(lv.ttfas, 99),
            "underruns": lv.underruns, "streams_with_underrun": sum(s.underruns > 0 for s in lv.streams),
            "errors": len(lv.errors), "real_time": lv.real_time, "wall_s": lv.wall_s}


def run_capacity(args: argparse.Namespace, out: Path) -> dict:
    levels = [int(x) for x in args.streams.split(",")]
    ramps = [float(x) for x in args.ramp_s.split(",")]
    rows: list[dict] = []
    for dp in [int(x) for x in args.data_parallel_sizes.split(",")]:
        with running_server(dp, args, out) as url:
            for max_tokens in [int(x) for x in args.max_tokens.split(",")]:
                rows += [_row(dp, max_tokens, lv) for lv in asyncio.run(bench(url, levels, args.text, max_tokens, ramps))]
    best: dict[str, int] = {}
    for r in rows:
        key = f"dp{r['dp']} max_tokens {r['max_tokens']} ramp {r['ramp_s']:g}s"
        best.setdefault(key, 0)
        if r["real_time"]:
            best[key] = max(best[key], r["n"])
    return {"rows": rows, "largest_real_time_n": best}


async def _kill_under_load(url: str, args: argparse.Namespace) -> dict:
    n, max_tokens = args.kill_streams, int(args.max_tokens.split(",")[0])
    level = asyncio.create_task(run_level(url, n, args.text, max_tokens, LEVEL_TIMEOUT_S, float(args.ramp_s.split(",")[0])))
    await asyncio.sleep(args.kill_engine_after_s)
    _, health = await asyncio.to_thread(http_json, url + "/health")
    victim = health["engines"][0]
    in_flight = [e["in_flight"] for e in health["engines"]]
    os.kill(victim["pid"], signal.SIGKILL)
    t_kill = time.perf_counter()
    down_s = back_s = None
    while back_s is None and time.perf_counter() - t_kill < STARTUP_TIMEOUT_S:
        status, h = await asyncio.to_thread(http_json, url + "/health")
        if down_s is None and not h["engines"][0]["healthy"]:
            down_s = time.perf_counter() - t_kill
        elif down_s is not None and h["engines"][0]["healthy"]:
            back_s = time.perf_counter() - t_kill
        await asyncio.sleep(0.05)
    lv = await level
    failed = [s for s in lv.streams if s.error]
    survivors = [s for s in lv.streams if not s.error]
    # new work after the restart: a level of 2 sessions per engine, then the restarted engine's count
    def admitted() -> int:
        return http_json(url + "/v1/engine/stats")[1]["engines"][0]["stats"]["num_requests_total"]

    before = await asyncio.to_thread(admitted)
    after = await run_level(url, 2 * len(in_flight), args.text, max_tokens, LEVEL_TIMEOUT_S)
    took_work = await asyncio.to_thread(admitted) > before
    _, h = await asyncio.to_thread(http_json, url + "/health")
    return {
        "streams": n, "max_tokens": max_tokens, "kill_after_s": args.kill_engine_after_s,
        "killed_pid": victim["pid"], "in_flight_per_engine_at_kill": in_flight,
        "failed": len(failed), "failed_codes": sorted({s.error.split(":")[0] for s in failed}),
        "failed_after_kill_s_max": max((s.error_at - t_kill for s in failed if s.error_at), default=None),
        "survivors": len(survivors), "survivor_underruns": sum(s.underruns for s in survivors),
        "survivor_ttfa_p99_ms": 1e3 * percentile([s.ttfa_s for s in survivors if s.ttfa_s is not None], 99),
        "health_down_after_s": down_s, "healthy_again_after_s": back_s,
        "restarted_pid": h["engines"][0]["pid"], "restarted_engine_took_work": took_work,
        "after_restart_errors": len(after.errors),
    }


def run_kill(args: argparse.Namespace, out: Path) -> dict:
    dp = max(int(x) for x in args.data_parallel_sizes.split(","))
    if dp < 2:
        raise SystemExit("kill: needs a --data-parallel-sizes value >= 2")
    with running_server(dp, args, out) as url:
        asyncio.run(run_level(url, 1, args.text, 35, LEVEL_TIMEOUT_S))  # warm-up
        res = asyncio.run(_kill_under_load(url, args))
    log(f"  kill: {res}")
    return {"data_parallel_size": dp, **res}


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(res: dict) -> str:
    lines = [f"date {res['date']}, GPU {res['gpu']}, torch {res['torch']}, command `{res['command']}`"]
    if "capacity" in res:
        lines += ["", "| engines | max tokens | ramp s | streams | TTFA p50 ms | TTFA p99 ms | underruns (streams) | "
                      "errors | real time |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['dp']} | {r['max_tokens']} | {r['ramp_s']:g} | {r['n']} | {r['ttfa_p50_ms']:.0f} | "
                  f"{r['ttfa_p99_ms']:.0f} | {r['underruns']} ({r['streams_with_underrun']}) | {r['errors']} | "
                  f"{'yes' if r['real_time'] else 'no'} |" for r in res["capacity"]["rows"]]
        lines += ["", "largest real-time N: " + ", ".join(f"{k}: {v}" for k, v in res["capacity"]["largest_real_time_n"].items())]
    if "kill" in res:
        k = res["kill"]
        lines += ["", f"engine 0 killed {k['kill_after_s']:g} s into {k['streams']} streams ({k['data_parallel_size']} "
                      f"engines, in flight per engine {k['in_flight_per_engine_at_kill']}): {k['failed']} failed "
                      f"({', '.join(k['failed_codes']) or '-'}; the last {_s(k['failed_after_kill_s_max'])} s after the kill), "
                      f"{k['survivors']} completed with {k['survivor_underruns']} underruns, TTFA p99 "
                      f"{k['survivor_ttfa_p99_ms']:.0f} ms; /health showed it down after {_s(k['health_down_after_s'])} s, "
                      f"healthy again after {_s(k['healthy_again_after_s'])} s (pid {k['killed_pid']} -> "
                      f"{k['restarted_pid']}); took new work: {k['restarted_engine_took_work']} "
                      f"({k['after_restart_errors']} errors after the restart)"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="capacity,kill", help="comma-separated: capacity, kill")
    ap.add_argument("--cpu", action="store_true", help="the embedded tiny model on CPU engines (a harness check)")
    ap.add_argument("--data-parallel-sizes", default="1,2", help="one server per value (serve --data-parallel-size)")
    ap.add_argument("--streams", default="64,128,256,400,512,640,800", help="concurrency levels (sessions)")
    ap.add_argument("--max-tokens", default="350,1000", help="utterance lengths (350: ~4 s of audio, 1000: ~12 s)")
    ap.add_argument("--ramp-s", default="0,2", help="stream starts spread over this many seconds (0: together)")
    ap.add_argument("--text", default=TEXT, help="what every session speaks")
    ap.add_argument("--max-num-seqs", type=int, default=512, help="serve --max-num-seqs (per engine)")
    ap.add_argument("--max-model-len", type=int, default=1536)
    ap.add_argument("--server-args", default="", help="more `serve` arguments for every server")
    ap.add_argument("--kill-streams", type=int, default=400, help="kill: sessions in flight when engine 0 is killed")
    ap.add_argument("--kill-engine-after-s", type=float, default=6.0, help="kill: seconds into the level")
    add_out_arg(ap, "dp")
    args = ap.parse_args()
    secs = set(args.sections.split(","))
    out = Path(args.out)
    res = run_header()
    if "capacity" in secs:
        res["capacity"] = run_capacity(args, out)
    if "kill" in secs:
        res["kill"] = run_kill(args, out)
    write_results(out, res, render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
