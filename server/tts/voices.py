"""The front end's view of the served model's speech: voice resolution and prompt building over
the profile's SpeechSpec (streaming/profile.py, read once from the model folder). A model
without speech (a plain language model, or an Orpheus folder served without a codec) has a
SpeechProfile with no spec: it lists no voices and every speech request is answered with one
clear error."""

from __future__ import annotations

from pathlib import Path

from server.errors import APIError, invalid_request
from server.tokenizer import TextTokenizer
from streaming.profile import SpeechSpec, read_profile
from streaming.sampling_params import SamplingParams


def no_speech_error() -> APIError:
    return invalid_request("model: this model has no speech profile (a text model, or served without a codec): "
                           "use /v1/completions or the generate stream", param="model", code="model_has_no_speech")


class SpeechProfile:
    def __init__(self, spec: SpeechSpec | None = SpeechSpec()):
        self.spec = spec
        if spec is not None:
            spec.check()

    @classmethod
    def load(cls, model_dir: str | Path) -> "SpeechProfile":
        """The folder's speech half; ValueError (ProfileError) naming omnistream.json and the
        field when it is unusable."""
        return cls(read_profile(model_dir).speech)

    @property
    def speaks(self) -> bool:
        return self.spec is not None

    def _need(self) -> SpeechSpec:
        if self.spec is None:
            raise no_speech_error()
        return self.spec

    @property
    def voices(self) -> tuple[str, ...]:
        return self.spec.voices if self.spec is not None else ()

    @property
    def default_voice(self) -> str | None:
        return self.spec.default_voice if self.spec is not None else None

    @property
    def add_bos(self) -> bool:
        return self._need().add_bos

    @property
    def sample_rate(self) -> int:
        return self.spec.sample_rate if self.spec is not None else 0

    @property
    def sampling(self) -> SamplingParams:
        return self._need().sampling

    def resolve_voice(self, voice: str | None) -> str:
        """The voice to use; unknown -> 400 naming `voice` and listing the valid ones."""
        s = self._need()
        if voice is None:
            return s.default_voice
        if voice not in s.voices:
            raise invalid_request(
                f"voice: unknown voice {voice!r}; available voices: {', '.join(s.voices)}",
                param="voice",
            )
        return voice

    def build_prompt(self, tokenizer: TextTokenizer, voice: str, text: str) -> list[int]:
        s = self._need()
        body = tokenizer.encode(s.text_template.format(voice=voice, text=text), add_bos=s.add_bos)
        return [*s.prefix_token_ids, *body, *s.suffix_token_ids]

    async def build_prompt_async(self, tokenizer: TextTokenizer, voice: str, text: str) -> list[int]:
        """build_prompt with a long text tokenized off the event loop (TextTokenizer.encode_async)."""
        s = self._need()
        body = await tokenizer.encode_async(s.text_template.format(voice=voice, text=text), add_bos=s.add_bos)
        return [*s.prefix_token_ids, *body, *s.suffix_token_ids]
