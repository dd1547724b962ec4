"""ElevenLabs' text-to-speech WebSockets, so an ElevenLabs client (LiveKit's and Pipecat's
plugins, the official SDK) works by changing its base URL.

WS /v1/text-to-speech/{voice_id}/stream-input          one stream per socket
WS /v1/text-to-speech/{voice_id}/multi-stream-input    many contexts per socket

Query: output_format (default mp3_44100_128, any name of streaming.encoders: pcm_16000,
ulaw_8000, opus_48000_64, ...), model_id (any: one model is served), auto_mode (true: a text
message ending a sentence is generated at once), sync_alignment, inactivity_timeout (seconds a
socket, and on multi-stream each context, may sit idle; 1 to ws_max_inactivity_timeout_s),
apply_text_normalization, language_code, enable_logging, enable_ssml_parsing,
optimize_streaming_latency, seed: all judged before the upgrade (a mistake is a 400 naming the
parameter); the switches that shape ElevenLabs' own service have no effect here.

Client messages (server.tts.elevenlabs_messages.ElevenLabsInput, one shape):
  {"text": " ", "voice_settings"?, "generation_config"?, "xi_api_key"? | "authorization"?,
   "context_id"?}    opens the stream (multi: the context); settings only here
  {"text": "...", "flush"?: true, "context_id"?}    text to speak; flush speaks what is buffered
  stream-input:  {"text": ""} ends the input: everything is spoken, then {"isFinal": true}, close 1000
  multi-stream:  {"text": "", "context_id"} keeps a context alive (with "flush": speaks its buffer)
                 {"context_id", "close_context": true}: buffered text not yet flushed is dropped,
                 what was flushed is spoken, then {"isFinal": true, "contextId"}
                 {"close_socket": true}: every context speaks what it has, then close 1000
Server messages:
  {"audio": base64 of the output format, "isFinal": false, "normalizedAlignment", "alignment",
   "contextId"(multi)}; the alignment is {"chars", "charStartTimesMs", "charDurationsMs"}, null
  when the message starts no character. Its times count from the start of that message's audio
  (ElevenLabs' documented meaning, which Pipecat reads: it adds each message's span to its own
  clock), or, with `sync_alignment=true` (which LiveKit's plugin always sends, and reads the
  times as offsets into the context's audio), from the context's first audio.
  {"isFinal": true, "contextId"(multi)}
  errors: {"type": "error", "error": code, "code": code, "message", "param", "contextId"?} (LiveKit
  and Pipecat read `error` and fail that context; the SDK reads `message`).

The API key, when the server has one: in the upgrade's header (xi-api-key / Authorization) or
query, or else in the first message (xi_api_key, "xi-api-key" or authorization); a missing or
wrong key there is an `unauthorized` error and close 1008.

A context idle (no message, nothing to speak) for inactivity_timeout is closed with a
`context_timeout` error naming it; the socket idle that long is closed as every session is
(server.ws_common). At most ContextLimits.max_contexts contexts are open at once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

import numpy as np
from aiohttp import WSCloseCode, web

from server.context import ServerContext, get_ctx
from server.sampling import SPEECH_FIELDS, request_limits
from server.tts.contexts import ContextLimits, ContextSocket, ContextWork
from server.auth import presented_key
from server.tts.elevenlabs_messages import (
    ElevenLabsInput,
    ElevenLabsQuery,
    judge,
    parse_query,
    query_seed,
    ws_alignment,
)
from server.tts.encoding import EncodedStream
from server.tts.speaker import Refusal, Sink, Speaker, Utterance, Voicing
from server.tts.text_segmenter import TextSegmenter
from server.tts.timings import CharTime, SegmentTimer, SpeakingRate
from server.ws_common import BadMessage, SessionActivity, guard_session, new_websocket, session_activity
from streaming.encoders import b64
from streaming.schema import MISSING, SchemaError, check_text, convert, sampling_params

log = logging.getLogger(__name__)

STREAM_INPUT = "/v1/text-to-speech/{voice_id}/stream-input"
MULTI_STREAM_INPUT = "/v1/text-to-speech/{voice_id}/multi-stream-input"
DEFAULT_CONTEXT = ""  # multi-stream messages without a context_id
_SENTENCE_END = (".", "!", "?", "。", "！", "？", "\n")


class Context(Sink):
    """One ElevenLabs stream: its text buffer, its Speaker, its encoder and its clock."""

    def __init__(self, socket: ElevenLabsSocket, context_id: str | None, voicing: Voicing):
        self.socket = socket
        self.id = context_id  # None on stream-input (replies carry no contextId)
        settings = socket.ctx.settings
        self.segmenter = TextSegmenter(settings.segment_min_clause_chars, settings.segment_max_chars)
        self.work = ContextWork(socket.shared_work)
        self.speaker = Speaker(socket.ctx, self, socket.endpoint, self.work)
        self.voicing = voicing
        self.encoder = EncodedStream(socket.query.output_format, socket.ctx.profile.sample_rate)
        self.rate = SpeakingRate()
        self.timer: SegmentTimer | None = None
        self.spoken_segments = 0
        self.spoken_s = 0.0  # audio of the context's finished segments
        self.context_clock = socket.query.sync_alignment
        self.last_message = time.monotonic()
        self.closing = False

    def start(self) -> None:
        self.speaker.start()

    def tagged(self, event: dict) -> dict:
        return event if self.id is None else {**event, "contextId": self.id}

    # ---- input ----

    async def text(self, text: str, flush: bool) -> None:
        segments = self.segmenter.push(text) if text else []
        stripped = self.segmenter.pending.rstrip()
        if flush or (self.socket.query.auto_mode and stripped.endswith(_SENTENCE_END)):
            segments += self.segmenter.flush()
        await self.speak(segments)

    async def speak(self, segments: list[str]) -> None:
        refusal = self.speaker.say(segments, self.voicing)
        if refusal is Refusal.OVERFLOW:
            limit = self.socket.ctx.settings.ws_max_pending_segments
            await self.socket.send_error("input_overflow", f"Over {limit} text segments are waiting to be spoken; "
                                         "this text was dropped. Send text no faster than it is spoken.", "text", self.id)
        elif refusal is Refusal.OVERLOADED:
            assert self.speaker.refused is not None
            self.socket.ctx.metrics.rejected.labels(self.socket.endpoint).inc()
            await self.socket.send_error("overloaded", self.speaker.refused.message, "text", self.id)

    async def end(self, speak_buffer: bool) -> None:
        """No more input: speak what was flushed (and the buffer too when asked), then isFinal."""
        if self.closing:
            return
        self.closing = True
        if speak_buffer:
            await self.speak(self.segmenter.flush())
        else:
            self.segmenter = TextSegmenter(self.socket.ctx.settings.segment_min_clause_chars,
                                           self.socket.ctx.settings.segment_max_chars)
        self.speaker.end_input()

    async def cancel(self) -> None:
        await self.speaker.cancel()

    @property
    def idle(self) -> bool:
        return not self.work.held

    # ---- the speaker's events ----

    async def utterance_start(self, utt: Utterance) -> None:
        lead = " " if self.spoken_segments else ""  # the space between segments, as in the text
        self.spoken_segments += 1
        self.timer = SegmentTimer(lead + utt.text, self.socket.ctx.profile.sample_rate, self.rate)

    async def utterance_audio(self, utt: Utterance, samples: np.ndarray) -> None:
        assert self.timer is not None
        base = self._base()
        chars = self.timer.advance(samples.size)
        data = await self.encoder.encode(samples)
        await self._send_audio(data, chars, base)

    def _base(self) -> float:
        """Where alignment times count from, in the segment's clock (see the module doc)."""
        assert self.timer is not None
        return -self.spoken_s if self.context_clock else self.timer.seconds

    async def _send_audio(self, data: bytes, chars: list[CharTime], base: float) -> None:
        if not data and not chars:
            return  # the codec holds these samples until it has a frame
        align = ws_alignment(chars, base)
        await self.socket.send(self.tagged(
            {"audio": b64(data), "isFinal": False, "normalizedAlignment": align, "alignment": align}
        ))

    async def utterance_done(self, utt: Utterance, last) -> None:
        if self.timer is not None:
            base = self._base()
            await self._send_audio(b"", self.timer.finish(), base)
            self.spoken_s += self.timer.seconds
            self.timer = None

    async def utterance_failed(self, utt: Utterance, code: str, message: str, param: str | None) -> None:
        await self.socket.send_error(code, message, param, self.id)
        if code == "engine_unavailable":
            self.socket.closer.request(WSCloseCode.INTERNAL_ERROR, b"engine unavailable")

    async def speech_finished(self) -> None:
        tail = await self.encoder.finish()
        if tail:
            await self.socket.send(self.tagged({"audio": b64(tail), "isFinal": False,
                                                "normalizedAlignment": None, "alignment": None}))
        await self.socket.context_finished(self)

    async def crashed(self) -> None:
        try:
            await self.socket.send_error("internal_error", "The session failed on the server; see its log.", None, self.id)
        except ConnectionError:  # reset, or aiohttp's "Connection lost"
            pass
        self.socket.closer.request(WSCloseCode.INTERNAL_ERROR, b"internal error")


