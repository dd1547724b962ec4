"""Cartesia's TTS WebSocket, so a Cartesia client (the `cartesia` SDK, Pipecat's
CartesiaTTSService) works by changing its base URL.

WS /tts/websocket   (query: cartesia_version, api_key / access_token; the key may also come as
                     Authorization: Bearer, which the SDK sends)
Client messages (server.tts.cartesia_messages):
  {"context_id", "transcript", "model_id", "voice": {"mode": "id", "id"} | "id",
   "output_format": {"container": raw | wav | mp3, "encoding": pcm_s16le | pcm_f32le | pcm_mulaw |
   pcm_alaw, "sample_rate", "bit_rate"?}, "add_timestamps"?, "continue"?, "flush"?, "language"?, ...}
      The first request of a context opens it with its voice and output format (later ones may
      repeat them, not change them). Text is segmented as it arrives; `"continue": false` (the
      default) ends the context's input: everything is spoken, then `done`. `flush` speaks the
      buffered text and, once spoken, answers `flush_done` with the context's flush_id.
  {"context_id", "cancel": true}: the context's engine requests are aborted before the next
      message is read; nothing more is sent for it.
Server messages:
  {"type": "chunk", "context_id", "data": base64 audio, "done": false, "status_code": 206,
   "step_time": ms, "flush_id"?}
  {"type": "timestamps", "context_id", "word_timestamps": {"words", "start", "end"} (seconds from
   the context's first audio; server.tts.timings), "done": false, "status_code": 206}
  {"type": "flush_done", "context_id", "flush_id", "flush_done": true, "done": false, "status_code": 206}
  {"type": "done", "context_id", "done": true, "status_code": 200}
  {"type": "error", "context_id"?, "error": message, "code", "param", "done": true, "status_code": 400}
"""

from __future__ import annotations

import logging
import time

import numpy as np
from aiohttp import WSCloseCode, web

from server.context import ServerContext, get_ctx
from server.tts.cartesia_messages import CancelRequest, GenerationRequest, audio_format, judge, voice_id
from server.tts.contexts import ContextLimits, ContextSocket, ContextWork
from server.tts.encoding import EncodedStream
from server.tts.speaker import Refusal, Sink, Speaker, Utterance, Voicing
from server.tts.text_segmenter import TextSegmenter
from server.tts.timings import CharTime, SegmentTimer, SpeakingRate, words
from server.ws_common import BadMessage, SessionActivity, guard_session, new_websocket, session_activity
from streaming.encoders import AudioFormat, b64
from streaming.schema import UNKNOWN, SchemaError, check_text, convert

log = logging.getLogger(__name__)

ENDPOINT = "/tts/websocket"
_QUERY = frozenset({"cartesia_version", "api_key", "access_token", "inactivity_timeout"})


class CartesiaContext(Sink):
    def __init__(self, socket: CartesiaSocket, context_id: str, voicing: Voicing, fmt: AudioFormat, timestamps: bool):
        self.socket = socket
        self.id = context_id
        settings = socket.ctx.settings
        self.segmenter = TextSegmenter(settings.segment_min_clause_chars, settings.segment_max_chars)
        self.work = ContextWork(socket.shared_work)
        self.speaker = Speaker(socket.ctx, self, ENDPOINT, self.work)
        self.voicing = voicing
        self.format = fmt
        self.encoder = EncodedStream(fmt, socket.ctx.profile.sample_rate)
        self.timestamps = timestamps
        self.rate = SpeakingRate()
        self.timer: SegmentTimer | None = None
        self.word: list[CharTime] = []  # characters of a word not yet complete
        self.spoken_s = 0.0
        self.queued = 0  # segments accepted so far
        self.flushes: list[tuple[int, int]] = []  # (flush_id, segments that must be spoken first)
        self.flush_id = 0
        self.spoken = 0  # segments spoken (or failed) so far
        self.ended = False
        self.closing = False

    def event(self, kind: str, **fields) -> dict:
        return {"type": kind, "context_id": self.id, "done": False, "status_code": 206, **fields}

    async def push(self, req: GenerationRequest, text: str) -> None:
        segments = self.segmenter.push(text)
        if req.flush or req.continue_ is not True:
            segments += self.segmenter.flush()
        refusal = self.speaker.say(segments, self.voicing)
        if refusal is Refusal.OVERFLOW:
            await self.socket.send_error("input_overflow", "Too much text is waiting to be spoken; this transcript "
                                         "was dropped.", "transcript", self.id)
            return
        if refusal is Refusal.OVERLOADED:
            assert self.speaker.refused is not None
            await self.socket.send_error("overloaded", self.speaker.refused.message, "transcript", self.id)
            return
        self.queued += len(segments)
        if req.flush:
            self.flush_id += 1
            self.flushes.append((self.flush_id, self.queued))
            await self._flushes_done(self.spoken)
        if req.continue_ is not True:
            self.ended = True
            self.speaker.end_input()

    async def _flushes_done(self, spoken: int) -> None:
        while self.flushes and self.flushes[0][1] <= spoken:
            flush_id, _ = self.flushes.pop(0)
            await self.socket.send(self.event("flush_done", flush_id=flush_id, flush_done=True))

    async def cancel(self) -> None:
        await self.speaker.cancel()

    # ---- the speaker's events ----

    async def utterance_start(self, utt: Utterance) -> None:
        lead = " " if utt.index else ""
        self.timer = SegmentTimer(lead + utt.text, self.socket.ctx.profile.sample_rate, self.rate)

    async def utterance_audio(self, utt: Utterance, samples: np.ndarray) -> None:
        started = time.monotonic()
        assert self.timer is not None
        chars = self.timer.advance(samples.size)
        data = await self.encoder.encode(samples)
        if data:
            extra = {"flush_id": self.flush_id} if self.flush_id else {}
            await self.socket.send(self.event("chunk", data=b64(data),
                                              step_time=round((time.monotonic() - started) * 1000, 3), **extra))
        await self._timestamps(chars, final=False)

    async def _timestamps(self, chars: list[CharTime], final: bool) -> None:
        if not self.timestamps:
            return
        run = self.word + [CharTime(c.char, c.start_s + self.spoken_s, c.end_s + self.spoken_s) for c in chars]
        cut = len(run) if final else max((i + 1 for i, c in enumerate(run) if c.char.isspace()), default=0)
        done, self.word = run[:cut], run[cut:]
        found = words(done)
        if found:
            await self.socket.send(self.event("timestamps", word_timestamps={
                "words": [w for w, _, _ in found], "start": [round(s, 3) for _, s, _ in found],
                "end": [round(e, 3) for _, _, e in found]}))

    async def utterance_done(self, utt: Utterance, last) -> None:
        if self.timer is not None:
            await self._timestamps(self.timer.finish(), final=True)
            self.spoken_s += self.timer.seconds
            self.timer = None
        self.spoken += 1
        await self._flushes_done(self.spoken)

    async def utterance_failed(self, utt: Utterance, code: str, message: str, param: str | None) -> None:
        await self.socket.send_error(code, message, param, self.id)
        self.spoken += 1
        if code == "engine_unavailable":
            self.socket.closer.request(WSCloseCode.INTERNAL_ERROR, b"engine unavailable")

    async def speech_finished(self) -> None:
        tail = await self.encoder.finish()
        if tail:
            await self.socket.send(self.event("chunk", data=b64(tail), step_time=0.0))
        await self._flushes_done(self.spoken)
        if self.socket.contexts.get(self.id) is self:
            del self.socket.contexts[self.id]
        await self.socket.send({"type": "done", "context_id": self.id, "done": True, "status_code": 200})

    async def crashed(self) -> None:
        try:
            await self.socket.send_error("internal_error", "The session failed on the server; see its log.", None, self.id)
        except ConnectionError:  # reset, or aiohttp's "Connection lost"
            pass
        self.socket.closer.request(WSCloseCode.INTERNAL_ERROR, b"internal error")


