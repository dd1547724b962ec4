"""ElevenLabs' text-to-speech messages and query parameters, judged once: one msgspec Struct per
message shape (strict types, unknown keys refused naming the key) and the value checks the
Structs cannot say (ranges; fields allowed only in a context's first message). Every error is a
streaming.schema.SchemaError naming the client's own field (`voice_settings.stability`).

Shapes read from the clients' installed source: the `elevenlabs` SDK's
`WebsocketTtsClientMessageMulti` / `InitializeConnection`, LiveKit's ElevenLabs plugin 1.8.9
(`_build_context_init_packet`, `_multi_stream_url`) and Pipecat's ElevenLabs services.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import msgspec
from multidict import MultiMapping

from server.tts.timings import CharTime
from streaming.encoders import AudioFormat, UnsupportedFormat, resolve_format
from streaming.schema import INVALID_VALUE, UNKNOWN, UNSUPPORTED, SchemaError, check_speed

DEFAULT_OUTPUT_FORMAT = "mp3_44100_128"  # ElevenLabs' own default
UNIT_RANGE = (0.0, 1.0)  # stability, similarity_boost, style
SPEED_RANGE = (0.7, 1.2)  # ElevenLabs' bounds for voice_settings.speed
CHUNK_SCHEDULE_RANGE = (50.0, 500.0)  # generation_config.chunk_length_schedule items
TEXT_NORMALIZATION = ("auto", "on", "off")


class VoiceSettings(msgspec.Struct, forbid_unknown_fields=True):
    """Judged for range; `speed` must be 1.0 (the model has one speed); the others shape
    ElevenLabs' own voices and have no effect on this model."""

    stability: float | None = None
    similarity_boost: float | None = None
    style: float | None = None
    use_speaker_boost: bool | None = None
    speed: float | None = None


class GenerationConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Judged; has no effect (text segmentation decides when to generate)."""

    chunk_length_schedule: list[float] | None = None


class ElevenLabsInput(msgspec.Struct, forbid_unknown_fields=True):
    """Every client message of stream-input and multi-stream-input (one shape: ElevenLabs
    documents them as one message with optional fields)."""

    text: str | None = None
    flush: bool | None = None
    try_trigger_generation: bool | None = None
    voice_settings: VoiceSettings | None = None
    generation_config: GenerationConfig | None = None
    xi_api_key: str | None = None
    xi_api_key_header_name: str | None = msgspec.field(default=None, name="xi-api-key")
    authorization: str | None = None
    context_id: str | None = None
    contextId: str | None = None  # noqa: N815  (the SDK's alias)
    close_context: bool | None = None
    close_socket: bool | None = None
    pronunciation_dictionary_locators: list[Any] | None = None

    @property
    def key(self) -> str | None:
        """The API key the message carries, in any of the three places ElevenLabs takes it."""
        if self.xi_api_key is not None:
            return self.xi_api_key
        if self.xi_api_key_header_name is not None:
            return self.xi_api_key_header_name
        if self.authorization is not None:
            return self.authorization.removeprefix("Bearer ").strip()
        return None

    @property
    def context(self) -> str | None:
        return self.context_id if self.context_id is not None else self.contextId

    @property
    def opens(self) -> bool:
        """Carries settings only a context's first message may carry."""
        return self.voice_settings is not None or self.generation_config is not None


def _unit(value: float | None, param: str, lo_hi: tuple[float, float] = UNIT_RANGE) -> None:
    lo, hi = lo_hi
    if value is not None and not (lo <= value <= hi):  # NaN fails too
        raise SchemaError(param, f"must be in [{lo:g}, {hi:g}], got {value}")


def judge(msg: ElevenLabsInput, first_of_context: bool) -> None:
    """The checks a Struct cannot express; raises SchemaError naming the field."""
    if msg.context_id is not None and msg.contextId is not None:
        raise SchemaError("contextId", "give context_id or contextId, not both")
    if msg.context is not None and not (1 <= len(msg.context) <= 128) :
        raise SchemaError("context_id", "must be 1 to 128 characters")
    if msg.pronunciation_dictionary_locators:
        raise SchemaError("pronunciation_dictionary_locators", "pronunciation dictionaries are not supported", UNSUPPORTED)
    if msg.opens and not first_of_context:
        field = "voice_settings" if msg.voice_settings is not None else "generation_config"
        raise SchemaError(field, "may only be given in a context's first message")
    vs = msg.voice_settings
    if vs is not None:
        _unit(vs.stability, "voice_settings.stability")
        _unit(vs.similarity_boost, "voice_settings.similarity_boost")
        _unit(vs.style, "voice_settings.style")
        _unit(vs.speed, "voice_settings.speed", SPEED_RANGE)
        check_speed(vs.speed, "voice_settings.speed")
    gc = msg.generation_config
    if gc is not None and gc.chunk_length_schedule is not None:
        lo, hi = CHUNK_SCHEDULE_RANGE
        if not gc.chunk_length_schedule:
            raise SchemaError("generation_config.chunk_length_schedule", "must not be empty")
        for i, v in enumerate(gc.chunk_length_schedule):
            if not (math.isfinite(v) and lo <= v <= hi):
                raise SchemaError(
                    "generation_config.chunk_length_schedule", f"item {i} must be in [{lo:g}, {hi:g}], got {v}"
                )


