"""Python clients of omnistream's ZeroMQ API (sync and asyncio). The messages are
streaming/zmq_protocol.py's (docs/zmq.md for other languages: any language with ZeroMQ and
msgpack can do the same).

    with ZmqClient("tcp://127.0.0.1:5555", api_key=None) as c:  # the server's --api-key, if any
        for step in c.generate(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 8},
                               hidden_state_layers=[-1]):
            print(step.token_ids, None if step.hidden is None else step.hidden.shape)

Liveness needs nothing from the caller: the server heartbeats the connection (ZMTP PING,
answered by libzmq itself) and aborts the requests of a connection that closes or goes silent.
`ping()` is an explicit round trip (is the server up and does it take my key?).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from streaming.zmq_protocol import (
    OVERLOADED,
    ErrorReply,
    PongReply,
    StepReply,
    ZmqRequest,
    decode_reply,
    encode,
    unpack_tensor,
)


class ZmqRequestError(RuntimeError):
    def __init__(self, code: str, message: str, param: str | None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.param = code, message, param


@dataclass
class Step:
    id: str
    token_ids: list[int]
    hidden: np.ndarray | None  # [n_positions, n_layers, hidden]; bf16 arrives as raw uint16
    hidden_positions: tuple[int, int] | None
    audio: np.ndarray | None  # int16 PCM
    finished: bool
    finish_reason: str | None
    usage: dict | None
    frames: np.ndarray | None = None  # multi-codebook models: [len(token_ids), K] int64 codes


_OVERFLOW = object()  # queued for a consumer that fell too far behind


def _step(reply: StepReply | ErrorReply | PongReply, frames: list) -> Step:
    """The Step a reply describes (its tensors viewed in frames); an error reply raises."""
    if isinstance(reply, ErrorReply):
        raise ZmqRequestError(reply.code, reply.message, reply.param)
    if isinstance(reply, PongReply):
        raise ZmqRequestError("invalid_request", f"a pong answered request {reply.id}", None)
    hp = reply.hidden_positions
    return Step(
        id=reply.id,
        token_ids=reply.token_ids,
        hidden=unpack_tensor(reply.hidden, frames),
        hidden_positions=tuple(hp) if hp else None,
        audio=unpack_tensor(reply.audio, frames),
        finished=reply.finished,
        finish_reason=reply.finish_reason,
        usage=reply.usage,
        frames=unpack_tensor(reply.frames, frames),
    )


def _generate(rid: str, key: str | None, prompt_token_ids: list[int] | None, prompt: str | None,
              sampling: dict | None, hidden_state_layers: list[int] | None) -> bytes:
    return encode(ZmqRequest("generate", rid, api_key=key, prompt_token_ids=prompt_token_ids, prompt=prompt,
                             sampling=sampling or None, hidden_state_layers=hidden_state_layers or None))


def _speech(rid: str, key: str | None, text: str, voice: str | None, sampling: dict | None) -> bytes:
    return encode(ZmqRequest("speech", rid, api_key=key, input=text, voice=voice, sampling=sampling or None))


def _append(rid: str, key: str | None, text: str, final: bool) -> bytes:
    return encode(ZmqRequest("append", rid, api_key=key, input=text, final=final))


def _abort(rid: str, key: str | None) -> bytes:
    return encode(ZmqRequest("abort", rid, api_key=key))


def _ping(rid: str, key: str | None) -> bytes:
    return encode(ZmqRequest("ping", rid, api_key=key))


def _pong(reply: StepReply | ErrorReply | PongReply) -> None:
    if isinstance(reply, ErrorReply):
        raise ZmqRequestError(reply.code, reply.message, reply.param)


class ZmqClient:
    """Blocking client: one request at a time per client object. `api_key`: the server's
    --api-key (sent in every message), None when it has none."""

    def __init__(self, endpoint: str, timeout_s: float = 60.0, *, api_key: str | None = None):
        self.api_key = api_key
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.timeout_ms = int(timeout_s * 1000)

    def close(self) -> None:
        self.sock.close(0)

    def __enter__(self) -> ZmqClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _stream(self, payload: bytes | None, rid: str) -> Iterator[Step]:
        if payload is not None:  # None: sent already
            self.sock.send(payload)
        done = False
        try:
            while True:
                if not self.sock.poll(self.timeout_ms):
                    raise TimeoutError(f"no reply for request {rid} within {self.timeout_ms} ms")
                frames = self.sock.recv_multipart()
                reply = decode_reply(frames[0])
                if reply.id != rid and reply.id != "":
                    continue  # a late reply of an earlier, abandoned request (or a late pong)
                step = _step(reply, frames)  # "": a frame the server could not read, i.e. ours
                yield step
                if step.finished:
                    done = True
                    return
        finally:
            if not done:
                self.sock.send(_abort(rid, self.api_key))

    def ping(self) -> float:
        """Round-trip seconds of a ping; ZmqRequestError (e.g. `unauthorized`) or TimeoutError."""
        rid = uuid.uuid4().hex
        t0 = time.monotonic()
        self.sock.send(_ping(rid, self.api_key))
        while True:
            if not self.sock.poll(self.timeout_ms):
                raise TimeoutError(f"no pong within {self.timeout_ms} ms")
            reply = decode_reply(self.sock.recv_multipart()[0])
            if reply.id in (rid, ""):
                _pong(reply)
                return time.monotonic() - t0

    def generate(self, *, prompt_token_ids: list[int] | None = None, prompt: str | None = None,
                 sampling: dict | None = None, hidden_state_layers: list[int] | None = None,
                 request_id: str | None = None) -> Iterator[Step]:
        rid = request_id or uuid.uuid4().hex
        return self._stream(_generate(rid, self.api_key, prompt_token_ids, prompt, sampling, hidden_state_layers), rid)

    def speech(self, text: str, *, voice: str | None = None, sampling: dict | None = None,
               request_id: str | None = None) -> Iterator[Step]:
        rid = request_id or uuid.uuid4().hex
        return self._stream(_speech(rid, self.api_key, text, voice, sampling), rid)

    def speech_streamed(self, pieces: list[str], *, voice: str | None = None, sampling: dict | None = None,
                        request_id: str | None = None, interval_s: float = 0.0) -> Iterator[Step]:
        """Speak a text sent in pieces (stream_input): the first with the request, the others
        as appends `interval_s` apart (the last one final), then the replies; a model that
        speaks whole texts only answers with an error naming stream_input."""
        rid = request_id or uuid.uuid4().hex
        first = encode(ZmqRequest("speech", rid, api_key=self.api_key, input=pieces[0], voice=voice,
                                  sampling=sampling or None, stream_input=True, final=len(pieces) == 1))
        self.sock.send(first)
        for i, piece in enumerate(pieces[1:], start=2):
            time.sleep(interval_s)
            self.sock.send(_append(rid, self.api_key, piece, i == len(pieces)))
        return self._stream(None, rid)


class AsyncZmqClient:
    """asyncio client: many concurrent requests over one socket, replies routed by id.
    `api_key`: the server's --api-key (sent in every message), None when it has none."""

    def __init__(self, endpoint: str, queue_bound: int = 1024, *, api_key: str | None = None):
        self.api_key = api_key
        self._ctx = zmq.asyncio.Context.instance()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self._queues: dict[str, asyncio.Queue] = {}
        self._bound = queue_bound
        self._reader: asyncio.Task | None = None
        self._ids = itertools.count()

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
        self.sock.close(0)

    async def __aenter__(self) -> AsyncZmqClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                reply = decode_reply(frames[0])
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not a reply this client can read, so no request to route it to
            q = self._queues.get(reply.id)
            if q is None:
                continue
            try:
                q.put_nowait((reply, frames))
            except asyncio.QueueFull:
                # That consumer is `queue_bound` steps behind. Raising here would kill the reader
                # that serves every request on this socket; end just that request instead.
                del self._queues[reply.id]
                q.get_nowait()
                q.put_nowait(_OVERFLOW)

    async def _stream(self, payload: bytes, rid: str) -> AsyncIterator[Step]:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        q: asyncio.Queue = asyncio.Queue(self._bound)
        self._queues[rid] = q
        done = False
        try:
            await self.sock.send(payload)
            while True:
                item = await q.get()
                if item is _OVERFLOW:
                    raise ZmqRequestError(OVERLOADED, f"request {rid}: the consumer fell {self._bound} steps behind", None)
                step = _step(*item)
                yield step
                if step.finished:
                    done = True
                    return
        finally:
            self._queues.pop(rid, None)
            if not done:
                await self.sock.send(_abort(rid, self.api_key))

    async def ping(self) -> float:
        """Round-trip seconds of a ping; ZmqRequestError (e.g. `unauthorized`)."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        rid = f"ping-{uuid.uuid4().hex[:8]}-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue(1)
        self._queues[rid] = q
        t0 = time.monotonic()
        try:
            await self.sock.send(_ping(rid, self.api_key))
            reply, _ = await q.get()
        finally:
            self._queues.pop(rid, None)
        _pong(reply)
        return time.monotonic() - t0

    def generate(self, *, prompt_token_ids: list[int] | None = None, prompt: str | None = None,
                 sampling: dict | None = None, hidden_state_layers: list[int] | None = None,
                 request_id: str | None = None) -> AsyncIterator[Step]:
        rid = request_id or f"{uuid.uuid4().hex[:8]}-{next(self._ids)}"
        return self._stream(_generate(rid, self.api_key, prompt_token_ids, prompt, sampling, hidden_state_layers), rid)

    def speech(self, text: str, *, voice: str | None = None, sampling: dict | None = None,
               request_id: str | None = None) -> AsyncIterator[Step]:
        rid = request_id or f"{uuid.uuid4().hex[:8]}-{next(self._ids)}"
        return self._stream(_speech(rid, self.api_key, text, voice, sampling), rid)
