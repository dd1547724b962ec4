"""The speech requests' schema (HTTP /v1/audio/speech, the WebSocket session's messages,
ElevenLabs' stream-input), re-exported by streaming/schema.py, the schema's public face: the
Structs of the speech fields and the checks of voice, speed, language and instructions. Errors
are SchemaErrors naming the client's field, as everywhere in the schema."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from streaming.schema_door import INVALID_VALUE, UNSUPPORTED, SchemaError

SPEED_RANGE = (0.25, 4.0)  # OpenAI's bounds; only 1.0 is served


class SpeechSampling(msgspec.Struct, forbid_unknown_fields=True):
    """The speech endpoints' flat sampling fields (`max_new_tokens` is SamplingParams' max_tokens)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None

    def given(self) -> dict[str, Any]:
        out = {}
        for f in SpeechSampling.__struct_fields__:
            v = getattr(self, f)
            if v is not None:
                out["max_tokens" if f == "max_new_tokens" else f] = v
        return out


SPEECH_NAMES: Mapping[str, str] = {"max_tokens": "max_new_tokens"}


class SpeechOptions(SpeechSampling):
    """How to speak: shared by the HTTP body and the WebSocket `session.config`."""

    model: str | None = None  # any name: one model is served
    voice: str | dict[str, Any] | None = None  # a name or OpenAI's {"id": name}
    speed: float | None = None
    instructions: str | None = None
    language: str | None = None  # vllm-omni: "Auto" or one of the model's languages (Qwen3-TTS)


class SpeechRequest(SpeechOptions):
    """POST /v1/audio/speech."""

    input: str | None = None  # required; None so "null" and "missing" get the same message
    response_format: str | None = None
    stream_format: str | None = None  # "audio" | "sse"
    stream: bool | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used (as on completions)
    # vllm-omni's Qwen3-TTS fields: the model's kind, and a Base model's per-request clip
    task_type: str | None = None  # CustomVoice | VoiceDesign | Base: only the served model's
    ref_audio: str | None = None  # the clip inline: base64 or a data: URL (no URL is fetched)
    ref_text: str | None = None  # its transcript (ICL); without it the voice is the x-vector alone
    x_vector_only_mode: bool | None = None  # true: the x-vector alone even with ref_text


class SessionConfig(SpeechOptions, tag_field="type", tag="session.config"):
    """WS /v1/audio/speech/stream `session.config`. `task_type`, `language` and `stream_audio`
    are vllm-omni's names, judged so a vllm-omni client learns which of its values apply."""

    response_format: str | None = None  # only "pcm"
    sample_rate: int | None = None  # only the model's
    task_type: str | None = None  # vllm-omni: CustomVoice (named voices) | VoiceDesign | Base
    stream_audio: bool | None = None  # vllm-omni: true = PCM frames while they are produced
    # true: input.text pieces join one utterance that speaks while its text arrives, until
    # input.flush (Qwen3-TTS); false: text is cut into sentences, one utterance each
    stream_input: bool | None = None


class InputText(msgspec.Struct, tag_field="type", tag="input.text", forbid_unknown_fields=True):
    text: str


class InputFlush(msgspec.Struct, tag_field="type", tag="input.flush", forbid_unknown_fields=True):
    pass


class SessionClose(msgspec.Struct, tag_field="type", tag="session.close", forbid_unknown_fields=True):
    pass


class InputDone(msgspec.Struct, tag_field="type", tag="input.done", forbid_unknown_fields=True):
    """vllm-omni's end of input: speak what is buffered, then `session.done` (as session.close)."""


SPEECH_STREAM_MESSAGES: Mapping[str, type[msgspec.Struct]] = {
    "session.config": SessionConfig,
    "input.text": InputText,
    "input.flush": InputFlush,
    "session.close": SessionClose,
    "input.done": InputDone,
}


def voice_name(value: str | dict[str, Any] | None, param: str = "voice") -> str | None:
    """OpenAI's voice: a name or {"id": name}; None = the default voice."""
    if isinstance(value, dict):
        if set(value) != {"id"} or not isinstance(value["id"], str):
            raise SchemaError(param, 'an object voice is {"id": "<name>"}')
        return value["id"]
    return value


def check_speed(speed: float | None, param: str = "speed") -> None:
    if speed is None:
        return
    lo, hi = SPEED_RANGE
    if not lo <= speed <= hi:  # NaN fails this too
        raise SchemaError(param, f"must be in [{lo}, {hi}], got {speed}")
    if speed != 1.0:
        raise SchemaError(param, f"only 1.0 is supported by this server (got {speed})", UNSUPPORTED)


AUTO_LANGUAGE = "auto"  # the model reads the text as it is


def check_language(language: str | None, languages: tuple[str, ...] = ()) -> str | None:
    """vllm-omni's `language`: None (absent or Auto: the model reads the text as it is) or one
    of `languages` (the served model's, lower case; Qwen3-TTS's codec_language_id names),
    returned lower case. A model without languages takes only Auto."""
    if language is None or language.lower() == AUTO_LANGUAGE:
        return None
    if not languages:
        raise SchemaError("language", f"this model takes no language hint (it reads the text as written); omit it "
                          f"or send 'Auto', got {language!r}", UNSUPPORTED)
    if language.lower() not in languages:
        raise SchemaError("language", f"must be 'Auto' or one of {', '.join(languages)}, got {language!r}",
                          INVALID_VALUE)
    return language.lower()


def check_speech_options(opts: SpeechOptions, takes_instructions: bool = False) -> None:
    """The speech fields HTTP and session.config share (sampling goes through sampling_params).
    takes_instructions: the served model reads `instructions` (Qwen3-TTS's instruct)."""
    check_speed(opts.speed)
    if not takes_instructions and opts.instructions is not None and opts.instructions.strip():
        raise SchemaError("instructions", "this model does not take voice instructions", UNSUPPORTED)
