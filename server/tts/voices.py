"""The front end's view of the served model's speech: voice resolution and prompt building over
the profile's SpeechSpec (streaming/profile.py, read once from the model folder)."""

from __future__ import annotations

from pathlib import Path

from server.errors import invalid_request
from server.tokenizer import TextTokenizer
from streaming.profile import SpeechSpec, read_profile
from streaming.sampling_params import SamplingParams


class SpeechProfile:
    def __init__(self, spec: SpeechSpec | None = None):
        self.spec = spec if spec is not None else SpeechSpec()
        self.spec.check()

    @classmethod
    def load(cls, model_dir: str | Path) -> "SpeechProfile":
        """The folder's speech profile; ValueError (ProfileError) naming omnistream.json and the
        field when it is unusable."""
        return cls(read_profile(model_dir).speech)

    @property
    def voices(self) -> tuple[str, ...]:
        return self.spec.voices

    @property
    def default_voice(self) -> str:
        return self.spec.default_voice

    @property
    def add_bos(self) -> bool:
        return self.spec.add_bos

    @property
    def sample_rate(self) -> int:
        return self.spec.sample_rate

    @property
    def sampling(self) -> SamplingParams:
        return self.spec.sampling

    def resolve_voice(self, voice: str | None) -> str:
        """The voice to use; unknown -> 400 naming `voice` and listing the valid ones."""
        if voice is None:
            return self.spec.default_voice
        if voice not in self.spec.voices:
            raise invalid_request(
                f"voice: unknown voice {voice!r}; available voices: {', '.join(self.spec.voices)}",
                param="voice",
            )
        return voice

    def build_prompt(self, tokenizer: TextTokenizer, voice: str, text: str) -> list[int]:
        s = self.spec
        body = tokenizer.encode(s.text_template.format(voice=voice, text=text), add_bos=s.add_bos)
        return [*s.prefix_token_ids, *body, *s.suffix_token_ids]