class ElevenLabsSocket(ContextSocket):
    """One socket: reads messages, routes them to contexts, owns every close (the reader)."""

    def __init__(self, ctx: ServerContext, ws: web.WebSocketResponse, voicing: Voicing, activity: SessionActivity,
                 query: ElevenLabsQuery, multi: bool, needs_key: bool, limits: ContextLimits = ContextLimits()):
        super().__init__(ctx, ws, activity, MULTI_STREAM_INPUT if multi else STREAM_INPUT, limits)
        self.voicing = voicing
        self.query = query
        self.multi = multi
        self.needs_key = needs_key
        self.contexts: dict[str, Context] = {}
        self.closing_socket = False
        self.first_message = True

    # ---- output ----

    async def send_error(self, code: str, message: str, param: str | None = None, context_id: str | None = None) -> None:
        event = {"type": "error", "error": code, "code": code, "message": message, "param": param}
        if context_id is not None:
            event["contextId"] = context_id
        await self.send(event)

    # ---- the session ----

    def _side_task(self) -> asyncio.Task | None:
        return asyncio.create_task(self._sweep()) if self.multi else None

    async def _on_binary(self) -> None:
        await self.send_error("binary_not_allowed", "Binary frames are not accepted; send JSON text frames.")

    def _context_id(self, obj: dict) -> str | None:
        if not self.multi:
            return None  # stream-input errors name no context
        raw_id = obj.get("context_id", obj.get("contextId"))
        return raw_id if isinstance(raw_id, str) else None

    async def _on_object(self, obj: dict) -> None:
        await self._on_message(convert(obj, ElevenLabsInput))

    def _check_key(self, msg: ElevenLabsInput) -> None:
        key = msg.key
        expected = self.ctx.settings.api_key
        if expected is None or not self.needs_key:
            return
        if key is None or not hmac.compare_digest(key.encode(), expected.encode()):
            raise BadMessage("unauthorized", "A valid API key is required: the xi-api-key header, or xi_api_key in "
                             "the first message.", "xi_api_key", close=WSCloseCode.POLICY_VIOLATION)
        self.needs_key = False

    async def _on_message(self, msg: ElevenLabsInput) -> None:
        if self.first_message:
            self.first_message = False
            self._check_key(msg)
        if self.closing_socket:
            raise BadMessage("invalid_state", "The socket is closing; no more input is accepted.", "text")
        if msg.close_socket:
            if not self.multi:
                raise SchemaError("close_socket", "only multi-stream-input has close_socket; end with {\"text\": \"\"}")
            await self._close_socket()
            return
        context_id = (msg.context if msg.context is not None else DEFAULT_CONTEXT) if self.multi else DEFAULT_CONTEXT
        if not self.multi and msg.context is not None:
            raise SchemaError("context_id", "stream-input has one stream; use multi-stream-input for contexts")
        context = self.contexts.get(context_id)
        if msg.close_context:
            if not self.multi:
                raise SchemaError("close_context", "only multi-stream-input has contexts; end with {\"text\": \"\"}")
            if context is not None:  # closing a context twice (or one never opened) is harmless
                context.last_message = time.monotonic()
                await context.end(speak_buffer=False)
            return
        judge(msg, first_of_context=context is None)
        keepalive = msg.text == "" and not msg.flush and not msg.opens
        if self.multi and keepalive:  # {"text": ""}: resets the clocks, opens nothing
            if context is not None:
                context.last_message = time.monotonic()
            return
        if context is None:
            if msg.text is None and not self.multi:
                raise SchemaError("text", "every message needs a string `text`", MISSING)
            context = await self._open(context_id, msg)
        elif context.closing:
            raise BadMessage("invalid_state", "This context is closing; no more text is accepted. Open a new one.",
                             "context_id" if self.multi else "text")
        context.last_message = time.monotonic()
        if msg.text is None and not msg.flush:
            raise SchemaError("text", "every message needs a string `text` (or flush / close_context)", MISSING)
        text = self._check_text(msg.text or "")
        if not self.multi and text == "":
            await context.end(speak_buffer=True)  # stream-input's end of input
            return
        await context.text(text, bool(msg.flush))

    def _check_text(self, text: str) -> str:
        return check_text(text, "text", self.ctx.settings.max_input_chars, allow_empty=True)

    async def _open(self, context_id: str, msg: ElevenLabsInput) -> Context:
        if len(self.contexts) >= self.limits.max_contexts:
            raise SchemaError("context_id", f"at most {self.limits.max_contexts} contexts may be open on one socket; "
                              "close one (close_context) first")
        context = Context(self, context_id if self.multi else None, self.voicing)
        self.contexts[context_id] = context
        context.start()
        return context

    async def context_finished(self, context: Context) -> None:
        """A context spoke everything after its end: isFinal, then (stream-input, or the last
        context of a closing socket) the close."""
        key = DEFAULT_CONTEXT if context.id is None else context.id
        if self.contexts.get(key) is context:
            del self.contexts[key]
        final = context.tagged({"isFinal": True})
        if not self.multi:
            self.closer.request(WSCloseCode.OK, last_event=final)
            return
        await self.send(final)
        if self.closing_socket and not self.contexts:
            self.closer.request(WSCloseCode.OK)

    async def _close_socket(self) -> None:
        self.closing_socket = True
        if not self.contexts:
            self.closer.request(WSCloseCode.OK)
            return
        for context in list(self.contexts.values()):
            await context.end(speak_buffer=True)

    async def _sweep(self) -> None:
        """Closes contexts idle for the inactivity timeout (nothing to speak, no message)."""
        timeout = self.activity.timeout_s
        while True:
            await asyncio.sleep(min(self.limits.sweep_interval_s, timeout))
            now = time.monotonic()
            for key, context in list(self.contexts.items()):
                if context.idle and not context.closing and now - context.last_message >= timeout:
                    del self.contexts[key]
                    await context.cancel()
                    await self.send_error("context_timeout", f"Context idle for {timeout:g} s (inactivity_timeout); "
                                          "closed. Send {\"text\": \"\"} to keep it open.", "context_id", context.id)


