"""The soak's client sessions of every kind, each checked against its request run alone
(deploy/bench/soak.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import socket
import time

import aiohttp
import msgspec
import numpy as np
import zmq
import zmq.asyncio

from deploy.bench.soak_server import (
    FRAME_SAMPLES,
    GEN_POOL,
    LSB_TOLERANCE,
    SPEECH_POOL,
    TOKENS_PER_FRAME,
    WAIT_S,
    Config,
    Outcome,
    Server,
)
from streaming.zmq_protocol import ErrorReply, StepReply, decode_reply

# ---- sessions ---------------------------------------------------------------------------------------


class SessionFailed(Exception):
    pass


class Refused(Exception):
    """429 or an overloaded event: counted apart (the load is meant to stay under the limits)."""


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


class SoakClients:
    """The client side of every session kind, each checked against its request run alone."""

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
        async with self.http.ws_connect(self.server.ws_url + "/v1/text-to-speech/tara/stream-input?output_format=pcm_24000",
                                         max_msg_size=0) as ws:
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


