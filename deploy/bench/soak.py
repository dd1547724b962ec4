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
import base64
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import numpy as np
import zmq
import zmq.asyncio

from streaming.zmq_protocol import ErrorReply, StepReply, decode_reply

ROOT = Path(__file__).resolve().parents[2]
FRAME_SAMPLES, TOKENS_PER_FRAME = 2048, 7  # the Orpheus/SNAC layout of the embedded default
WAIT_S = 60.0
LSB_TOLERANCE = 1  # batched float noise; a misplaced chunk differs by thousands

DEFAULT_MIX = "stream=30,http=15,generate=15,zmq=10,eleven=5,disconnect=15,idle=10"
# (text, seed, max_new_tokens): short utterances, one text segment each
SPEECH_POOL = [("Hello there.", 3, 84), ("How are you today?", 5, 70), ("Soak test.", 11, 56), ("One more.", 17, 98)]
GEN_POOL = [([1, 2, 3, 4, 5], 1, 24), ([7, 9, 11], 2, 16), ([40, 41, 42, 43], 3, 32)]  # (prompt ids, seed, max_tokens)
# Stalled readers ask for more than the kernel buffers between them and the server hold (Linux
# autotunes a send buffer up to tcp_wmem's 4 MiB), so the server's writes to them really block:
# speech takes minutes of generation to get there; a generate stream with every hidden state of
# a 3,600-token prompt does it with its first frame (3600 x 3 x 128 floats on the embedded default).
STALL_TEXT = "This is a long text that a stalled reader asks for. " * 40
STALL_SPEECH = ("/v1/audio/speech/stream", [{"type": "session.config", "max_new_tokens": 1200},
                                            {"type": "input.text", "text": STALL_TEXT}, {"type": "session.close"}])
STALL_HIDDEN = ("/v1/generate/stream", [{"prompt_token_ids": [(7 * i) % 1000 for i in range(3600)],
                                         "hidden_state_layers": [0, 1, 2],
                                         "sampling": {"max_tokens": 64, "ignore_eos": True}}])


@dataclass
class Config:
    duration_s: float = 180.0
    sessions: int = 4000
    concurrency: int = 24
    mix: dict[str, float] = field(default_factory=lambda: parse_mix(DEFAULT_MIX))
    stall_every_s: float = 30.0  # a speech and a generate staller start this often ...
    stall_s: float = 8.0  # ... and stop reading for this long
    idle_s: float = 4.0
    sample_s: float = 1.0
    max_num_seqs: int = 48
    rss_growth_mb: float = 48.0
    seed: int = 0
    model: str | None = None


