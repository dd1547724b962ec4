"""ElevenLabs' text-to-speech over HTTP (LiveKit's non-streaming path, Pipecat's HTTP service,
the SDK's convert / stream):

POST /v1/text-to-speech/{voice_id}                            a whole file
POST /v1/text-to-speech/{voice_id}/stream                     the audio, streamed as it is made
POST /v1/text-to-speech/{voice_id}/with-timestamps            JSON {audio_base64, alignment, normalized_alignment}
POST /v1/text-to-speech/{voice_id}/stream/with-timestamps     one JSON object a line per chunk, each
                                                              {audio_base64, alignment, normalized_alignment}

Query: output_format (default mp3_44100_128; streaming.encoders' names), enable_logging,
optimize_streaming_latency, seed (judged as on the WebSocket). Body (ElevenLabsBody): `text`
(required), model_id (any), voice_settings (judged as on the WebSocket), seed, and fields that
shape ElevenLabs' own service (previous_text, next_text, language_code, ...), accepted without
effect. Alignment: {"characters", "character_start_times_seconds",
"character_end_times_seconds"}, times from the start of the response's audio
(server.tts.timings). A mistake is a 400 naming the field; the text is one engine request.
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from server.context import get_ctx
from server.errors import read_body
from server.outputs import client_gone, cut_connection, first_output, until_finished
from server.routes.speech import speech_add_request
from server.sampling import SPEECH_FIELDS, rejection_error, request_limits
from server.tts.elevenlabs_messages import (
    ElevenLabsInput,
    VoiceSettings,
    http_alignment,
    judge,
    parse_query,
    query_seed,
)
from server.tts.encoding import EncodedStream, whole_file
from server.tts.timings import CharTime, SegmentTimer, SpeakingRate
from streaming.encoders import b64
from streaming.schema import MISSING, SchemaError, check_text, sampling_params

ENDPOINT = "/v1/text-to-speech/{voice_id}"


class ElevenLabsBody(msgspec.Struct, forbid_unknown_fields=True):
    text: str | None = None  # required; None so "null" and "missing" get the same message
    model_id: str | None = None
    voice_settings: VoiceSettings | None = None
    seed: int | None = None
    language_code: str | None = None
    apply_text_normalization: str | None = None
    apply_language_text_normalization: bool | None = None
    previous_text: str | None = None
    next_text: str | None = None
    previous_request_ids: list[str] | None = None
    next_request_ids: list[str] | None = None
    use_pvc_as_ivc: bool | None = None
    pronunciation_dictionary_locators: list[Any] | None = None


def _timed_chunk(data: bytes, chars: list[CharTime]) -> bytes:
    align = http_alignment(chars)
    return (json.dumps({"audio_base64": b64(data), "alignment": align, "normalized_alignment": align},
                       separators=(",", ":")) + "\n").encode()


async def _job(request: web.Request):
    ctx = get_ctx(request)
    voice = ctx.profile.resolve_voice(request.match_info["voice_id"])
    query = parse_query(request.query)
    body = await read_body(request, ElevenLabsBody, ctx.settings.max_json_depth)
    if body.text is None:
        raise SchemaError("text", "this field is required", MISSING)
    text = check_text(body.text, "text", ctx.settings.max_input_chars)
    # the same judgments as the WebSocket's (voice_settings ranges, speed, dictionaries)
    judge(ElevenLabsInput(text=text, voice_settings=body.voice_settings,
                          pronunciation_dictionary_locators=body.pronunciation_dictionary_locators), True)
    seed = body.seed if body.seed is not None else query_seed(request.query)
    sampling = sampling_params({"seed": seed} if seed is not None else {}, ctx.speech_sampling, request_limits(ctx),
                               SPEECH_FIELDS)
    add = await speech_add_request(ctx, voice, text, sampling, param="text")
    return ctx, query.output_format, text, add


async def _handle(request: web.Request, stream: bool, timestamps: bool) -> web.StreamResponse:
    ctx, fmt, text, add = await _job(request)
    rate = ctx.profile.sample_rate
    arrived = time.monotonic()
    async with aclosing(ctx.engine.generate(add)) as outputs:
        first = await first_output(request, outputs, SPEECH_FIELDS, "text")
        if not stream:
            chunks: list[np.ndarray] = []
            last = first
            async with aclosing(until_finished(first, outputs)) as steps:
                async for out in steps:
                    if out.audio is not None and out.audio.size:
                        chunks.append(out.audio)
                    last = out
            if last.finish_reason == "error":
                raise rejection_error(last.error, None, SPEECH_FIELDS, "text")
            samples = np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
            data = await whole_file(fmt, samples, rate)
            if not timestamps:
                return web.Response(body=data, headers={"Content-Type": fmt.content_type})
            seconds = samples.size / rate  # the whole length is known: an even spread
            chars = [CharTime(c, i * seconds / len(text), (i + 1) * seconds / len(text)) for i, c in enumerate(text)]
            align = http_alignment(chars)
            return web.json_response({"audio_base64": b64(data), "alignment": align, "normalized_alignment": align})
        return await _stream(request, ctx, fmt, text, first, outputs, timestamps, arrived)


async def _stream(request, ctx, fmt, text, first, outputs, timestamps: bool, arrived: float) -> web.StreamResponse:
    rate = ctx.profile.sample_rate
    encoder = EncodedStream(fmt, rate)
    timer = SegmentTimer(text, rate, SpeakingRate())
    content_type = "application/x-ndjson" if timestamps else fmt.content_type
    resp = web.StreamResponse(headers={"Content-Type": content_type, "X-Sample-Rate": str(encoder.sample_rate)})
    await resp.prepare(request)
    last = None
    sent = False
    try:
        async with aclosing(until_finished(first, outputs)) as steps:
            async for out in steps:
                if client_gone(request):
                    return resp  # leaving the aclosing blocks aborts the engine request
                if out.audio is not None and out.audio.size:
                    if not sent:
                        ctx.metrics.ttfa.labels(ENDPOINT).observe(time.monotonic() - arrived)
                        sent = True
                    chars = timer.advance(out.audio.size)  # times from the response's first sample
                    data = await encoder.encode(out.audio)
                    if timestamps and (data or chars):
                        await resp.write(_timed_chunk(data, chars))
                    elif data:
                        await resp.write(data)
                last = out
        if last is None or last.finish_reason == "error":
            cut_connection(request)
            return resp
        chars = timer.finish()
        tail = await encoder.finish()
        if timestamps and (tail or chars):
            await resp.write(_timed_chunk(tail, chars))
        elif tail:
            await resp.write(tail)
        await resp.write_eof()
    except ConnectionError:  # reset, or aiohttp's "Connection lost"
        pass
    return resp


async def convert(request: web.Request) -> web.StreamResponse:
    return await _handle(request, stream=False, timestamps=False)


async def convert_with_timestamps(request: web.Request) -> web.StreamResponse:
    return await _handle(request, stream=False, timestamps=True)


async def stream(request: web.Request) -> web.StreamResponse:
    return await _handle(request, stream=True, timestamps=False)


async def stream_with_timestamps(request: web.Request) -> web.StreamResponse:
    return await _handle(request, stream=True, timestamps=True)


ROUTES = (
    (ENDPOINT, convert, "elevenlabs_tts"),
    (ENDPOINT + "/with-timestamps", convert_with_timestamps, "elevenlabs_tts_timestamps"),
    (ENDPOINT + "/stream", stream, "elevenlabs_tts_stream"),
    (ENDPOINT + "/stream/with-timestamps", stream_with_timestamps, "elevenlabs_tts_stream_timestamps"),
)
ROUTE_NAMES = frozenset(name for _, _, name in ROUTES)
