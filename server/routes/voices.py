"""Reference voices: upload, list (GET /v1/audio/voices, server.routes.info), delete.

POST /v1/audio/voices   multipart/form-data:
    name        the voice's id in later requests (letters, digits, '_', '-'; unique)
    transcript  what the clip says (the model hears the clip as this text spoken); optional for
                a voice-clone model (Qwen3-TTS Base), whose voice is then the clip's x-vector
                alone, without the clip in the prompt
    file        the clip: WAV or any format FFmpeg reads (PyAV), any rate and channel count
    speaker     optional: the model's speaker id to voice it as (default: the default voice);
                not for a voice-clone model, which has no speakers
  -> 201 {"voice_id", "name", "type": "reference", "speaker", "transcript", "frames", "duration_s",
          "speaker_embedding"}
DELETE /v1/audio/voices/{voice_id}  -> 204; 404 for an unknown or built-in voice

The clip is decoded and resampled to the codec's rate off the event loop, encoded to codec codes
once by the engine (ipc.EncodeAudio: codes, and Qwen3-TTS Base's x-vector) and stored
(server/tts/voice_store.py); requests in the voice carry the stored codes and vector. Bounds: --max-voice-upload-bytes (413), --max-voice-seconds, --max-voices
(409), and the prompt must leave room under the model's length limit.
"""

from __future__ import annotations

import asyncio

from aiohttp import BodyPartReader, web

from server.context import get_ctx
from server.errors import APIError, invalid_request, not_found, request_timeout
from server.tts.clips import decode_clip
from server.tts.voice_store import ReferenceVoice, VoiceStoreError
from streaming.sampling_params import InvalidRequest
from streaming.schema import check_text

ENDPOINT = "/v1/audio/voices"
_TEXT_FIELD_BYTES = 8192  # name, speaker and transcript parts


async def _read_form(request: web.Request, max_bytes: int) -> dict[str, bytes]:
    if not request.content_type.startswith("multipart/"):
        raise invalid_request("body: must be multipart/form-data with name, transcript and file", param="body")
    try:
        return await _read_parts(request, max_bytes)
    except ValueError as e:  # aiohttp's multipart reader: no boundary, a truncated part, ...
        raise invalid_request(f"body: malformed multipart/form-data ({e})", param="body") from None


async def _read_parts(request: web.Request, max_bytes: int) -> dict[str, bytes]:
    fields: dict[str, bytes] = {}
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):  # a nested multipart/mixed part
            raise invalid_request("body: nested multipart parts are not supported", param="body")
        name = part.name or ""
        if name not in ("name", "transcript", "speaker", "file"):
            raise invalid_request(f"{name or 'part'}: unknown form field (name, transcript, speaker, file)", param=name)
        limit = max_bytes if name == "file" else _TEXT_FIELD_BYTES
        buf = bytearray()
        while chunk := await part.read_chunk(64 * 1024):
            buf += chunk
            if len(buf) > limit:
                raise APIError(413, f"{name}: larger than {limit} bytes", param=name, code="too_large")
        fields[name] = bytes(buf)
    return fields


def _text(fields: dict[str, bytes], name: str, required: bool = True) -> str | None:
    raw = fields.get(name)
    if raw is None:
        if required:
            raise invalid_request(f"{name}: missing form field", param=name)
        return None
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise invalid_request(f"{name}: not UTF-8 text", param=name) from None
    if required and not text:
        raise invalid_request(f"{name}: must not be empty", param=name)
    return text


async def create_voice(request: web.Request) -> web.Response:
    ctx = get_ctx(request)
    profile, s = ctx.profile, ctx.settings
    if not profile.takes_reference_voices:
        raise invalid_request("voice uploads: this model takes no reference audio (its voices are built in)",
                              param="file", code="unsupported")
    try:
        async with asyncio.timeout(s.http_body_timeout_s):
            fields = await _read_form(request, s.max_voice_upload_bytes)
    except TimeoutError:
        raise request_timeout(s.http_body_timeout_s) from None
    name = _text(fields, "name")
    clones = profile.clones_voices
    transcript = _text(fields, "transcript", required=not clones) or ""
    if transcript:
        transcript = check_text(transcript, "transcript", s.max_input_chars)
    speaker = _text(fields, "speaker", required=False)
    if clones:
        if speaker:
            raise invalid_request("speaker: this model has no speakers (the clip is the voice)", param="speaker")
        speaker = ""
    else:
        speaker = speaker or profile.default_voice
        if speaker not in profile.spec.voices:
            raise invalid_request(f"speaker: {speaker!r} is not one of the model's speakers "
                                  f"{list(profile.spec.voices)}", param="speaker")
    if "file" not in fields:
        raise invalid_request("file: missing form field (the reference clip)", param="file")
    store = profile.store
    try:
        store.check_new(name)
    except VoiceStoreError as e:
        raise APIError(e.status, str(e), param=e.field, code="invalid_value" if e.status == 400 else "conflict") from None
    try:
        pcm = await asyncio.to_thread(decode_clip, fields["file"], profile.sample_rate, s.max_voice_seconds)
    except ValueError as e:
        raise invalid_request(str(e), param="file") from None
    try:
        codes, xvector = await ctx.engine.encode_audio(pcm.tobytes())
    except InvalidRequest as e:
        raise invalid_request(str(e), param="file") from None
    # the engine's family and the front end's profile read the same folder
    assert xvector is not None or not clones, "the engine gave no speaker vector for a voice-clone model"
    voice = ReferenceVoice(name, speaker, transcript, codes, pcm.size / profile.sample_rate, xvector)
    # the voice's prompt (clip + a one-word text) must leave room to speak under the length limit
    room = ctx.engine.info.max_model_len - len(profile.build_prompt_for(ctx.tokenizer, voice, "x").ids)
    if room < 64:
        # blame the larger of the two: the clip's frames or the transcript's tokens
        param = "transcript" if len(ctx.tokenizer.encode(transcript)) > voice.num_frames else "file"
        raise invalid_request(f"{param}: the clip and transcript take too much of the model's "
                              f"{ctx.engine.info.max_model_len} positions (shorten the {param})", param=param)
    try:
        store.add(voice)
    except VoiceStoreError as e:  # a concurrent upload took the name or the last place
        raise APIError(e.status, str(e), param=e.field, code="conflict") from None
    return web.json_response(voice.info(), status=201)


async def delete_voice(request: web.Request) -> web.Response:
    ctx = get_ctx(request)
    name = request.match_info["voice_id"]
    store = ctx.profile.store
    if store is None or not store.delete(name):
        raise not_found(f"voice_id: no uploaded voice {name!r}" + (" (built-in voices cannot be deleted)"
                                                                   if name in ctx.profile.voices else ""), "voice_id")
    return web.Response(status=204)
