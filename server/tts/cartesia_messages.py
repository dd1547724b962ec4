"""Cartesia's TTS WebSocket messages (read from the `cartesia` SDK 4.2's GenerationRequest /
CancelContextRequest and Pipecat's CartesiaTTSService), judged once: one msgspec Struct per
message, unknown keys refused naming the key, values checked naming the field
(`output_format.sample_rate`)."""

from __future__ import annotations

from typing import Any

import msgspec

from streaming.encoders import AudioFormat, UnsupportedFormat, resolve_format
from streaming.schema import UNSUPPORTED, SchemaError

CONTAINERS = ("raw", "wav", "mp3")
ENCODINGS = {"pcm_s16le": "pcm", "pcm_f32le": "f32", "pcm_mulaw": "ulaw", "pcm_alaw": "alaw"}
MP3_DEFAULT_BIT_RATE = 128_000
SPEEDS = ("normal", "slow", "fast")  # only "normal" is served


class OutputFormat(msgspec.Struct, forbid_unknown_fields=True):
    container: str
    sample_rate: int
    encoding: str | None = None  # raw and wav
    bit_rate: int | None = None  # mp3


class Voice(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    mode: str = "id"


class GenerationRequest(msgspec.Struct, forbid_unknown_fields=True, rename={"continue_": "continue"}):
    context_id: str
    transcript: str
    model_id: str | None = None
    voice: str | Voice | None = None
    output_format: OutputFormat | None = None
    add_timestamps: bool | None = None
    add_phoneme_timestamps: bool | None = None
    use_normalized_timestamps: bool | None = None
    continue_: bool | None = None
    flush: bool | None = None
    language: str | None = None
    max_buffer_delay_ms: int | None = None
    speed: str | float | None = None
    generation_config: dict[str, Any] | None = None
    pronunciation_dict_id: str | None = None
    duration: float | None = None


class CancelRequest(msgspec.Struct, forbid_unknown_fields=True):
    context_id: str
    cancel: bool


def audio_format(fmt: OutputFormat) -> AudioFormat:
    """Cartesia's {container, encoding, sample_rate, bit_rate} as one of our formats."""
    if fmt.container not in CONTAINERS:
        raise SchemaError("output_format.container", f"must be one of {', '.join(CONTAINERS)}, got {fmt.container!r}")
    if fmt.container == "mp3":
        name = f"mp3_{fmt.sample_rate}_{(fmt.bit_rate or MP3_DEFAULT_BIT_RATE) // 1000}"
    else:
        if fmt.encoding not in ENCODINGS:
            raise SchemaError("output_format.encoding", f"must be one of {', '.join(ENCODINGS)}, got {fmt.encoding!r}")
        codec = ENCODINGS[fmt.encoding]
        if fmt.container == "wav" and codec != "pcm":
            raise SchemaError("output_format.encoding", "a wav container holds pcm_s16le here", UNSUPPORTED)
        name = f"{'wav' if fmt.container == 'wav' else codec}_{fmt.sample_rate}"
    try:
        return resolve_format(name)
    except UnsupportedFormat as e:
        field = "output_format.bit_rate" if "bit rate" in str(e) else "output_format.sample_rate"
        raise SchemaError(field, str(e), UNSUPPORTED) from None


def judge(req: GenerationRequest) -> None:
    """What the Struct cannot say; SchemaError names the field."""
    if not 1 <= len(req.context_id) <= 128:
        raise SchemaError("context_id", "must be 1 to 128 characters")
    if req.add_phoneme_timestamps:
        raise SchemaError("add_phoneme_timestamps", "phoneme timestamps are not produced; word timestamps are "
                          "(add_timestamps)", UNSUPPORTED)
    if req.pronunciation_dict_id is not None:
        raise SchemaError("pronunciation_dict_id", "pronunciation dictionaries are not supported", UNSUPPORTED)
    if req.duration is not None:
        raise SchemaError("duration", "a target duration is not supported", UNSUPPORTED)
    if req.speed is not None and req.speed not in ("normal", 1.0, 1):
        raise SchemaError("speed", f"only the normal speed is served, got {req.speed!r}", UNSUPPORTED)
    if req.max_buffer_delay_ms is not None and not 0 <= req.max_buffer_delay_ms <= 5000:
        raise SchemaError("max_buffer_delay_ms", f"must be in [0, 5000], got {req.max_buffer_delay_ms}")
    if isinstance(req.voice, Voice) and req.voice.mode != "id":
        raise SchemaError("voice.mode", f"only 'id' voices are served, got {req.voice.mode!r}", UNSUPPORTED)
    gc = req.generation_config or {}
    for key, value in gc.items():
        if key == "speed" and value in (1, 1.0):
            continue
        if key == "volume" and value in (1, 1.0):
            continue
        raise SchemaError(f"generation_config.{key}", "not supported by this model", UNSUPPORTED)


def voice_id(req: GenerationRequest) -> str | None:
    if req.voice is None:
        return None
    return req.voice if isinstance(req.voice, str) else req.voice.id
