"""Soak: thousands of sessions over minutes against a real server (issue 32, item 6).

    python -m deploy.bench.soak [--duration 180] [--sessions 4000] [--concurrency 24]
                                [--mix stream=30,http=15,generate=15,zmq=10,eleven=5,disconnect=15,idle=10]
                                [--stall-every 30 --stall-s 8]

starts `python -m server.cli serve` on the embedded default (or --model), keeps `--concurrency`
client sessions running until `--duration` or `--sessions` is reached, and checks:

- every session ran to its expected end: a seeded request's audio or tokens equal the same
  request's reference run alone (byte for byte but 1-LSB float noise, same length), so every
  delivered chunk came in order and exactly once; the count also matches the final usage
  (audio frames = audio tokens // 7, 2048 samples each, on the Orpheus layout);
- no refusal (429 / overloaded) at a load under the server's limits;
- front-end and engine RSS, sampled over time: growth after warm-up under --rss-growth-mb;
- at the end every KV block free, no request or codec stream left (GET /v1/engine/stats);
- no starvation: the time to first audio of sessions started while a stalled reader (a
  client that stops reading its socket) was connected is not worse than without one;
- SIGTERM: exit 0, no traceback in the server's output.

Session kinds (--mix weights): stream (WS /v1/audio/speech/stream), http (POST
/v1/audio/speech, chunked PCM), generate (WS /v1/generate/stream), zmq (ZeroMQ generate, a
connection per request), eleven (ElevenLabs stream-input), disconnect (a speech stream or
HTTP request dropped after its first audio), idle (a session that sends nothing for --idle-s).
Besides the mix, every --stall-every seconds two stalled readers (raw WebSockets with a tiny
receive buffer: one asks for long speech, one for a generate stream with every hidden state of a
long prompt, more than the socket buffers hold) stop reading for --stall-s, then vanish.

Results (results.json, results.md) go to --out ($OUT, else .bench/soak/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from deploy.bench.soak_driver import Soak
from deploy.bench.soak_report import render, summarize, verdict  # noqa: F401  (re-exported for tests)
from deploy.bench.soak_server import (
    DEFAULT_MIX,
    ROOT,
    Config,
    Outcome,  # noqa: F401
    Server,
    parse_mix,
)


async def soak(cfg: Config, workdir: Path) -> dict:
    """Start a server, soak it, SIGTERM it; the results dict (see summarize, + shutdown)."""
    server = Server(workdir, cfg.max_num_seqs, cfg.model)
    try:
        await server.wait_ready()
        res = await Soak(cfg, server).run()
        res["shutdown"] = server.sigterm()
    finally:
        server.kill()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=Config.duration_s, help="seconds of load (default %(default)s)")
    ap.add_argument("--sessions", type=int, default=Config.sessions, help="stop after this many sessions (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=Config.concurrency, help="sessions in flight at once (default %(default)s)")
    ap.add_argument("--mix", default=DEFAULT_MIX, help=f"kind=weight,... (default {DEFAULT_MIX})")
    ap.add_argument("--stall-every", type=float, default=Config.stall_every_s,
                    help="heavy requests start this often (s), alternately stalled and read")
    ap.add_argument("--stall-s", type=float, default=Config.stall_s, help="how long a stalled reader stops reading")
    ap.add_argument("--idle-s", type=float, default=Config.idle_s, help="how long an idle session sends nothing")
    ap.add_argument("--max-num-seqs", type=int, default=Config.max_num_seqs, help="the server's --max-num-seqs")
    ap.add_argument("--rss-growth-mb", type=float, default=Config.rss_growth_mb, help="RSS growth after warm-up counted as flat")
    ap.add_argument("--model", default=Config.model, help="model folder (default: the embedded tiny default)")
    ap.add_argument("--machine", default=os.environ.get("SOAK_MACHINE", ""), help="machine named in the results")
    ap.add_argument("--seed", type=int, default=Config.seed)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / ".bench" / "soak"),
                    help="results folder (default: $OUT, else .bench/soak/)")
    a = ap.parse_args()
    cfg = Config(a.duration, a.sessions, a.concurrency, parse_mix(a.mix), a.stall_every, a.stall_s, a.idle_s,
                 max_num_seqs=a.max_num_seqs, rss_growth_mb=a.rss_growth_mb, seed=a.seed, model=a.model)
    with tempfile.TemporaryDirectory(prefix="omnistream-soak-") as tmp:
        res = asyncio.run(soak(cfg, Path(tmp)))
    res = {"date": time.strftime("%Y-%m-%d"), "machine": a.machine, "command": " ".join(["python -m deploy.bench.soak", *sys.argv[1:]]), **res}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    md = render(res)
    (out / "results.md").write_text(md)
    print(md)
    bad = verdict(res)
    for b in bad:
        print("FAIL:", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
