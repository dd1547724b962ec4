"""POST /v1/audio/speech: OpenAI-compatible text to speech.

Body: `model` (any name: one model is served), `input`, `voice` (a name or {"id": name}),
`response_format` (OpenAI's mp3 (the default), opus, aac, flac, wav, pcm, or a codec_rate[_kbps]
name such as pcm_16000, ulaw_8000 or mp3_44100_128: see streaming.encoders),
`speed` (only 1.0), `stream_format` ("audio" chunked bytes | "sse" events), and extensions:
`stream` (false -> one whole file with Content-Length), `seed`, `temperature`, `top_p`,
`top_k`, `min_p`, `repetition_penalty`, `max_new_tokens`. The body is a
streaming.schema.SpeechRequest: strict types, unknown fields refused, and a bad field is a 400
naming it (the same judgments as the WebSocket `session.config`).

Streaming: headers go out once the engine has admitted the request (so overload is still a
429); audio bytes follow as each step produces them. A failure after the headers cuts the
chunked body short (audio) or sends an `error` event (sse), so a client never takes a
truncated file for a complete one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from server.context import ServerContext, get_ctx
from server.engine_api import EngineOverloaded, EngineUnavailable
from server.errors import invalid_request, read_body
from server.outputs import client_gone, cut_connection, first_output, mid_stream_error, until_finished
from server.sampling import SPEECH_FIELDS, rejection_error, request_limits
from server.tts.clips import clip_key, decode_clip, inline_clip
from server.tts.encoding import EncodedStream, whole_file
from server.tts.voice_store import ReferenceVoice
from streaming.encoders import AudioFormat, UnsupportedFormat, b64, resolve_format
from streaming.ipc import AddRequest, RequestOutput
from streaming.sampling_params import InvalidRequest, SamplingParams
from streaming.schema import (
    MISSING,
    UNSUPPORTED,
    SchemaError,
    SpeechRequest,
    check_language,
    check_speech_options,
    check_text,
    sampling_params,
    voice_name,
)

log = logging.getLogger(__name__)

ENDPOINT = "/v1/audio/speech"
DEFAULT_RESPONSE_FORMAT = "mp3"  # OpenAI's default
STREAM_FORMATS = ("audio", "sse")


@dataclass(frozen=True)
class SpeechJob:
    add: AddRequest
    fmt: AudioFormat
    stream_format: str
    stream: bool


async def speech_add_request(
    ctx: ServerContext, voice: str, text: str, sampling: SamplingParams, param: str = "input",
    language: str | None = None, instructions: str | None = None,
) -> AddRequest:
    """One engine request speaking `text` in `voice` (shared with the WebSocket sessions); a
    long text is tokenized off the event loop. language / instructions: only for a profile that
    takes them (checked before: check_speech_options, the session's language check)."""
    prompt = await ctx.profile.build_prompt_async(ctx.tokenizer, voice, text, language, instructions)
    limit = ctx.engine.info.max_model_len
    if len(prompt.ids) >= limit:
        raise invalid_request(
            f"{param}: the text makes a {len(prompt.ids)}-token prompt; the model takes fewer than {limit}", param=param
        )
    return prompt.add_request(f"speech-{uuid.uuid4().hex}", sampling)


async def parse_speech_body(ctx: ServerContext, req: SpeechRequest) -> SpeechJob:
    limits = request_limits(ctx)
    if req.input is None:
        raise SchemaError("input", "this field is required", MISSING)
    text = check_text(req.input, "input", limits.max_input_chars)
    if req.task_type is not None and req.task_type != ctx.profile.task_type:
        raise SchemaError("task_type", f"{req.task_type!r} is not served: this server's model is task_type "
                          f"{ctx.profile.task_type!r}", UNSUPPORTED)
    if req.ref_audio is not None:
        voice = await clip_voice(ctx, req)
    else:
        for name in ("ref_text", "x_vector_only_mode"):
            if getattr(req, name) is not None:
                raise SchemaError(name, "goes with ref_audio (a per-request reference clip)")
        voice = ctx.profile.resolve_voice(voice_name(req.voice))
    # absent (None) is the default; an empty name is a mistake, refused by resolve_format
    fmt_name = DEFAULT_RESPONSE_FORMAT if req.response_format is None else req.response_format
    try:
        fmt = resolve_format(fmt_name)
    except UnsupportedFormat as e:
        raise SchemaError("response_format", str(e), UNSUPPORTED) from None
    check_speech_options(req, ctx.profile.takes_instructions)
    stream_format = req.stream_format or "audio"
    if stream_format not in STREAM_FORMATS:
        raise SchemaError(
            "stream_format", f"unsupported value {stream_format!r}; supported: {', '.join(STREAM_FORMATS)}", UNSUPPORTED
        )
    stream = True if req.stream is None else req.stream
    if not stream and stream_format == "sse":
        raise SchemaError("stream", "stream_format 'sse' needs stream=true")
    sampling = sampling_params(req.given(), ctx.speech_sampling, limits, SPEECH_FIELDS)
    instructions = req.instructions if req.instructions and req.instructions.strip() else None
    language = check_language(req.language, ctx.profile.languages)
    return SpeechJob(await speech_add_request(ctx, voice, text, sampling, language=language, instructions=instructions),
                     fmt, stream_format, stream)


async def clip_voice(ctx: ServerContext, req: SpeechRequest) -> str:
    """vllm-omni's per-request clip (a Base model): encoded by the engine at its first use,
    then served from the profile's ClipCache under its clip_key, which names the voice. The
    clip is the voice: a `voice` beside it is not read (the OpenAI SDK requires one)."""
    profile, s = ctx.profile, ctx.settings
    if not profile.clones_voices:
        raise SchemaError("ref_audio", "this model clones no reference clip (a Qwen3-TTS Base folder does); "
                          "name one of its voices", UNSUPPORTED)
    try:
        data = inline_clip(req.ref_audio, s.max_voice_upload_bytes)
    except ValueError as e:
        raise SchemaError("ref_audio", str(e)) from None
    transcript = "" if req.x_vector_only_mode else check_text(req.ref_text or "", "ref_text", s.max_input_chars,
                                                              allow_empty=True).strip()
    key = clip_key(data, transcript)
    if profile.clips.get(key) is None:
        try:
            pcm = await asyncio.to_thread(decode_clip, data, profile.sample_rate, s.max_voice_seconds)
        except ValueError as e:
            raise SchemaError("ref_audio", str(e).removeprefix("file: ")) from None
        try:
            codes, xvector = await ctx.engine.encode_audio(pcm.tobytes())
        except InvalidRequest as e:
            raise SchemaError("ref_audio", str(e).split(": ", 1)[-1]) from None
        profile.clips.put(ReferenceVoice(key, "", transcript, codes, pcm.size / profile.sample_rate, xvector))
    return key


async def create_speech(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    ctx = get_ctx(request)
    job = await parse_speech_body(ctx, await read_body(request, SpeechRequest, ctx.settings.max_json_depth))
    async with aclosing(ctx.engine.generate(job.add)) as outputs:
        # The first output proves admission (EngineOverloaded/Unavailable surface here, still
        # as a status code) or carries the request's rejection.
        first = await first_output(request, outputs, SPEECH_FIELDS, "input")
        if not job.stream:
            return await _whole_file(request, ctx, job, first, outputs)
        ctx.metrics.active_streams.labels(ENDPOINT).inc()
        try:
            if job.stream_format == "sse":
                return await _stream_sse(request, ctx, job, first, outputs, arrived)
            return await _stream_audio(request, ctx, job, first, outputs, arrived)
        finally:
            ctx.metrics.active_streams.labels(ENDPOINT).dec()


def _usage(job: SpeechJob, last: RequestOutput) -> dict:
    prompt = last.num_prompt_tokens or len(job.add.prompt_token_ids)
    return {"input_tokens": prompt, "output_tokens": last.num_output_tokens, "total_tokens": prompt + last.num_output_tokens}


async def _stream_audio(
    request: web.Request, ctx: ServerContext, job: SpeechJob, first: RequestOutput, outputs, arrived: float
) -> web.StreamResponse:
    sample_rate = ctx.profile.sample_rate
    encoder = EncodedStream(job.fmt, sample_rate)
    resp = web.StreamResponse(
        headers={"Content-Type": job.fmt.content_type, "X-Sample-Rate": str(encoder.sample_rate)}
    )
    await resp.prepare(request)
    last: RequestOutput | None = None
    sent_audio = False
    try:
        async with aclosing(until_finished(first, outputs)) as steps:
            async for out in steps:
                if client_gone(request):
                    return resp  # leaving the aclosing blocks aborts the engine request
                if out.audio is not None and out.audio.size:
                    if not sent_audio:
                        ctx.metrics.ttfa.labels(ENDPOINT).observe(time.monotonic() - arrived)
                        sent_audio = True
                    ctx.metrics.audio_seconds.inc(out.audio.size / sample_rate)
                    data = await encoder.encode(out.audio)
                    if data:  # a codec may hold a chunk's samples until it has a frame
                        await resp.write(data)
                last = out
    except (EngineOverloaded, EngineUnavailable) as e:
        # Overloaded mid-stream: the engine client dropped us as too slow a reader.
        log.warning("speech %s: stream ended early: %s", job.add.request_id, e)
        cut_connection(request)
        return resp
    except ConnectionError:  # reset, or aiohttp's "Connection lost"
        return resp
    if last is None or last.finish_reason == "error":
        log.warning("speech %s: generation failed mid-stream: %s", job.add.request_id, last and last.error)
        cut_connection(request)
        return resp
    tail = await encoder.finish()
    try:
        if tail:
            await resp.write(tail)
        await resp.write_eof()
    except ConnectionError:  # reset, or aiohttp's "Connection lost"
        pass
    return resp


def _sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


async def _stream_sse(
    request: web.Request, ctx: ServerContext, job: SpeechJob, first: RequestOutput, outputs, arrived: float
) -> web.StreamResponse:
    sample_rate = ctx.profile.sample_rate
    encoder = EncodedStream(job.fmt, sample_rate)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    last: RequestOutput | None = None
    sent_audio = False
    try:
        try:
            async with aclosing(until_finished(first, outputs)) as steps:
                async for out in steps:
                    if client_gone(request):
                        return resp
                    if out.audio is not None and out.audio.size:
                        if not sent_audio:
                            ctx.metrics.ttfa.labels(ENDPOINT).observe(time.monotonic() - arrived)
                            sent_audio = True
                        data = await encoder.encode(out.audio)
                        if data:
                            await resp.write(_sse({"type": "speech.audio.delta", "audio": b64(data)}))
                        ctx.metrics.audio_seconds.inc(out.audio.size / sample_rate)
                    last = out
        except (EngineOverloaded, EngineUnavailable) as e:
            await resp.write(_sse({"type": "error", **mid_stream_error(e).body()}))
            return resp
        if last is None or last.finish_reason == "error":
            err = rejection_error(last and last.error, None, SPEECH_FIELDS, "input")
            await resp.write(_sse({"type": "error", **err.body()}))
        else:
            tail = await encoder.finish()
            if tail:
                await resp.write(_sse({"type": "speech.audio.delta", "audio": b64(tail)}))
            await resp.write(_sse({"type": "speech.audio.done", "usage": _usage(job, last)}))
        await resp.write_eof()
    except ConnectionError:  # reset, or aiohttp's "Connection lost"
        pass
    return resp


async def _whole_file(
    request: web.Request, ctx: ServerContext, job: SpeechJob, first: RequestOutput, outputs
) -> web.Response:
    chunks: list[np.ndarray] = []
    last: RequestOutput | None = None
    async with aclosing(until_finished(first, outputs)) as steps:
        async for out in steps:
            if client_gone(request):
                # Nobody will read this; 499 (nginx's "client closed request") is for the logs.
                return web.Response(status=499)
            if out.audio is not None and out.audio.size:
                chunks.append(out.audio)
            last = out
    assert last is not None
    if last.finish_reason == "error":
        raise rejection_error(last.error, None, SPEECH_FIELDS, "input")
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
    source_rate = ctx.profile.sample_rate
    ctx.metrics.audio_seconds.inc(samples.size / source_rate)
    return web.Response(
        body=await whole_file(job.fmt, samples, source_rate),
        headers={"Content-Type": job.fmt.content_type, "X-Sample-Rate": str(job.fmt.rate(source_rate))},
    )
