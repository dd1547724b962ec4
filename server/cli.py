"""`omnistream serve | client | bench` — the console script."""

from __future__ import annotations

import argparse
import sys


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the server (no arguments: the embedded tiny default, which speaks noise)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP/WebSocket bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="local Hugging Face folder (config.json + safetensors + tokenizer); default: the embedded tiny model")
    p.add_argument("--codec", default=None, help="local SNAC folder (config.json + pytorch_model.bin); overrides omnistream.json's codec.path")
    p.add_argument("--zmq-endpoint", default="tcp://127.0.0.1:5555",
                   help="ZeroMQ ROUTER endpoint for programmatic clients ('none' disables; binding a non-loopback address needs --zmq-allow-remote)")
    p.add_argument("--zmq-allow-remote", action="store_true", help="allow the ZeroMQ endpoint on a non-loopback address")
    p.add_argument("--api-key", default=None, help="require this key on HTTP and WebSocket requests")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together (batch rows)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    p.add_argument("--admission-wait-ms", type=float, default=20.0,
                   help="with >= 64 requests running, admit new ones in groups at most this often (0: every step)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-memory-gb", type=float, default=None, help="KV cache size (default: enough for every sequence, capped by free memory)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--codec-dtype", default="auto", help="SNAC decode dtype: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads of a CPU engine (default: half the cores, at most 4)")
    p.add_argument("--no-async-scheduling", action="store_true", help="wait for each step's tokens before scheduling the next")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--no-hidden-state-graphs", action="store_true",
                   help="do not capture the all-layers decode graphs (decode steps with a hidden-state request run eagerly)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-concurrent-requests", type=int, default=256)
    p.add_argument("--random-weights", action="store_true", help="benchmarks only: take the shape from --model's config.json, use random weights")
    p.add_argument("--cache-dir", default=None, help="where the embedded default is built (default ~/.cache/omnistream)")
    p.add_argument("--log-level", default=None)


def _client_parser(sub) -> None:
    p = sub.add_parser("client", help="talk to a running server")
    p.add_argument("mode", choices=["speak", "ws", "zmq"], help="speak: POST /v1/audio/speech; ws: WebSocket session; zmq: ZeroMQ tokens")
    p.add_argument("text", help="text to speak (zmq: the prompt)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--zmq-endpoint", default="tcp://127.0.0.1:5555")
    p.add_argument("--voice", default=None)
    p.add_argument("--format", default="wav", choices=["wav", "pcm"])
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
