"""Speech profile of the served model: voices, prompt template, default sampling.

Defaults are Orpheus-3B's (English, eight voices). Another model of the family describes
itself with an optional `omnistream.json` next to its weights, e.g.

    {"voices": ["tara", "leo"], "default_voice": "tara", "text_template": "{voice}: {text}",
     "prefix_token_ids": [128259], "suffix_token_ids": [128009, 128260, 128261, 128257],
     "add_bos": true, "sample_rate": 24000,
     "sampling": {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.1,
                  "max_tokens": 1200, "stop_token_ids": [128258]}}

Every key is optional; unknown keys are a start-up error (a typo must not silently fall back
to a default). A `codec` section may sit beside these keys: it belongs to the engine
(runner.models.folder) and is not read here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from server.errors import invalid_request
from server.tokenizer import TextTokenizer
from streaming.sampling_params import (
    InvalidRequest,
    SamplingParams,
    decode_sampling_params,
)

PROFILE_FILE = "omnistream.json"

ORPHEUS_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
# Orpheus special tokens: start_of_human; end_of_text, end_of_human, start_of_ai,
# start_of_speech; generation ends at end_of_speech (128258).
ORPHEUS_PREFIX = (128259,)
ORPHEUS_SUFFIX = (128009, 128260, 128261, 128257)
ORPHEUS_END_OF_SPEECH = 128258


def _orpheus_sampling() -> SamplingParams:
    # Orpheus needs repetition_penalty >= 1.1 to avoid looping audio.
    return SamplingParams(
        temperature=0.6,
        top_p=0.8,
        repetition_penalty=1.1,
        max_tokens=1200,
        stop_token_ids=[ORPHEUS_END_OF_SPEECH],
    )


@dataclass(frozen=True)
class SpeechProfile:
    voices: tuple[str, ...] = ORPHEUS_VOICES
    default_voice: str = "tara"
    text_template: str = "{voice}: {text}"
    prefix_token_ids: tuple[int, ...] = ORPHEUS_PREFIX
    suffix_token_ids: tuple[int, ...] = ORPHEUS_SUFFIX
    add_bos: bool = True
    sample_rate: int = 24000
    sampling: SamplingParams = field(default_factory=_orpheus_sampling)

    def __post_init__(self) -> None:
        if not self.voices or len(set(self.voices)) != len(self.voices):
            raise ValueError(f"SpeechProfile.voices: must be non-empty and unique, got {self.voices!r}")
        if self.default_voice not in self.voices:
            raise ValueError(f"SpeechProfile.default_voice: {self.default_voice!r} is not one of {self.voices!r}")
        if "{text}" not in self.text_template:
            raise ValueError(f"SpeechProfile.text_template: must contain {{text}}, got {self.text_template!r}")
        try:
            self.text_template.format(voice="v", text="t")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"SpeechProfile.text_template: only {{voice}} and {{text}} may appear ({e})") from None
        if self.sample_rate <= 0:
            raise ValueError(f"SpeechProfile.sample_rate: must be > 0, got {self.sample_rate}")
        try:
            self.sampling.validate(vocab_size=2**31)
        except InvalidRequest as e:
            raise ValueError(f"SpeechProfile.{e}") from None

    @classmethod
    def load(cls, model_dir: str | Path) -> "SpeechProfile":
        path = Path(model_dir) / PROFILE_FILE
        if not path.exists():
            return cls()
        try:
            raw = msgspec.json.decode(path.read_bytes(), type=_ProfileFile)
        except msgspec.ValidationError as e:
            raise ValueError(f"{path}: {e}") from None
        kw: dict = {}
        for name in ("text_template", "add_bos", "sample_rate"):
            value = getattr(raw, name)
            if value is not None:
                kw[name] = value
        for name in ("voices", "prefix_token_ids", "suffix_token_ids"):
            value = getattr(raw, name)
            if value is not None:
                kw[name] = tuple(value)
        if raw.default_voice is not None:
            kw["default_voice"] = raw.default_voice
        elif raw.voices:
            kw["default_voice"] = raw.voices[0]
        if raw.sampling is not None:
            try:
                kw["sampling"] = decode_sampling_params(raw.sampling)
            except InvalidRequest as e:
                raise ValueError(f"{path}: {e}") from None
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def resolve_voice(self, voice: str | None) -> str:
        """The voice to use; unknown -> 400 naming `voice` and listing the valid ones."""
        if voice is None:
            return self.default_voice
        if voice not in self.voices:
            raise invalid_request(
                f"voice: unknown voice {voice!r}; available voices: {', '.join(self.voices)}",
                param="voice",
            )
        return voice

    def build_prompt(self, tokenizer: TextTokenizer, voice: str, text: str) -> list[int]:
        body = tokenizer.encode(self.text_template.format(voice=voice, text=text), add_bos=self.add_bos)
        return [*self.prefix_token_ids, *body, *self.suffix_token_ids]


class _ProfileFile(msgspec.Struct, forbid_unknown_fields=True):
    voices: list[str] | None = None
    default_voice: str | None = None
    text_template: str | None = None
    prefix_token_ids: list[int] | None = None
    suffix_token_ids: list[int] | None = None
    add_bos: bool | None = None
    sample_rate: int | None = None
    sampling: dict | None = None
    codec: dict | None = None  # the engine's section (runner.models.folder), not ours
