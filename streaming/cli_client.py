"""`omnistream client speak|ws|zmq TEXT`: small command-line clients of a running server.

speak  POST /v1/audio/speech (OpenAI shape), streamed into `-o` as the bytes arrive
ws     one /v1/audio/speech/stream session: config, the text, close; PCM or WAV into `-o`
zmq    ZeroMQ `generate` with TEXT as the prompt; prints the sampled tokens of every step

Only aiohttp, pyzmq and msgspec (server dependencies) are used, so the client works from the
server's own environment without the test extras.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

from streaming.encoders import PCM_SAMPLE_BYTES, wav_header

SAMPLE_RATE = 24000  # the server states it per stream; this is only the fallback
READ_TIMEOUT_S = 120.0


class ClientError(RuntimeError):
    """The server refused or failed the request (message is the server's)."""


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_text(status: int, body: bytes) -> str:
    try:
        err = json.loads(body)["error"]
        return f"HTTP {status}: {err.get('message')} (param={err.get('param')}, code={err.get('code')})"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:500].decode(errors='replace')}"


def _report(what: str, nbytes: int, pcm_bytes: int, sample_rate: int, ttfa: float | None, total: float, out: str) -> None:
    audio_s = pcm_bytes / PCM_SAMPLE_BYTES / sample_rate
    first = f"{ttfa * 1000:.0f} ms" if ttfa is not None else "n/a"
    print(f"{what}: wrote {nbytes} bytes ({audio_s:.2f} s of audio) to {out}; "
          f"first audio after {first}, done after {total:.2f} s", file=sys.stderr)


async def speak(args: argparse.Namespace) -> int:
    body = {"model": "omnistream", "input": args.text, "response_format": args.format,
            "max_new_tokens": args.max_tokens}
    if args.voice:
        body["voice"] = args.voice
    started = time.monotonic()
    ttfa = None
    written = 0
    timeout = aiohttp.ClientTimeout(total=None, sock_read=READ_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with http.post(args.url.rstrip("/") + "/v1/audio/speech", json=body, headers=_headers(args.api_key)) as r:
            if r.status != 200:
                raise ClientError(_error_text(r.status, await r.read()))
            rate = int(r.headers.get("X-Sample-Rate", SAMPLE_RATE))
            with open(args.output, "wb") as f:
                async for chunk in r.content.iter_any():
                    if ttfa is None:
                        ttfa = time.monotonic() - started
                    f.write(chunk)
                    written += len(chunk)
    total = time.monotonic() - started
    if args.format in ("pcm", "wav"):
        header = 44 if args.format == "wav" else 0
        _report("speak", written, max(0, written - header), rate, ttfa, total, args.output)
    else:  # a compressed format: its duration is the decoder's business
        first = f"{ttfa * 1000:.0f} ms" if ttfa is not None else "n/a"
        print(f"speak: wrote {written} bytes of {args.format} to {args.output}; first bytes after {first}, "
              f"done after {total:.2f} s", file=sys.stderr)
    return 0


async def ws_session(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/").replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    config: dict = {"type": "session.config", "max_new_tokens": args.max_tokens}
    if args.voice:
        config["voice"] = args.voice
    pcm = bytearray()
    rate = SAMPLE_RATE
    started = time.monotonic()
    ttfa = None
    errors: list[str] = []
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url + "/v1/audio/speech/stream", headers=_headers(args.api_key),
                                   receive_timeout=READ_TIMEOUT_S) as ws:
            await ws.send_json(config)
            await ws.send_json({"type": "input.text", "text": args.text})
            await ws.send_json({"type": "session.close"})  # flushes the rest, then session.done
            async for msg in ws:
                if msg.type is aiohttp.WSMsgType.BINARY:
                    if ttfa is None:
                        ttfa = time.monotonic() - started
                    pcm += msg.data
                elif msg.type is aiohttp.WSMsgType.TEXT:
                    event = json.loads(msg.data)
                    kind = event.get("type")
                    if kind == "audio.start":
                        rate = int(event.get("sample_rate", rate))
                    elif kind == "error":
                        errors.append(f"{event.get('code')}: {event.get('message')} (param={event.get('param')})")
                        print(f"server error: {errors[-1]}", file=sys.stderr)
                    elif kind == "session.done":
                        break
                else:  # closed or failed before session.done
                    break
    data = bytes(pcm)
    if args.format == "wav":
        data = wav_header(rate, len(pcm)) + data
    Path(args.output).write_bytes(data)
    _report("ws", len(data), len(pcm), rate, ttfa, time.monotonic() - started, args.output)
    if errors:
        raise ClientError("; ".join(errors))
    return 0


def zmq_generate(args: argparse.Namespace) -> int:
    from streaming.zmq_client import ZmqClient  # pyzmq only here

    with ZmqClient(args.zmq_endpoint, timeout_s=READ_TIMEOUT_S, api_key=args.api_key) as client:
        for i, step in enumerate(client.generate(prompt=args.text, sampling={"max_tokens": args.max_tokens})):
            print(f"step {i}: {step.token_ids}")
            if step.finished:
                print(f"finished: {step.finish_reason} usage={json.dumps(step.usage, sort_keys=True)}")
    return 0


def run_client(args: argparse.Namespace) -> int:
    from streaming.zmq_client import ZmqRequestError

    try:
        if args.mode == "speak":
            return asyncio.run(speak(args))
        if args.mode == "ws":
            return asyncio.run(ws_session(args))
        return zmq_generate(args)
    except (ClientError, ZmqRequestError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        print(f"error: cannot talk to the server: {e}", file=sys.stderr)
        return 2