def parse_mix(text: str) -> dict[str, float]:
    mix = {k.strip(): float(v) for k, v in (kv.split("=") for kv in text.split(",") if kv.strip())}
    unknown = set(mix) - set(KINDS)
    if unknown:
        raise ValueError(f"--mix: unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    return mix


# ---- the server under test ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return kids


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


class Server:
    """`python -m server.cli serve` on loopback ports, its output in a log file."""

    def __init__(self, workdir: Path, max_num_seqs: int, model: str | None = None):
        workdir.mkdir(parents=True, exist_ok=True)
        self.http_port, self.zmq_port = _free_port(), _free_port()
        self.log_path = workdir / "server.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (the server's stdout for its whole life; closed in sigterm)
        cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(self.http_port),
               "--zmq-endpoint", f"tcp://127.0.0.1:{self.zmq_port}", "--cache-dir", str(workdir / "cache"),
               "--device", "cpu", "--max-num-seqs", str(max_num_seqs), *(["--model", model] if model else [])]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        self.ws_url = f"ws://127.0.0.1:{self.http_port}"
        self.zmq_endpoint = f"tcp://127.0.0.1:{self.zmq_port}"

    async def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.output()}")
                try:
                    async with http.get(self.base_url + "/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError(f"server not ready in {timeout:.0f} s:\n{self.output()}")

    def engine_pid(self) -> int | None:
        for pid in _children(self.proc.pid):
            try:
                if b"runner.engine.process" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except FileNotFoundError:
                continue
        return None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def sigterm(self, grace_s: float = 20.0) -> dict:
        """SIGTERM and wait: exit code, seconds to exit, traceback lines in the output."""
        tree = [self.proc.pid, *_children(self.proc.pid)]
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        took = time.monotonic() - t0
        for pid in tree[1:]:
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        lines = self.output().splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
        return {"exit_code": rc, "exit_s": round(took, 2), "tracebacks": len(starts),
                "traceback_excerpts": ["\n".join(lines[max(0, i - 8):i + 20]) for i in starts]}

    def kill(self) -> None:
        if self.proc.poll() is None:
            for pid in _children(self.proc.pid):
                os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()


# ---- sessions ---------------------------------------------------------------------------------------


class SessionFailed(Exception):
    pass


class Refused(Exception):
    """429 or an overloaded event: counted apart (the load is meant to stay under the limits)."""


@dataclass
class Outcome:
    kind: str
    started: float  # monotonic
    ended: float = 0.0
    ok: bool = False
    error: str = ""
    refused: bool = False
    ttfa_s: float | None = None  # first audio (speech kinds) or first token (generate kinds)
    chunks: int = 0


def frames_of(output_tokens: int, finish_reason: str) -> int:
    return (output_tokens - (1 if finish_reason == "stop" else 0)) // TOKENS_PER_FRAME


def same_audio(got: bytes, ref: bytes) -> str:
    """'' when `got` is `ref` but float noise, else why not (a lost, repeated or moved chunk)."""
    if len(got) != len(ref):
        return f"{len(got)} bytes of audio, the reference has {len(ref)}"
    if got == ref:
        return ""
    diff = np.abs(np.frombuffer(got, "<i2").astype(np.int32) - np.frombuffer(ref, "<i2").astype(np.int32))
    if int(diff.max()) > LSB_TOLERANCE:
        return f"audio differs from the reference by up to {int(diff.max())} at sample {int(diff.argmax())}"
    return ""


class Soak:
    def __init__(self, cfg: Config, server: Server):
        self.cfg, self.server = cfg, server
        self.rng = random.Random(cfg.seed)
        self.zctx = zmq.asyncio.Context()
        self.ref_speech: dict[tuple[str, str], bytes] = {}  # (protocol, text) -> PCM
        self.ref_tokens: dict[tuple[int, ...], list[int]] = {}
        self.stall_windows: list[tuple[float, float]] = []  # a stalled reader connected
        self.control_windows: list[tuple[float, float]] = []  # the same requests, read
        self.outcomes: list[Outcome] = []
        self.http: aiohttp.ClientSession

    # -- the kinds --

    async def speech_ws(self, o: Outcome, item, drop_after_first: bool = False) -> bytes:
        text, seed, n = item
        pcm, utterances = bytearray(), []
        async with self.http.ws_connect(self.server.ws_url + "/v1/audio/speech/stream", max_msg_size=0) as ws:
            await ws.send_json({"type": "session.config", "seed": seed, "max_new_tokens": n})
            await ws.send_json({"type": "input.text", "text": text})
            await ws.send_json({"type": "session.close"})
            async for msg in ws:
                if msg.type is aiohttp.WSMsgType.BINARY:
                    if o.ttfa_s is None:
                        o.ttfa_s = time.monotonic() - o.started
                    o.chunks += 1
                    if len(utterances) != 1 or "done" in utterances[0]:
                        raise SessionFailed("audio outside an utterance")
                    pcm += msg.data
                    if drop_after_first:
                        return bytes(pcm)  # the context manager closes: a client gone mid-stream
                    continue
                ev = json.loads(msg.data)
                kind = ev.get("type")
                if kind == "error":
                    if ev.get("code") == "overloaded":
                        raise Refused(ev.get("message"))
                    raise SessionFailed(f"error event {ev}")
                if kind == "audio.start":
                    if ev["utterance"] != len(utterances):
                        raise SessionFailed(f"utterance {ev['utterance']} started out of order")
                    utterances.append({})
                elif kind == "audio.done":
                    usage = ev["usage"]
                    want = frames_of(usage["output_tokens"], ev["finish_reason"]) * FRAME_SAMPLES * 2
                    if len(pcm) != want:
                        raise SessionFailed(f"{len(pcm)} bytes for {usage['output_tokens']} tokens ({want} expected)")
                    utterances[-1]["done"] = True
                elif kind == "session.done":
                    break
            if ws.close_code not in (None, 1000) and not drop_after_first:
                raise SessionFailed(f"closed {ws.close_code}")
        if not drop_after_first and (len(utterances) != 1 or "done" not in utterances[0]):
            raise SessionFailed(f"session ended with utterances {utterances}")
        return bytes(pcm)

    async def speech_http(self, o: Outcome, item, drop_after_first: bool = False) -> bytes:
        text, seed, n = item
        body = {"input": text, "seed": seed, "max_new_tokens": n, "response_format": "pcm"}
        pcm = bytearray()
        async with self.http.post(self.server.base_url + "/v1/audio/speech", json=body) as r:
            if r.status == 429:
                raise Refused(await r.text())
            if r.status != 200:
                raise SessionFailed(f"HTTP {r.status}: {(await r.text())[:300]}")
            async for chunk in r.content.iter_any():
                if o.ttfa_s is None:
                    o.ttfa_s = time.monotonic() - o.started
                o.chunks += 1
                pcm += chunk
                if drop_after_first:
                    r.close()
                    return bytes(pcm)
        return bytes(pcm)

    async def check_speech(self, proto: str, item, pcm: bytes) -> None:
        ref = self.ref_speech.get((proto, item[0]))
        if ref is None:
            raise SessionFailed(f"no reference for {item}")
        if why := same_audio(pcm, ref):
            raise SessionFailed(f"{proto} {item[0]!r}: {why}")

    async def kind_stream(self, o: Outcome) -> None:
        item = self.rng.choice(SPEECH_POOL)
        await self.check_speech("ws", item, await self.speech_ws(o, item))

    async def kind_http(self, o: Outcome) -> None:
        item = self.rng.choice(SPEECH_POOL)
        await self.check_speech("http", item, await self.speech_http(o, item))

    async def generate_ws(self, o: Outcome, item) -> list[int]:
        prompt, seed, n = item
        tokens: list[int] = []
        async with self.http.ws_connect(self.server.ws_url + "/v1/generate/stream", max_msg_size=0) as ws:
            await ws.send_json({"prompt_token_ids": prompt, "sampling": {"seed": seed, "max_tokens": n, "ignore_eos": True}})
            async for msg in ws:
                ev = json.loads(msg.data)
                if ev["type"] == "step":
                    if o.ttfa_s is None:
                        o.ttfa_s = time.monotonic() - o.started
                    o.chunks += 1
                    tokens += ev["token_ids"]
                elif ev["type"] == "done":
                    if ev["usage"]["completion_tokens"] != len(tokens):
                        raise SessionFailed(f"{len(tokens)} tokens streamed, usage says {ev['usage']}")
                    return tokens
                elif ev.get("code") == "overloaded":
                    raise Refused(ev["message"])
                else:
                    raise SessionFailed(f"event {ev}")
        raise SessionFailed("generate stream closed before done")

    async def generate_zmq(self, o: Outcome, item) -> list[int]:
        prompt, seed, n = item
        sock = self.zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.server.zmq_endpoint)
        tokens: list[int] = []
        try:
            msg = {"type": "generate", "id": "soak", "prompt_token_ids": prompt,
                   "sampling": {"seed": seed, "max_tokens": n, "ignore_eos": True}}
            await sock.send(msgspec.msgpack.encode(msg))
            while True:
                if not await sock.poll(int(WAIT_S * 1000)):
                    raise SessionFailed("no ZeroMQ reply in time")
                reply = decode_reply((await sock.recv_multipart())[0])
                if isinstance(reply, ErrorReply):
                    if reply.code == "overloaded":
                        raise Refused(reply.message)
                    raise SessionFailed(f"zmq error {reply}")
                assert isinstance(reply, StepReply)
                if reply.token_ids and o.ttfa_s is None:
                    o.ttfa_s = time.monotonic() - o.started
                o.chunks += 1
                tokens += reply.token_ids
                if reply.finished:
                    if (reply.usage or {}).get("completion_tokens") != len(tokens):
                        raise SessionFailed(f"{len(tokens)} tokens streamed, usage says {reply.usage}")
                    return tokens
        finally:
            sock.close(0)

    async def check_tokens(self, item, tokens: list[int]) -> None:
        ref = self.ref_tokens[tuple(item[0]) + (item[1], item[2])]
        if tokens != ref:
            raise SessionFailed(f"tokens {tokens[:12]}... differ from the reference {ref[:12]}...")

    async def kind_generate(self, o: Outcome) -> None:
        item = self.rng.choice(GEN_POOL)
        await self.check_tokens(item, await self.generate_ws(o, item))

    async def kind_zmq(self, o: Outcome) -> None:
        item = self.rng.choice(GEN_POOL)
        await self.check_tokens(item, await self.generate_zmq(o, item))

    async def kind_eleven(self, o: Outcome) -> None:
        audio = 0
        async with self.http.ws_connect(self.server.ws_url + "/v1/text-to-speech/tara/stream-input", max_msg_size=0) as ws:
            await ws.send_json({"text": " "})
            await ws.send_json({"text": "Hello from the soak. "})
            await ws.send_json({"text": ""})
            async for msg in ws:
                ev = json.loads(msg.data)
                if ev.get("audio"):
                    if o.ttfa_s is None:
                        o.ttfa_s = time.monotonic() - o.started
                    o.chunks += 1
                    audio += len(base64.b64decode(ev["audio"]))
                elif ev.get("isFinal"):
                    break
                elif ev.get("type") == "error":
                    if ev.get("code") == "overloaded":
                        raise Refused(ev["message"])
                    raise SessionFailed(f"error event {ev}")
        if ws.close_code not in (None, 1000):
            raise SessionFailed(f"closed {ws.close_code}")
        if audio % 2:
            raise SessionFailed(f"{audio} bytes: not whole s16 samples")

    async def kind_disconnect(self, o: Outcome) -> None:
        item = (self.rng.choice(SPEECH_POOL)[0], self.rng.randrange(1000), 700)
        if self.rng.random() < 0.5:
            await self.speech_ws(o, item, drop_after_first=True)
        else:
            await self.speech_http(o, item, drop_after_first=True)

    async def stall(self, o: Outcome, path: str, messages: list[dict], reads: bool) -> None:
        """A raw WebSocket client with a small receive buffer that asks for more than the
        socket buffers hold and stops reading: the server's writes to it block. Then it
        vanishes (no close frame). With `reads`, the control: the same requests, read."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.server.http_port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            writer.transport.abort()
            raise SessionFailed(f"upgrade refused: {head[:100]!r}")
        for m in messages:
            writer.write(_client_frame(json.dumps(m)))
        await writer.drain()
        t0 = time.monotonic()
        try:
            if reads:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(_drain(reader), self.cfg.stall_s)
            else:
                await asyncio.sleep(self.cfg.stall_s)  # not reading
        finally:
            (self.control_windows if reads else self.stall_windows).append((t0, time.monotonic()))
            writer.transport.abort()

    async def stall_schedule(self, done: asyncio.Event) -> None:
        """Heavy requests on a duty cycle, alternately stalled and read (the control), so the
        others' TTFA while a reader stalls is compared with the same work read normally: the
        long prompt's prefill costs everyone the same either way; a stall must cost nothing."""
        tasks = []
        reads = False
        while True:
            try:
                await asyncio.wait_for(done.wait(), self.cfg.stall_every_s / 2)
                break
            except asyncio.TimeoutError:
                pass
            for path, messages in (STALL_SPEECH, STALL_HIDDEN):
                tasks.append(asyncio.create_task(self.one(
                    "heavy_read" if reads else "stall", lambda o, p=path, m=messages, r=reads: self.stall(o, p, m, r))))
            reads = not reads
            try:
                await asyncio.wait_for(done.wait(), self.cfg.stall_every_s / 2)
                break
            except asyncio.TimeoutError:
                pass
        await asyncio.gather(*tasks)

    async def kind_idle(self, o: Outcome) -> None:
        path = self.rng.choice(["/v1/audio/speech/stream", "/v1/text-to-speech/tara/stream-input", "/v1/generate/stream"])
        deadline = time.monotonic() + self.cfg.idle_s
        async with self.http.ws_connect(self.server.ws_url + path, max_msg_size=0) as ws:
            try:
                msg = await ws.receive(timeout=self.cfg.idle_s)
                while msg.type is aiohttp.WSMsgType.TEXT:  # session.created, or the inactivity event
                    msg = await ws.receive(timeout=max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return  # idled the whole time; closing is ours
            closed = msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED)
            if closed and ws.close_code not in (1000, 1001, 1008):  # 1008: the inactivity timeout
                raise SessionFailed(f"idle session closed {ws.close_code}")

    # -- driving --

    async def one(self, kind: str, run=None) -> None:
        o = Outcome(kind, time.monotonic())
        try:
            await asyncio.wait_for((run or getattr(self, f"kind_{kind}"))(o), WAIT_S + self.cfg.stall_s + self.cfg.idle_s)
            o.ok = True
        except Refused as e:
            o.refused, o.error = True, f"refused: {e}"[:300]
        except (SessionFailed, aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError, KeyError) as e:
            o.error = f"{type(e).__name__}: {e}"[:300]
        o.ended = time.monotonic()
        self.outcomes.append(o)

    async def references(self) -> None:
        """Every pooled request run alone once per protocol: the order / exactly-once oracle."""
        for item in SPEECH_POOL:
            o = Outcome("ref", time.monotonic())
            self.ref_speech[("ws", item[0])] = await self.speech_ws(o, item)
            self.ref_speech[("http", item[0])] = await self.speech_http(o, item)
        for item in GEN_POOL:
            o = Outcome("ref", time.monotonic())
            self.ref_tokens[tuple(item[0]) + (item[1], item[2])] = await self.generate_ws(o, item)

    async def sample_rss(self, stop: asyncio.Event, curve: list) -> None:
        front, engine = self.server.proc.pid, self.server.engine_pid()
        t0 = time.monotonic()
        while not stop.is_set():
            curve.append((round(time.monotonic() - t0, 1), rss_mb(front), rss_mb(engine), len(self.outcomes)))
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.sample_s)
            except asyncio.TimeoutError:
                pass

    async def engine_idle(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            async with self.http.get(self.server.base_url + "/v1/engine/stats") as r:
                stats = await r.json()
            idle = (stats["num_running"] == stats["num_waiting"] == 0 and stats["active_request_ids"] == []
                    and stats["num_free_blocks"] == stats["num_total_blocks"] and stats.get("num_codec_streams", 0) == 0)
            if idle or time.monotonic() > deadline:
                return stats | {"idle": idle}
            await asyncio.sleep(0.25)

    async def run(self) -> dict:
        cfg = self.cfg
        kinds, weights = zip(*[(k, w) for k, w in cfg.mix.items() if w > 0])
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=WAIT_S)) as self.http:
            await self.references()
            curve: list = []
            stop = asyncio.Event()
            sampler = asyncio.create_task(self.sample_rss(stop, curve))
            running: set[asyncio.Task] = set()
            load_done = asyncio.Event()
            stallers = asyncio.create_task(self.stall_schedule(load_done))
            t0 = time.monotonic()
            started = 0
            while started < cfg.sessions and time.monotonic() - t0 < cfg.duration_s:
                while len(running) >= cfg.concurrency:
                    _, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                running.add(asyncio.create_task(self.one(self.rng.choices(kinds, weights)[0])))
                started += 1
            load_done.set()
            await asyncio.gather(*running, stallers)
            wall = time.monotonic() - t0
            await asyncio.sleep(cfg.sample_s)
            stop.set()
            await sampler
            final = await self.engine_idle()
        self.zctx.destroy(0)
        return summarize(cfg, self.outcomes, curve, final, wall, self.stall_windows, self.control_windows)