# ---- query parameters (checked before the upgrade: a mistake is a 400 naming the parameter) ----


@dataclass(frozen=True)
class ElevenLabsQuery:
    output_format: AudioFormat
    model_id: str | None
    auto_mode: bool
    sync_alignment: bool


_BOOL = {"true": True, "false": False}
# accepted and without effect here (ElevenLabs' latency, logging and normalisation switches),
# each still judged for its type
_BOOL_PARAMS = ("auto_mode", "sync_alignment", "enable_logging", "enable_ssml_parsing",
                "apply_language_text_normalization", "try_trigger_generation")
_LANGUAGE = re.compile(r"[a-z]{2,3}(-[A-Za-z]{2,4})?")
_KNOWN = frozenset(
    {*_BOOL_PARAMS, "output_format", "model_id", "inactivity_timeout", "apply_text_normalization", "language_code",
     "optimize_streaming_latency", "seed", "api_key", "xi-api-key"}
)


def _bool(query: MultiMapping[str], name: str, default: bool) -> bool:
    raw = query.get(name)
    if raw is None:
        return default
    if raw.lower() not in _BOOL:
        raise SchemaError(name, f"must be true or false, got {raw!r}")
    return _BOOL[raw.lower()]


def parse_query(query: MultiMapping[str], default_format: str = DEFAULT_OUTPUT_FORMAT) -> ElevenLabsQuery:
    """ElevenLabs' query parameters (LiveKit and Pipecat pass all of these); an unknown one is
    refused naming it (`inactivity_timeout` and the API key are read by the session plumbing)."""
    for name in query:
        if name not in _KNOWN:
            raise SchemaError(name, "unknown query parameter", UNKNOWN)
    try:
        fmt = resolve_format(query.get("output_format", default_format))
    except UnsupportedFormat as e:
        raise SchemaError("output_format", str(e), UNSUPPORTED) from None
    flags = {name: _bool(query, name, name == "sync_alignment") for name in _BOOL_PARAMS}
    norm = query.get("apply_text_normalization")
    if norm is not None and norm not in TEXT_NORMALIZATION:
        raise SchemaError("apply_text_normalization", f"must be one of {', '.join(TEXT_NORMALIZATION)}, got {norm!r}")
    lang = query.get("language_code")
    if lang is not None and not _LANGUAGE.fullmatch(lang):
        raise SchemaError("language_code", f"must be an ISO 639 code such as 'en', got {lang!r}", INVALID_VALUE)
    latency = query.get("optimize_streaming_latency")
    if latency is not None and latency not in ("0", "1", "2", "3", "4"):
        raise SchemaError("optimize_streaming_latency", f"must be 0 to 4, got {latency!r}")
    seed = query.get("seed")
    if seed is not None and not (seed.isdigit() and int(seed) <= 4294967295):
        raise SchemaError("seed", f"must be an integer in [0, 4294967295], got {seed!r}")
    return ElevenLabsQuery(fmt, query.get("model_id"), flags["auto_mode"], flags["sync_alignment"])


def query_seed(query: MultiMapping[str]) -> int | None:
    seed = query.get("seed")
    return int(seed) if seed is not None else None


# ---- timings on the wire -------------------------------------------------------------------------


def ws_alignment(chars: list[CharTime], base_s: float) -> dict | None:
    """The WebSocket alignment object, times in ms from `base_s` (the message's first sample)."""
    if not chars:
        return None
    starts = [max(0, round((c.start_s - base_s) * 1000)) for c in chars]
    ends = [max(0, round((c.end_s - base_s) * 1000)) for c in chars]
    return {"chars": [c.char for c in chars], "charStartTimesMs": starts,
            "charDurationsMs": [max(0, e - s) for s, e in zip(starts, ends)]}


def http_alignment(chars: list[CharTime]) -> dict | None:
    """The HTTP with-timestamps alignment object, times in seconds."""
    if not chars:
        return None
    return {"characters": [c.char for c in chars],
            "character_start_times_seconds": [round(c.start_s, 3) for c in chars],
            "character_end_times_seconds": [round(c.end_s, 3) for c in chars]}
