"""ZeroMQ API for programmatic clients: a ROUTER socket (loopback by default).

The messages are streaming/zmq_protocol.py's (docs/zmq.md for other languages). Ids are the
client's; the gateway namespaces them per connection so two clients may use the same id.

Every frame gets an answer: a frame over `zmq_max_message_bytes`, an unreadable one, one
without the server's `api_key` or with a wrong field gets an error reply naming the limit or
the field in the client's terms, and the request does not run.

A speech request with `stream_input` takes its text in pieces ("append" messages, the last one
`final`): its Qwen3-TTS request starts as soon as the ids so far fix its prompt
(server/tts/qwen3_tts_prompt.py StreamedText: ids are final up to the text's last word) and the rest
of the text reaches the running request as it arrives (ipc.AppendText); a row whose next text
id has not come waits in the engine. At most MAX_PENDING_PIECES pieces wait unread, and the
whole text is bounded by max_input_chars.

A client's requests are aborted when it sends `abort`, and when its connection goes away:
ROUTER cannot see that by itself, so the socket monitor reports closed connections, and ZMTP
heartbeats (PING every third of `zmq_client_timeout_s`, answered by the peer's libzmq without
the application) close a connection that stays silent, e.g. a frozen or unplugged client.
Messages are mapped to their connection by the file descriptor they arrived on (SRCFD).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from server.engine_api import EngineOverloaded, EngineUnavailable
from server.settings import ServerSettings
from server.tts.streamed_speech import TextFeed, streamed_request
from streaming.ipc import AddRequest, RequestOutput
from streaming.sampling_params import InvalidRequest, SamplingParams
from streaming.schema import (
    MISSING,
    RequestLimits,
    SchemaError,
    check_text,
    generate_job,
    nested_names,
    sampling_params,
)
from streaming.zmq_protocol import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    NO_SPEECH,
    OVERLOADED,
    UNAUTHORIZED,
    UNAVAILABLE,
    ErrorReply,
    PongReply,
    RequestError,
    StepReply,
    ZmqRequest,
    encode,
    pack_tensor,
    peek,
    read_request,
)

log = logging.getLogger("omnistream.zmq")


@dataclass
class _TextIn:
    """A stream_input speech request's text still arriving: its unread pieces, and the
    characters taken so far (bounded by max_input_chars)."""

    queue: asyncio.Queue  # (piece, final)
    chars: int

# libzmq drops (unread, with the connection) frames over this many times the served limit:
# a bound on memory; between the two, the frame is read and answered with `too_large`.
HARD_LIMIT_FACTOR = 4
MAX_PENDING_PIECES = 256  # appends of one streamed text not yet read by its request
_MONITORED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED

# Engine-side field names -> the client's, per request shape (the engine sees token ids only).
_GENERATE_TEXT_FIELDS = {"prompt_token_ids": "prompt", "request_id": "id"}
_GENERATE_TOKEN_FIELDS = {"request_id": "id"}
_SPEECH_FIELDS = {"prompt_token_ids": "input", "request_id": "id", "audio": "type"}


class ZmqGateway:
    def __init__(self, engine, tokenizer, profile, settings: ServerSettings):
        self.engine, self.tokenizer, self.profile = engine, tokenizer, profile
        self.settings = settings
        self.endpoint = settings.zmq_endpoint
        self._api_key = settings.api_key.encode("utf-8", "surrogatepass") if settings.api_key else None
        self._ctx = zmq.asyncio.Context.instance()
        self._tasks: dict[tuple[bytes, str], asyncio.Task] = {}
        # stream_input speech requests still taking text
        self._inputs: dict[tuple[bytes, str], _TextIn] = {}
        self._idents_by_fd: dict[int, set[bytes]] = {}  # connections (by fd) -> identities seen on them
        self._closed_fds: set[int] = set()  # disconnected, and no connection accepted on the fd since
        self._loop_task: asyncio.Task | None = None

    async def start(self) -> None:
        s = self.settings
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, HARD_LIMIT_FACTOR * s.zmq_max_message_bytes + 4096)
        timeout_ms = max(100, int(s.zmq_client_timeout_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, max(30, timeout_ms // 3))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        self.sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)  # the client's libzmq may drop us as well
        self._monitor = self.sock.get_monitor_socket(_MONITORED)
        self.sock.bind(self.endpoint)
        self._loop_task = asyncio.create_task(self._serve())

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *([self._loop_task] if self._loop_task else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.sock.disable_monitor()
        self._monitor.close(0)
        self.sock.close(0)

    async def _send(self, ident: bytes, header: StepReply | ErrorReply | PongReply, frames: list) -> None:
        await self.sock.send_multipart([ident, encode(header), *frames], copy=False)

    async def _error(self, ident: bytes, rid: str, code: str, message: str, param: str | None = None) -> None:
        await self._send(ident, ErrorReply(rid, code, message, param), [])

    # ---- the socket loop ------------------------------------------------------------------------

    async def _serve(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            # Connection events first: a message's fd is judged against every event libzmq
            # emitted before the message could be read (a closed connection's fd may be reused).
            while self._monitor.get(zmq.EVENTS) & zmq.POLLIN:
                self._on_event(parse_monitor_message(await self._monitor.recv_multipart()))
            if self.sock.get(zmq.EVENTS) & zmq.POLLIN:
                await self._guarded(await self.sock.recv_multipart(copy=False))
            else:
                await poller.poll()

    async def _guarded(self, frames: list[zmq.Frame]) -> None:
        """One frame's handling; a bug in it is logged and answered internal_error, and the
        socket loop goes on serving every other client (an exception escaping here would end
        ZeroMQ for all of them, silently)."""
        try:
            await self._on_frames(frames)
        except Exception:
            log.exception("zmq gateway: handling a frame failed")
            await self._error(frames[0].bytes, "", INTERNAL_ERROR, "The server failed on this message; see its log.")

    def _on_event(self, event: dict) -> None:
        fd = int(event["value"])
        if event["event"] == zmq.EVENT_ACCEPTED:
            self._closed_fds.discard(fd)
            return
        self._closed_fds.add(fd)
        gone = self._idents_by_fd.pop(fd, set())
        for key in [k for k in self._tasks if k[0] in gone]:
            log.info("zmq client went away: aborting its request %r", key[1])
            self._tasks.pop(key).cancel()  # the generator's close aborts it in the engine

    async def _on_frames(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        fd = frames[-1].get(zmq.SRCFD) if len(frames) > 1 else -1
        if fd >= 0:
            if fd in self._closed_fds:
                return  # sent just before its connection closed: nobody would read the answer
            self._idents_by_fd.setdefault(fd, set()).add(ident)
        if len(frames) != 2:
            await self._error(ident, "", INVALID_REQUEST, "expected exactly one msgpack frame per request")
            return
        try:
            msg = self._read(frames[1].bytes)
        except RequestError as e:
            await self._send(ident, e.reply(), [])
            return
        key = (ident, msg.id)
        if msg.type == "abort":
            t = self._tasks.pop(key, None)
            if t is not None:
                t.cancel()  # the generator's close aborts it in the engine
        elif msg.type == "ping":
            await self._send(ident, PongReply(msg.id), [])
        elif msg.type == "append":
            await self._append(ident, msg)
        elif msg.type not in ("generate", "speech"):
            await self._error(ident, msg.id, INVALID_REQUEST,
                              f"type: unknown message type {msg.type!r} (generate, speech, append, abort, ping)",
                              "type")
        elif key in self._tasks:
            await self._error(ident, msg.id, INVALID_REQUEST, f"id: {msg.id!r} is already running", "id")
        else:
            pieces = None
            if msg.type == "speech" and msg.stream_input:  # the text's next pieces (_append)
                pieces = asyncio.Queue(MAX_PENDING_PIECES)
                pieces.put_nowait((msg.input or "", bool(msg.final)))  # first: appends queue behind it
                if not msg.final:
                    self._inputs[key] = _TextIn(pieces, len(msg.input or ""))
            task = asyncio.create_task(self._run(ident, msg, pieces))
            self._tasks[key] = task
            task.add_done_callback(lambda _t, k=key: self._tasks.pop(k, None) if self._tasks.get(k) is _t else None)

    def _read(self, frame: bytes) -> ZmqRequest:
        """The request, once the sender is known to hold the key (checked before anything else
        about the frame, as HTTP checks the bearer token before the body)."""
        if self._api_key is not None:
            rid, key = peek(frame)
            if not (isinstance(key, str) and hmac.compare_digest(key.encode("utf-8", "surrogatepass"), self._api_key)):
                raise RequestError(UNAUTHORIZED, "api_key: missing or incorrect; send the server's key (the one HTTP "
                                   "takes as a bearer token) in every message's `api_key`", "api_key", rid)
        return read_request(frame, self.settings.zmq_max_message_bytes)

    async def _append(self, ident: bytes, msg: ZmqRequest) -> None:
        """The next piece of a stream_input speech request's text."""
        t = self._inputs.get((ident, msg.id))
        if t is None:
            await self._error(ident, msg.id, INVALID_REQUEST, f"id: no speech request {msg.id!r} is taking text "
                              "(append follows a speech request with stream_input, until a final piece)", "id")
            return
        piece, limit = msg.input or "", self.settings.max_input_chars
        try:
            check_text(piece, "input", limit, allow_empty=True)
            if t.chars + len(piece) > limit:
                raise SchemaError("input", f"the streamed text would pass {limit} characters; this piece was dropped "
                                  "(send the text so far as final, and the rest as another request)")
        except SchemaError as e:  # the request goes on with the text it has
            await self._error(ident, msg.id, INVALID_REQUEST, str(e), e.field)
            return
        q = t.queue
        if q.full():
            await self._error(ident, msg.id, INVALID_REQUEST, f"input: more than {MAX_PENDING_PIECES} pieces "
                              "wait unread; send fewer, larger pieces", "input")
            return
        t.chars += len(piece)
        q.put_nowait((piece, bool(msg.final)))
        if msg.final:
            del self._inputs[(ident, msg.id)]

    # ---- one request --------------------------------------------------------------------------

    async def _build(self, msg: ZmqRequest) -> AddRequest:
        """The engine request, judged by streaming.schema exactly as HTTP and the WebSockets
        judge the same fields (SchemaError names the field)."""
        rid = f"zmq-{uuid.uuid4().hex}"
        limits = RequestLimits.of(self.engine.info, self.settings.max_input_chars)
        if msg.type == "speech":
            voice, sampling = self._speech_voice(msg)
            if msg.input is None:
                raise SchemaError("input", "this field is required", MISSING)
            text = check_text(msg.input, "input", limits.max_input_chars)
            prompt = self.profile.build_prompt(self.tokenizer, voice, text)
            return prompt.add_request(rid, sampling)
        job = generate_job(msg.generate_request(), SamplingParams(), limits)
        prompt = job.prompt_token_ids
        if prompt is None:  # text, already checked (Unicode, control characters, max_input_chars)
            prompt = await self.tokenizer.encode_async(job.prompt_text, add_bos=self.tokenizer.bos_token_id is not None)
            job.check_prompt(len(prompt), limits, "prompt")
        return AddRequest(rid, prompt, job.sampling, hidden_state_layers=job.hidden_state_layers)

    def _client_field(self, msg: ZmqRequest, field: str) -> str:
        """An engine-side field name in the terms of the client's request."""
        if msg.type == "speech":
            names = _SPEECH_FIELDS
        else:
            names = _GENERATE_TOKEN_FIELDS if msg.prompt_token_ids is not None else _GENERATE_TEXT_FIELDS
        return names.get(field, field)

    async def _streamed(self, msg: ZmqRequest, q: asyncio.Queue):
        """A stream_input speech request (server/tts/streamed_speech.py): its first piece is
        `input`, the others come through `q` (_append)."""
        voice, sampling = self._speech_voice(msg)
        check_text(msg.input or "", "input", self.settings.max_input_chars, allow_empty=True)  # queued already
        return await streamed_request(self.profile, self.tokenizer, self.engine, f"zmq-{uuid.uuid4().hex}", voice,
                                      sampling, q)

    def _speech_voice(self, msg: ZmqRequest) -> tuple[str, SamplingParams]:
        if not self.profile.speaks:
            raise RequestError(NO_SPEECH, "type: this model has no speech profile (a text model, or served "
                               "without a codec): use generate", "type", msg.id)
        if msg.stream_input and not self.profile.takes_streamed_text:
            raise SchemaError("stream_input", "this model speaks whole texts only (send the text in `input`)")
        voice = msg.voice or self.profile.default_voice
        if voice not in self.profile.voices:
            raise SchemaError("voice", f"unknown voice {voice!r}; available: {', '.join(self.profile.voices)}")
        limits = RequestLimits.of(self.engine.info, self.settings.max_input_chars)
        given = msg.sampling.given() if msg.sampling is not None else {}
        return voice, sampling_params(given, self.profile.sampling, limits, nested_names())

    async def _run(self, ident: bytes, msg: ZmqRequest, pieces: asyncio.Queue | None = None) -> None:
        feeder: TextFeed | None = None
        try:
            feed = None
            if pieces is not None:
                req, feed = await self._streamed(msg, pieces)
            else:
                req = await self._build(msg)
            feeder = TextFeed(feed, f"zmq gateway {msg.id!r}")
            async with contextlib.aclosing(self.engine.generate(req)) as stream:
                async for out in stream:
                    feeder.output()  # the request runs: feed it its text
                    await self._send_step(ident, msg.id, out)
        except RequestError as e:
            await self._send(ident, e.reply(), [])
        except SchemaError as e:  # judged here: already in the client's terms
            await self._error(ident, msg.id, INVALID_REQUEST, str(e), e.field)
        except InvalidRequest as e:  # the engine's refusal, in its own field names
            field = self._client_field(msg, e.field)
            message = str(e)
            if field != e.field:
                message = f"{field}: {message.split(': ', 1)[-1]}"
            await self._error(ident, msg.id, INVALID_REQUEST, message, field)
        except EngineOverloaded as e:
            await self._error(ident, msg.id, OVERLOADED, str(e))
        except EngineUnavailable as e:
            await self._error(ident, msg.id, UNAVAILABLE, str(e))
        finally:
            self._inputs.pop((ident, msg.id), None)
            if feeder is not None:
                feeder.close()

    async def _send_step(self, ident: bytes, rid: str, out: RequestOutput) -> None:
        frames: list = []
        usage = None
        if out.finished:
            usage = {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
                     "cached_tokens": out.num_cached_tokens}
        header = StepReply(
            rid, out.new_token_ids, pack_tensor(out.hidden, frames),
            list(out.hidden_positions) if out.hidden is not None else [],
            pack_tensor(out.audio, frames), out.finished, out.finish_reason, usage, pack_tensor(out.frames, frames),
        )
        if out.error and out.finished:
            header.finish_reason = out.finish_reason or "error"
            header.usage = (usage or {}) | {"error": out.error}
        await self._send(ident, header, frames)
