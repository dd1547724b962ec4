"""The TTS WebSocket session: text streams in, audio streams out while the text still arrives
(ElevenLabs' shapes: server.routes.elevenlabs_ws; Cartesia's: server.routes.cartesia_ws).

/v1/audio/speech/stream (this project's protocol)
    client: {"type": "session.config", "voice", "response_format": "pcm", "sample_rate",
             <sampling fields as on /v1/audio/speech>, "task_type", "language", "stream_audio"}
            {"type": "input.text", "text": "..."}   {"type": "input.flush"}
            {"type": "session.close"} or {"type": "input.done"}
            {"type": "ping"} (a keepalive, answered {"type": "pong"})
    server: {"type": "session.created", "session": {...}}
            {"type": "audio.start", "utterance": k, "sentence_index": k, "sentence_text",
             "format": "pcm_s16le", "sample_rate", "text"}
            binary frames of s16le PCM
            {"type": "audio.done", "utterance": k, "sentence_index": k, "sentence_text", "text",
             "finish_reason", "usage": {...}}
            {"type": "session.done", "total_sentences": n} then close 1000
            {"type": "error", "code", "message", "param"[, "utterance"]}

vllm-omni's names are accepted too, so a client written for vllm-omni's /v1/audio/speech/stream
switches by changing its URL: `input.done` ends the input as `session.close` does (vllm-omni
speaks the buffered text, sends `session.done` and ends the session); `sentence_index` /
`sentence_text` repeat `utterance` / `text` (one index per segment, counted across flushes over
the whole session, as vllm-omni counts sentences); `total_sentences` is how many segments were
spoken or failed. In `session.config`, `task_type` the served model's kind (SpeechProfile.task_type:
"CustomVoice" for named voices, "VoiceDesign" for a Qwen3-TTS VoiceDesign folder, "Base" for a
Qwen3-TTS Base folder, whose voices are uploaded clips) and `stream_audio` true are what this
server does; `language` "Auto" lets the model read the text as
it is, and a model with languages (Qwen3-TTS: its codec_language_id names) takes one of them;
any other value is an error naming the field (`instructions` likewise, as on POST
/v1/audio/speech: taken by a model with an instruct turn, Qwen3-TTS 1.7B).

Text is cut into segments (server.tts.text_segmenter); each segment is one engine request,
spoken in order by a `server.tts.speaker.Speaker` (bounded prefetch). With `stream_input`
(Qwen3-TTS) the input.text pieces up to an input.flush are one utterance that starts speaking
with its first settled words: its audio.start carries the text that had arrived by then, its
audio.done all of it.

Messages are judged by streaming.schema (strict types, unknown keys refused; `session.config`
exactly as POST /v1/audio/speech judges the same fields;
text checked as Unicode at the door). A bad field is an error event and the session goes on;
a message that cannot be read is an error event and then a close: 1007 for invalid Unicode (a
lone surrogate), 1009 for a message over max_ws_message_bytes or nested deeper than
max_json_depth. A dead engine or a server bug is an error event and close 1011. A client that
goes away aborts the session's engine requests.

The reader never waits on the speaker, so a close, flush or config is seen at once; text
that would put more than `ws_max_pending_segments` segments in the queue is refused with an
`input_overflow` error instead (a client sending text far faster than it can be spoken).

Admission counts work, not sockets: a session holds one of the server's work slots only while
text is queued or being spoken. Text that needs a slot when none is free is refused with an
`overloaded` error event (with `retry_after_s`) and the session goes on. A session with no
message and nothing to speak for its inactivity timeout (`?inactivity_timeout=`, default
ws_inactivity_timeout_s; a ping keeps it open) is closed: an
`inactivity_timeout` error event, then 1008.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import numpy as np
from aiohttp import WSCloseCode, web

from server.context import ServerContext, get_ctx
from server.errors import APIError
from server.sampling import SPEECH_FIELDS, request_limits
from server.tts.speaker import Refusal, Sink, Speaker, Utterance, Voicing, usage_of
from server.tts.text_segmenter import TextSegmenter
from server.ws_common import (
    BadMessage,
    CloseRequest,
    PingMessage,
    SessionActivity,
    bad_message,
    dispatch_text,
    guard_session,
    new_websocket,
    overloaded_event,
    read_message,
    reject,
    send_error,
    send_json,
    session_activity,
)
from streaming.encoders import pcm16_bytes
from streaming.ipc import RequestOutput
from streaming.schema import (
    SPEECH_STREAM_MESSAGES,
    INVALID_VALUE,
    UNSUPPORTED,
    InputFlush,
    InputText,
    SchemaError,
    SessionConfig,
    check_language,
    check_speech_options,
    check_text,
    convert,
    sampling_params,
    voice_name,
)

log = logging.getLogger(__name__)

SPEECH_WS_ENDPOINT = "/v1/audio/speech/stream"
PCM_FORMAT = "pcm_s16le"
# vllm-omni's session.config values: what this server does, and the ones it knows but cannot do.
VLLM_OMNI_TASK_TYPES = ("CustomVoice", "VoiceDesign", "Base")


class TextSession(Sink):
    """Reading side of a session: size limit, binary frames, JSON parsing."""

    endpoint = ""

    def __init__(self, ctx: ServerContext, ws: web.WebSocketResponse, voicing: Voicing, activity: SessionActivity):
        self.ctx = ctx
        self.ws = ws
        self.voicing = voicing
        self.activity = activity
        self.segmenter = TextSegmenter(ctx.settings.segment_min_clause_chars, ctx.settings.segment_max_chars)
        self.speaker = Speaker(ctx, self, self.endpoint, activity)
        # The speaker's writer ends the session by asking; the reader (run) closes.
        self.closer = CloseRequest()

    async def run(self) -> None:
        self.speaker.start()
        self.ctx.metrics.active_streams.labels(self.endpoint).inc()
        try:
            await self.on_open()
            await dispatch_text(self.ws, self.activity, self.closer, self.endpoint, self._on_text, self._on_binary)
        except ConnectionError:  # on_open's first send to a client already gone
            pass
        finally:
            stopped = self.speaker.stop()  # before any await: this finally may itself be cancelled
            self.ctx.metrics.active_streams.labels(self.endpoint).dec()
            await asyncio.gather(*stopped, return_exceptions=True)

    async def _on_binary(self) -> None:
        await self.send_error("binary_not_allowed", "Binary frames are not accepted; send JSON text frames.")

    async def _on_text(self, data: str) -> None:
        try:
            await self.on_message(read_message(data, self.ctx.settings))
        except SchemaError as e:
            await reject(self.ws, bad_message(e))
        except APIError as e:  # e.g. an unknown voice
            await reject(self.ws, BadMessage("invalid_field", e.message, e.param))
        except BadMessage as e:
            await reject(self.ws, e)

    def check_text(self, text: str) -> str:
        return check_text(text, "text", self.ctx.settings.max_input_chars, allow_empty=True)

    async def speak(self, segments: list[str]) -> None:
        await self.refused(self.speaker.say(segments, self.voicing), segments)

    async def refused(self, refusal: Refusal | None, segments: list[str]) -> None:
        """Tell the client why its text was not queued (nothing when it was)."""
        if refusal is Refusal.OVERFLOW:
            limit = self.ctx.settings.ws_max_pending_segments
            await self.send_error(
                "input_overflow",
                f"Over {limit} text segments are waiting to be spoken; this text was dropped. "
                "Send text no faster than it is spoken.",
                "text",
            )
        elif refusal is Refusal.OVERLOADED:
            assert self.speaker.refused is not None
            self.ctx.metrics.rejected.labels(self.endpoint).inc()
            await overloaded_event(self.ws, self.speaker.refused, "text", dropped=" ".join(segments))

    async def send_json(self, obj: dict) -> None:
        await send_json(self.ws, obj)

    async def send_error(self, code: str, message: str, param: str | None = None, **extra) -> None:
        await send_error(self.ws, code, message, param, **extra)

    async def on_open(self) -> None:
        """Greeting sent on connect (none unless the protocol has one)."""
        return None

    async def on_message(self, obj: dict) -> None:
        raise NotImplementedError  # each protocol handles its own messages

    def close_from_writer(self, code: int, message: bytes = b"", last_event: dict | None = None) -> None:
        """The writer's end of the session: the reader sends `last_event` and closes (see
        ws_common.CloseRequest)."""
        self.closer.request(code, message, last_event)

    async def utterance_failed(self, utt: Utterance, code: str, message: str, param: str | None) -> None:
        await self.send_error(code, message, param, utterance=utt.index)
        if code == "engine_unavailable":
            self.close_from_writer(WSCloseCode.INTERNAL_ERROR, b"engine unavailable")

    async def crashed(self) -> None:
        try:
            await self.send_error("internal_error", "The session failed on the server; see its log.")
        except ConnectionError:  # reset, or aiohttp's "Connection lost"
            pass
        self.close_from_writer(WSCloseCode.INTERNAL_ERROR, b"internal error")


# ---- /v1/audio/speech/stream ------------------------------------------------------------------


class SpeechStreamSession(TextSession):
    endpoint = SPEECH_WS_ENDPOINT
    sentences = 0  # segments spoken or failed: vllm-omni's total_sentences
    stream_input = False  # session.config's stream_input: text streams into one utterance

    def _session_info(self) -> dict:
        return {"voice": self.voicing.voice, "format": PCM_FORMAT, "sample_rate": self.ctx.profile.sample_rate}

    async def on_open(self) -> None:
        await self.send_json({"type": "session.created", "session": self._session_info()})

    async def on_message(self, obj: dict) -> None:
        kind = obj.get("type")
        if kind == "ping":  # a keepalive, answered even while the session is closing
            convert(obj, PingMessage)
            await self.send_json({"type": "pong"})
            return
        if self.speaker.input_ended and kind != "session.close":
            raise BadMessage("invalid_state", "The session is closing; no more input is accepted.", "type")
        message_type = SPEECH_STREAM_MESSAGES.get(kind) if isinstance(kind, str) else None
        if message_type is None:
            raise BadMessage(
                "unknown_type",
                f"Unknown message type {kind!r}; expected {', '.join(SPEECH_STREAM_MESSAGES)} or ping.",
                "type",
            )
        msg = convert(obj, message_type)
        if isinstance(msg, InputText):
            text = self.check_text(msg.text)
            if self.stream_input:
                await self.refused(self.speaker.stream(text, False, self.voicing), [text])
            else:
                await self.speak(self.segmenter.push(text))
        elif isinstance(msg, InputFlush):
            if self.stream_input:
                await self.refused(self.speaker.stream("", True, self.voicing), [])
            else:
                await self.speak(self.segmenter.flush())
        elif isinstance(msg, SessionConfig):
            self.voicing = self._configure(msg)
            if msg.stream_input is not None:
                if msg.stream_input and not self.ctx.profile.takes_streamed_text:
                    raise SchemaError("stream_input", "this model speaks whole sentences only (Qwen3-TTS streams "
                                      "text into a running utterance)", UNSUPPORTED)
                if not msg.stream_input and self.stream_input:
                    await self.refused(self.speaker.stream("", True, self.voicing), [])  # the open one ends
                else:
                    await self.speak(self.segmenter.flush())  # text buffered for sentences goes first
                self.stream_input = msg.stream_input
            await self.send_json({"type": "session.updated", "session": self._session_info()})
        elif not self.speaker.input_ended:  # session.close or vllm-omni's input.done
            await self.speak(self.segmenter.flush())
            self.speaker.end_input()

    def _configure(self, msg: SessionConfig) -> Voicing:
        """The same judgments as POST /v1/audio/speech's body (streaming.schema.SpeechOptions)."""
        ctx = self.ctx
        name = voice_name(msg.voice)
        voice = ctx.profile.resolve_voice(name) if name is not None else self.voicing.voice
        check_speech_options(msg, ctx.profile.takes_instructions)
        check_vllm_omni_options(msg, ctx.profile.languages, ctx.profile.task_type)
        if msg.response_format not in (None, "pcm"):
            raise SchemaError(
                "response_format",
                f"only 'pcm' (s16le mono binary frames) is supported here, got {msg.response_format!r}",
                UNSUPPORTED,
            )
        if msg.sample_rate not in (None, ctx.profile.sample_rate):
            raise SchemaError(
                "sample_rate", f"the model produces {ctx.profile.sample_rate} Hz audio, got {msg.sample_rate}", UNSUPPORTED
            )
        sampling = sampling_params(msg.given(), self.voicing.sampling, request_limits(ctx), SPEECH_FIELDS)
        # a field left out keeps the session's value; "" / "Auto" clear it
        style = {}
        if msg.language is not None:
            style["language"] = check_language(msg.language, ctx.profile.languages)
        if msg.instructions is not None:
            style["instructions"] = msg.instructions if msg.instructions.strip() else None
        return replace(self.voicing, voice=voice, sampling=sampling, **style)

    async def utterance_start(self, utt: Utterance) -> None:
        await self.send_json(
            {
                "type": "audio.start",
                "utterance": utt.index,
                "sentence_index": utt.index,
                "sentence_text": utt.spoken_text,
                "format": PCM_FORMAT,
                "sample_rate": self.ctx.profile.sample_rate,
                "text": utt.spoken_text,
            }
        )

    async def utterance_audio(self, utt: Utterance, samples: np.ndarray) -> None:
        await self.ws.send_bytes(pcm16_bytes(samples))

    async def utterance_done(self, utt: Utterance, last: RequestOutput) -> None:
        self.sentences += 1
        await self.send_json(
            {
                "type": "audio.done",
                "utterance": utt.index,
                "sentence_index": utt.index,
                "sentence_text": utt.spoken_text,
                "text": utt.spoken_text,
                "finish_reason": last.finish_reason,
                "usage": usage_of(utt, last),
            }
        )

    async def utterance_failed(self, utt: Utterance, code: str, message: str, param: str | None) -> None:
        self.sentences += 1
        await super().utterance_failed(utt, code, message, param)

    async def speech_finished(self) -> None:
        self.close_from_writer(WSCloseCode.OK, last_event={"type": "session.done", "total_sentences": self.sentences})


