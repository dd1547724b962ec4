"""Python clients of omnistream's ZeroMQ API (sync and asyncio). See server/routes/zmq_gateway.py and
docs/zmq.md for the wire format; any language with ZeroMQ and msgpack can do the same.

    with ZmqClient("tcp://127.0.0.1:5555") as c:
        for step in c.generate(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 8},
                               hidden_state_layers=[-1]):
            print(step.token_ids, None if step.hidden is None else step.hidden.shape)
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import msgspec
import numpy as np
import zmq
import zmq.asyncio


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


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()
_OVERFLOW = object()  # queued for a consumer that fell too far behind


def _tensor(ref, frames) -> np.ndarray | None:
    if ref is None:
        return None
    frame, dtype, shape = ref
    return np.frombuffer(frames[frame], dtype=np.dtype(dtype)).reshape(shape)


def _parse(frames: list) -> Step:
    h = _dec.decode(frames[0])
    if h["type"] == "error":
        raise ZmqRequestError(h["code"], h["message"], h.get("param"))
    hp = h.get("hidden_positions")
    return Step(
        id=h["id"],
        token_ids=h.get("token_ids", []),
        hidden=_tensor(h.get("hidden"), frames),
        hidden_positions=tuple(hp) if hp else None,
        audio=_tensor(h.get("audio"), frames),
        finished=h.get("finished", False),
        finish_reason=h.get("finish_reason"),
        usage=h.get("usage"),
    )


def _request(kind: str, rid: str, **fields) -> bytes:
    return _enc.encode({"type": kind, "id": rid, **{k: v for k, v in fields.items() if v is not None}})


class ZmqClient:
    """Blocking client: one request at a time per client object."""

    def __init__(self, endpoint: str, timeout_s: float = 60.0):
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.timeout_ms = int(timeout_s * 1000)

    def close(self) -> None:
        self.sock.close(0)

    def __enter__(self) -> "ZmqClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _stream(self, payload: bytes, rid: str) -> Iterator[Step]:
        self.sock.send(payload)
        done = False
        try:
            while True:
                if not self.sock.poll(self.timeout_ms):
                    raise TimeoutError(f"no reply for request {rid} within {self.timeout_ms} ms")
                step = _parse(self.sock.recv_multipart())
                if step.id != rid:
                    continue  # a late reply of an earlier, abandoned request
                yield step
                if step.finished:
                    done = True
                    return
        finally:
            if not done:
                self.sock.send(_request("abort", rid))

    def generate(self, *, prompt_token_ids: list[int] | None = None, prompt: str | None = None,
                 sampling: dict | None = None, hidden_state_layers: list[int] | None = None,
                 request_id: str | None = None) -> Iterator[Step]:
        rid = request_id or uuid.uuid4().hex
        return self._stream(_request("generate", rid, prompt_token_ids=prompt_token_ids, prompt=prompt,
                                     sampling=sampling or {}, hidden_state_layers=hidden_state_layers), rid)

    def speech(self, text: str, *, voice: str | None = None, sampling: dict | None = None,
               request_id: str | None = None) -> Iterator[Step]:
        rid = request_id or uuid.uuid4().hex
        return self._stream(_request("speech", rid, input=text, voice=voice, sampling=sampling or {}), rid)


class AsyncZmqClient:
    """asyncio client: many concurrent requests over one socket, replies routed by id."""

    def __init__(self, endpoint: str, queue_bound: int = 1024):
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

    async def __aenter__(self) -> "AsyncZmqClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            h = _dec.decode(frames[0])
            rid = h.get("id", "")
            q = self._queues.get(rid)
            if q is None:
                continue
            try:
                q.put_nowait(frames)
            except asyncio.QueueFull:
                # That consumer is `queue_bound` steps behind. Raising here would kill the reader
                # that serves every request on this socket; end just that request instead.
                del self._queues[rid]
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
                frames = await q.get()
                if frames is _OVERFLOW:
                    raise ZmqRequestError("overloaded", f"request {rid}: the consumer fell {self._bound} steps behind", None)
                step = _parse(frames)
                yield step
                if step.finished:
                    done = True
                    return
        finally:
            self._queues.pop(rid, None)
            if not done:
                await self.sock.send(_request("abort", rid))

    def generate(self, *, prompt_token_ids: list[int] | None = None, prompt: str | None = None,
                 sampling: dict | None = None, hidden_state_layers: list[int] | None = None,
                 request_id: str | None = None) -> AsyncIterator[Step]:
        rid = request_id or f"{uuid.uuid4().hex[:8]}-{next(self._ids)}"
        return self._stream(_request("generate", rid, prompt_token_ids=prompt_token_ids, prompt=prompt,
                                     sampling=sampling or {}, hidden_state_layers=hidden_state_layers), rid)

    def speech(self, text: str, *, voice: str | None = None, sampling: dict | None = None,
               request_id: str | None = None) -> AsyncIterator[Step]:
        rid = request_id or f"{uuid.uuid4().hex[:8]}-{next(self._ids)}"
        return self._stream(_request("speech", rid, input=text, voice=voice, sampling=sampling or {}), rid)