async def _drain(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass


def _client_frame(text: str) -> bytes:
    """One masked text frame (a client must mask; RFC 6455 5.3)."""
    payload, mask = text.encode(), os.urandom(4)
    n = len(payload)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    masked = (np.frombuffer(payload, np.uint8) ^ np.resize(np.frombuffer(mask, np.uint8), n)).tobytes()
    return head + mask + masked


KINDS = ("stream", "http", "generate", "zmq", "eleven", "disconnect", "idle")  # the --mix kinds


# ---- the figures --------------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def rss_growth(curve: list, col: int) -> dict:
    """Retained growth after warm-up: the lowest RSS of the last 20% of samples minus the lowest
    of the 20%-40% window (the first 20% is warm-up: caches, arenas, first compiles). Lows, not
    medians: a long prefill's transient working set (GBs on the CPU) is not a leak; what stays
    after it is."""
    ys = [row[col] for row in curve if row[col] is not None]
    if len(ys) < 5:
        return {"samples": len(ys), "growth_mb": None}
    n = len(ys)
    base = min(ys[n // 5: max(n // 5 + 1, 2 * n // 5)])
    end = min(ys[-max(1, n // 5):])
    return {"samples": n, "start_mb": round(ys[0], 1), "warm_mb": round(base, 1), "end_mb": round(end, 1),
            "max_mb": round(max(ys), 1), "growth_mb": round(end - base, 1)}


def summarize(cfg: Config, outcomes: list[Outcome], curve: list, final: dict, wall: float,
              stall_windows: list[tuple[float, float]], control_windows: list[tuple[float, float]]) -> dict:
    by_kind: dict[str, dict] = {}
    for o in outcomes:
        k = by_kind.setdefault(o.kind, {"sessions": 0, "ok": 0, "failed": 0, "refused": 0, "chunks": 0})
        k["sessions"] += 1
        k["ok"] += o.ok
        k["failed"] += not o.ok and not o.refused
        k["refused"] += o.refused
        k["chunks"] += o.chunks

    def within(o: Outcome, windows: list[tuple[float, float]]) -> bool:
        return any(a < o.started + (o.ttfa_s or 0) and o.started < b for a, b in windows)

    ttfas = [o for o in outcomes if o.ok and o.kind in ("stream", "http") and o.ttfa_s is not None]
    with_stall = [o.ttfa_s for o in ttfas if within(o, stall_windows)]
    control = [o.ttfa_s for o in ttfas if within(o, control_windows) and not within(o, stall_windows)]
    quiet = [o.ttfa_s for o in ttfas if not within(o, stall_windows + control_windows)]
    p95_with, p95_control = _pct(with_stall, 0.95), _pct(control, 0.95)
    starved = None
    if p95_with is not None and p95_control is not None:
        starved = p95_with > max(2.0 * p95_control, p95_control + 1.0)
    without = control + quiet
    front, engine = rss_growth(curve, 1), rss_growth(curve, 2)
    failures = [f"{o.kind}: {o.error}" for o in outcomes if not o.ok and not o.refused]
    return {
        "config": asdict(cfg),
        "wall_s": round(wall, 1),
        "sessions": len(outcomes),
        "sessions_per_s": round(len(outcomes) / wall, 2) if wall else None,
        "ok": sum(o.ok for o in outcomes),
        "failed": len(failures),
        "refused": sum(o.refused for o in outcomes),
        "failures": failures[:20],
        "by_kind": by_kind,
        "ttfa_s": {"p50": _pct(without + with_stall, 0.5), "p95": _pct(without + with_stall, 0.95),
                   "max": _pct(without + with_stall, 1.0),
                   "p95_while_stalled": p95_with, "p95_same_work_read": p95_control, "p95_quiet": _pct(quiet, 0.95),
                   "n_while_stalled": len(with_stall), "n_same_work_read": len(control), "n_quiet": len(quiet),
                   "starved": starved},
        "rss": {"front_end": front, "engine": engine,
                "bound_mb": cfg.rss_growth_mb,
                "flat": all(g.get("growth_mb") is not None and g["growth_mb"] <= cfg.rss_growth_mb for g in (front, engine))},
        "rss_curve": curve,  # (t_s, front-end MB, engine MB, sessions done)
        "engine_at_end": final,
    }


def render(res: dict) -> str:
    cfg, t, rss = res["config"], res["ttfa_s"], res["rss"]
    lines = [
        f"# Soak ({res.get('date', '')}, {res.get('machine', '')})", "",
        f"`{res.get('command', '')}`", "",
        (f"{res['sessions']} sessions in {res['wall_s']} s ({res['sessions_per_s']}/s), concurrency {cfg['concurrency']}: "
         f"{res['ok']} ok, {res['failed']} failed, {res['refused']} refused"), "",
        "| kind | sessions | ok | failed | refused | chunks |", "| --- | --- | --- | --- | --- | --- |",
        *[f"| {k} | {v['sessions']} | {v['ok']} | {v['failed']} | {v['refused']} | {v['chunks']} |" for k, v in sorted(res["by_kind"].items())],
        "",
        (f"TTFA (stream + http): p50 {t['p50']} s, p95 {t['p95']} s, max {t['max']} s; p95 while readers were stalled "
         f"{t['p95_while_stalled']} s (n={t['n_while_stalled']}) vs {t['p95_same_work_read']} s while the same requests "
         f"were read (n={t['n_same_work_read']}), {t['p95_quiet']} s without either (n={t['n_quiet']}): "
         f"starved={t['starved']}"), "",
        (f"RSS growth after warm-up (bound {rss['bound_mb']} MB): front end {rss['front_end']}, engine {rss['engine']}: "
         f"flat={rss['flat']}"), "",
        "| t (s) | front end (MB) | engine (MB) | sessions done |", "| --- | --- | --- | --- |",
    ]
    curve = res["rss_curve"]
    step = max(1, len(curve) // 12)
    lines += [f"| {r[0]} | {r[1] and round(r[1], 1)} | {r[2] and round(r[2], 1)} | {r[3]} |" for r in curve[::step]]
    e = res["engine_at_end"]
    lines += ["", (f"Engine at the end: running {e['num_running']}, waiting {e['num_waiting']}, free blocks "
                   f"{e['num_free_blocks']}/{e['num_total_blocks']}, codec streams {e.get('num_codec_streams')}, "
                   f"idle={e['idle']}")]
    sd = res.get("shutdown", {})
    lines += ["", f"SIGTERM: exit {sd.get('exit_code')} in {sd.get('exit_s')} s, tracebacks {sd.get('tracebacks')}"]
    if res["failures"]:
        lines += ["", "Failures (first 20):", *[f"- {f}" for f in res["failures"]]]
    return "\n".join(lines) + "\n"


def verdict(res: dict) -> list[str]:
    """What failed, in words (empty: every property held)."""
    bad = []
    if res["failed"]:
        bad.append(f"{res['failed']} sessions failed: {res['failures'][:3]}")
    if res["refused"]:
        bad.append(f"{res['refused']} sessions refused (429 / overloaded) under the limits")
    if not res["rss"]["flat"]:
        bad.append(f"RSS grew: {res['rss']}")
    if not res["engine_at_end"]["idle"]:
        bad.append(f"engine not idle at the end: {res['engine_at_end']}")
    if res["ttfa_s"]["starved"]:
        bad.append(f"a stalled reader delayed the others: {res['ttfa_s']}")
    sd = res.get("shutdown", {})
    if sd.get("exit_code") != 0 or sd.get("tracebacks"):
        bad.append(f"shutdown: {sd}")
    return bad


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
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    ap.add_argument("--sessions", type=int, default=4000, help="stop after this many sessions (default 4000)")
    ap.add_argument("--concurrency", type=int, default=24, help="sessions in flight at once (default 24)")
    ap.add_argument("--mix", default=DEFAULT_MIX, help=f"kind=weight,... (default {DEFAULT_MIX})")
    ap.add_argument("--stall-every", type=float, default=30.0,
                    help="heavy requests start this often (s), alternately stalled and read")
    ap.add_argument("--stall-s", type=float, default=8.0, help="how long a stalled reader stops reading")
    ap.add_argument("--idle-s", type=float, default=4.0, help="how long an idle session sends nothing")
    ap.add_argument("--max-num-seqs", type=int, default=48, help="the server's --max-num-seqs")
    ap.add_argument("--rss-growth-mb", type=float, default=48.0, help="RSS growth after warm-up counted as flat")
    ap.add_argument("--model", default=None, help="model folder (default: the embedded tiny default)")
    ap.add_argument("--machine", default=os.environ.get("SOAK_MACHINE", ""), help="machine named in the results")
    ap.add_argument("--seed", type=int, default=0)
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