# ---- handlers -----------------------------------------------------------------------------------


def _voicing(ctx: ServerContext, request: web.Request) -> Voicing:
    voice = ctx.profile.resolve_voice(request.match_info["voice_id"])
    seed = query_seed(request.query)
    given = {"seed": seed} if seed is not None else {}
    return Voicing(voice, sampling_params(given, ctx.speech_sampling, request_limits(ctx), SPEECH_FIELDS))


async def _session(request: web.Request, multi: bool) -> web.WebSocketResponse:
    ctx = get_ctx(request)
    # Checked before the upgrade: a bad voice or parameter is a plain 400 naming it.
    voicing = _voicing(ctx, request)
    query = parse_query(request.query)
    activity = session_activity(request)
    needs_key = ctx.settings.api_key is not None and presented_key(request) is None
    ws = new_websocket(request)
    await ws.prepare(request)
    endpoint = MULTI_STREAM_INPUT if multi else STREAM_INPUT
    return await guard_session(
        ws, lambda: ElevenLabsSocket(ctx, ws, voicing, activity, query, multi, needs_key).run(), endpoint
    )


async def stream_input(request: web.Request) -> web.WebSocketResponse:
    return await _session(request, multi=False)


async def multi_stream_input(request: web.Request) -> web.WebSocketResponse:
    return await _session(request, multi=True)