class CartesiaSocket(ContextSocket):
    def __init__(self, ctx: ServerContext, ws: web.WebSocketResponse, activity: SessionActivity,
                 limits: ContextLimits = ContextLimits()):
        super().__init__(ctx, ws, activity, ENDPOINT, limits)
        self.contexts: dict[str, CartesiaContext] = {}

    async def send_error(self, code: str, message: str, param: str | None, context_id: str | None = None) -> None:
        await self.send({"type": "error", "context_id": context_id, "error": message, "code": code, "param": param,
                         "done": True, "status_code": 400})

    async def _on_binary(self) -> None:
        await self.send_error("binary_not_allowed", "Binary frames are not accepted; send JSON.", None)

    def _context_id(self, obj: dict) -> str | None:
        return obj.get("context_id") if isinstance(obj.get("context_id"), str) else None

    async def _on_object(self, obj: dict) -> None:
        if "cancel" in obj:
            await self._cancel(convert(obj, CancelRequest))
        else:
            await self._generate(convert(obj, GenerationRequest))

    async def _cancel(self, req: CancelRequest) -> None:
        context = self.contexts.pop(req.context_id, None)
        if context is not None and req.cancel:
            await context.cancel()  # engine requests aborted before the next message is read

    async def _generate(self, req: GenerationRequest) -> None:
        judge(req)
        text = check_text(req.transcript, "transcript", self.ctx.settings.max_input_chars, allow_empty=True)
        context = self.contexts.get(req.context_id)
        if context is None:
            context = self._open(req)
        elif context.ended:
            raise BadMessage("invalid_state", "This context's input has ended (continue was false); use a new "
                             "context_id.", "context_id")
        elif req.output_format is not None and audio_format(req.output_format) != context.format:
            raise SchemaError("output_format", "a context keeps the output format of its first request")
        await context.push(req, text)

    def _open(self, req: GenerationRequest) -> CartesiaContext:
        if req.output_format is None:
            raise SchemaError("output_format", "a context's first request needs an output_format")
        fmt = audio_format(req.output_format)
        name = voice_id(req)
        voice = self.ctx.profile.resolve_voice(name) if name is not None else self.ctx.profile.default_voice
        if len(self.contexts) >= self.limits.max_contexts:
            raise SchemaError("context_id", f"at most {self.limits.max_contexts} contexts may be open on one socket")
        context = CartesiaContext(self, req.context_id, Voicing(voice, self.ctx.speech_sampling), fmt,
                                  bool(req.add_timestamps))
        self.contexts[req.context_id] = context
        context.speaker.start()
        return context


async def tts_websocket(request: web.Request) -> web.WebSocketResponse:
    ctx = get_ctx(request)
    for name in request.query:
        if name not in _QUERY:
            raise SchemaError(name, "unknown query parameter", UNKNOWN)
    activity = session_activity(request)
    ws = new_websocket(request)
    await ws.prepare(request)
    return await guard_session(ws, lambda: CartesiaSocket(ctx, ws, activity).run(), ENDPOINT)
