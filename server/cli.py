"""`omnistream serve | client | bench` — the console script."""

from __future__ import annotations

import argparse
import sys


def _serve_parser(sub) -> None:
    """Every option comes from a config dataclass (its default and help stated there once)."""
    from runner.config import CacheConfig, ProcessConfig, RunnerConfig, SchedulerConfig
    from runner.vllm_engine.config import VllmConfig
    from server.settings import ModelSource, ServerSettings
    from streaming.knobs import add_arguments

    p = sub.add_parser("serve", help="run the server (no arguments: the embedded tiny default, which speaks noise)")
    add_arguments(p.add_argument_group("model"), ModelSource)
    add_arguments(p.add_argument_group("server"), ServerSettings)
    for title, cls in (("scheduler", SchedulerConfig), ("KV cache", CacheConfig), ("runner", RunnerConfig),
                       ("engine process", ProcessConfig), ("vLLM backend", VllmConfig)):
        add_arguments(p.add_argument_group(title), cls)
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, ... (default: OMNISTREAM_LOG_LEVEL or INFO)")


def _client_parser(sub) -> None:
    p = sub.add_parser("client", help="talk to a running server")
    p.add_argument("mode", choices=["speak", "ws", "zmq"], help="speak: POST /v1/audio/speech; ws: WebSocket session; zmq: ZeroMQ tokens")
    p.add_argument("text", help="text to speak (zmq: the prompt)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--zmq-endpoint", default="tcp://127.0.0.1:5555")
    p.add_argument("--voice", default=None)
    p.add_argument("--format", default="wav", help="speak: any response_format (mp3, opus, aac, flac, wav, pcm, "
                   "pcm_16000, ulaw_8000, mp3_44100_128, ...); ws: wav or pcm (default: wav)")
    p.add_argument("-o", "--output", default="out.wav")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-tokens", type=int, default=64)


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="serving benchmark: N concurrent WebSocket TTS streams read in real time")
    p.add_argument("--url", default=None, help="benchmark a running server; default: start one on the embedded model")
    p.add_argument("--streams", default="1,4,16", help="comma-separated concurrency levels")
    p.add_argument("--text", default="Hello there. This is a short benchmark sentence for streaming speech.")
    p.add_argument("--max-tokens", type=int, default=210)
    p.add_argument("--ramp-s", default="0", help="comma-separated start spreads: each level runs once per value, its "
                   "streams starting evenly over that many seconds (0: all at once, the burst case)")
    p.add_argument("--out", default=None, help="write a markdown table here")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnistream", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    _client_parser(sub)
    _bench_parser(sub)
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        from server.main import serve

        return serve(args)
    if args.cmd == "client":
        from streaming.cli_client import run_client

        return run_client(args)
    from server.bench import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
