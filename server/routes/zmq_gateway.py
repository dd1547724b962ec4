"""ZeroMQ API for programmatic clients: a ROUTER socket (loopback by default).

The messages are streaming/zmq_protocol.py's (docs/zmq.md for other languages). Ids are the
client's; the gateway namespaces them per connection so two clients may use the same id. A
client's requests are aborted when it sends `abort`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import msgspec
import zmq
import zmq.asyncio

from server.engine_api import EngineOverloaded, EngineUnavailable
from streaming.ipc import AddRequest, RequestOutput
from streaming.sampling_params import InvalidRequest, decode_sampling_params
from streaming.zmq_protocol import (
    INVALID_REQUEST,
    OVERLOADED,
    UNAVAILABLE,
    ErrorReply,
    StepReply,
    ZmqRequest,
    decode_request,
    encode,
    pack_tensor,
)

log = logging.getLogger("omnistream.zmq")


class ZmqGateway:
    def __init__(self, engine, tokenizer, profile, endpoint: str, max_message_bytes: int = 1 << 20):
        self.engine, self.tokenizer, self.profile = engine, tokenizer, profile
        self.endpoint = endpoint
        self.max_message_bytes = max_message_bytes
        self._ctx = zmq.asyncio.Context.instance()
        self._tasks: dict[tuple[bytes, str], asyncio.Task] = {}
        self._loop_task: asyncio.Task | None = None

    async def start(self) -> None:
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        self.sock.bind(self.endpoint)
        self._loop_task = asyncio.create_task(self._serve())

    async def close(self) -> None:
        if self._loop_task:
            self._loop_task.cancel()
        for t in list(self._tasks.values()):
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self.sock.close(0)

    async def _send(self, ident: bytes, header: StepReply | ErrorReply, frames: list) -> None:
        await self.sock.send_multipart([ident, encode(header), *frames], copy=False)

    async def _error(self, ident: bytes, rid: str, code: str, message: str, param: str | None = None) -> None:
        await self._send(ident, ErrorReply(rid, code, message, param), [])

    async def _serve(self) -> None:
        while True:
            ident, *rest = await self.sock.recv_multipart()
            if len(rest) != 1:
                await self._error(ident, "", INVALID_REQUEST, "expected exactly one msgpack frame", None)
                continue
            try:
                msg = decode_request(rest[0])
            except (msgspec.ValidationError, msgspec.DecodeError) as e:
                await self._error(ident, "", INVALID_REQUEST, f"bad message: {e}", None)
                continue
            key = (ident, msg.id)
            if msg.type == "abort":
                t = self._tasks.pop(key, None)
                if t is not None:
                    t.cancel()  # the generator's close aborts it in the engine
                continue
            if msg.type not in ("generate", "speech"):
                await self._error(ident, msg.id, INVALID_REQUEST, f"type: unknown message type {msg.type!r}", "type")
                continue
            if key in self._tasks:
                await self._error(ident, msg.id, INVALID_REQUEST, f"id: {msg.id!r} is already running", "id")
                continue
            task = asyncio.create_task(self._run(ident, msg))
            self._tasks[key] = task
            task.add_done_callback(lambda _t, k=key: self._tasks.pop(k, None) if self._tasks.get(k) is _t else None)

    def _build(self, msg: ZmqRequest) -> AddRequest:
        sampling = decode_sampling_params(msg.sampling)
        rid = f"zmq-{uuid.uuid4().hex}"
        if msg.type == "speech":
            if not msg.input:
                raise InvalidRequest("input", "must be a non-empty string")
            voice = msg.voice or self.profile.default_voice
            if voice not in self.profile.voices:
                raise InvalidRequest("voice", f"unknown voice {voice!r}; available: {', '.join(self.profile.voices)}")
            base = msgspec.structs.asdict(self.profile.sampling)
            base.update(msg.sampling)
            sampling = decode_sampling_params(base)
            prompt = self.profile.build_prompt(self.tokenizer, voice, msg.input)
            return AddRequest(rid, prompt, sampling, audio=True)
        if msg.prompt_token_ids is not None:
            prompt = msg.prompt_token_ids
        elif msg.prompt:
            prompt = self.tokenizer.encode(msg.prompt, add_bos=self.tokenizer.bos_token_id is not None)
        else:
            raise InvalidRequest("prompt_token_ids", "give prompt_token_ids or prompt")
        return AddRequest(rid, prompt, sampling, hidden_state_layers=msg.hidden_state_layers)

    async def _run(self, ident: bytes, msg: ZmqRequest) -> None:
        try:
            req = self._build(msg)
            async with contextlib.aclosing(self.engine.generate(req)) as stream:
                async for out in stream:
                    await self._send_step(ident, msg.id, out)
        except InvalidRequest as e:
            await self._error(ident, msg.id, INVALID_REQUEST, str(e), e.field)
        except EngineOverloaded as e:
            await self._error(ident, msg.id, OVERLOADED, str(e))
        except EngineUnavailable as e:
            await self._error(ident, msg.id, UNAVAILABLE, str(e))

    async def _send_step(self, ident: bytes, rid: str, out: RequestOutput) -> None:
        frames: list = []
        usage = None
        if out.finished:
            usage = {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
                     "cached_tokens": out.num_cached_tokens}
        header = StepReply(
            rid, out.new_token_ids, pack_tensor(out.hidden, frames),
            list(out.hidden_positions) if out.hidden is not None else [],
            pack_tensor(out.audio, frames), out.finished, out.finish_reason, usage,
        )
        if out.error and out.finished:
            header.finish_reason = out.finish_reason or "error"
            header.usage = (usage or {}) | {"error": out.error}
        await self._send(ident, header, frames)