def check_vllm_omni_options(msg: SessionConfig, languages: tuple[str, ...] = (),
                            task_type: str = "CustomVoice") -> None:
    """vllm-omni's session.config fields: a value this server cannot honour names its field.
    languages: the served model's language names besides auto (Qwen3-TTS's; lower case);
    task_type: the one the served model is (SpeechProfile.task_type)."""
    if msg.task_type is not None and msg.task_type != task_type:
        if msg.task_type in VLLM_OMNI_TASK_TYPES:
            raise SchemaError(
                "task_type",
                f"{msg.task_type!r} is not served: this server's model is task_type {task_type!r}",
                UNSUPPORTED,
            )
        raise SchemaError("task_type", f"must be one of {', '.join(VLLM_OMNI_TASK_TYPES)}, got {msg.task_type!r}", INVALID_VALUE)
    check_language(msg.language, languages)
    if msg.stream_audio is False:
        raise SchemaError(
            "stream_audio",
            "audio is always streamed as PCM frames while it is produced; omit stream_audio or send true",
            UNSUPPORTED,
        )


# ---- handlers -----------------------------------------------------------------------------------


async def speech_stream(request: web.Request) -> web.WebSocketResponse:
    ctx = get_ctx(request)
    activity = session_activity(request)  # a bad ?inactivity_timeout= is a 400 before the upgrade
    ws = new_websocket(request)
    await ws.prepare(request)
    voicing = Voicing(ctx.profile.default_voice, ctx.speech_sampling)
    return await guard_session(ws, lambda: SpeechStreamSession(ctx, ws, voicing, activity).run(), SPEECH_WS_ENDPOINT)
