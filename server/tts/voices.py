"""The front end's view of the served model's speech: voice resolution and prompt building over
the profile's SpeechSpec (streaming/profile.py, read once from the model folder) and, for models
that take reference audio (CSM), the uploaded voices (server/tts/voice_store.py). A model
without speech (a plain language model, or an Orpheus folder served without a codec) has a
SpeechProfile with no spec: it lists no voices and every speech request is answered with one
clear error.

A reference voice's prompt is the model's conversation format with the clip first, as
transformers' CSM chat template lays it out: the clip's transcript spoken by the voice's
speaker, one frame position per clip frame and the audio end, then the text to speak:

    prefix + [bos] template(speaker, transcript) + suffix + [frame] * F + [audio end]
           + [bos] template(speaker, text) + suffix

Every request in the voice starts with the same ids and frames, so the prefix cache computes
the clip once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from server.errors import APIError, invalid_request
from server.tokenizer import TextTokenizer
from server.tts.clips import ClipCache
from server.tts.qwen3_tts_prompt import Qwen3TtsPrompts, Qwen3TtsRows
from server.tts.voice_store import ReferenceVoice, VoiceStore
from streaming.ipc import AddRequest, PromptVector
from streaming.profile import SpeechSpec, read_profile
from streaming.sampling_params import SamplingParams


def no_speech_error() -> APIError:
    return invalid_request("model: this model has no speech profile (a text model, or served without a codec): "
                           "use /v1/completions or the generate stream", param="model", code="model_has_no_speech")


@dataclass(frozen=True)
class SpeechPrompt:
    ids: list[int]
    frames: list[list[int]] | None = None  # a reference voice's codes, one row per frame position
    # Qwen3-TTS (frames: the codec part of every position): the text ids fed with generated frames
    step_text_ids: list[int] | None = None
    # Qwen3-TTS Base: a cloned voice's x-vector over its speaker position
    vectors: list[PromptVector] | None = None

    def add_request(self, request_id: str, sampling: SamplingParams, text_open: bool = False) -> AddRequest:
        """The engine request speaking this prompt (every protocol's speech requests);
        text_open: its text is still arriving (SpeechProfile.build_open_prompt)."""
        return AddRequest(request_id=request_id, prompt_token_ids=self.ids, sampling=sampling, audio=True,
                          prompt_frames=self.frames, step_text_ids=self.step_text_ids, prompt_vectors=self.vectors,
                          step_text_open=text_open)


class SpeechProfile:
    def __init__(self, spec: SpeechSpec | None = SpeechSpec(), store: VoiceStore | None = None):
        """store: uploaded reference voices (only where the spec takes reference audio)."""
        self.spec = spec
        if spec is not None:
            spec.check()
        self.store = store if spec is not None and spec.takes_reference_audio else None
        # vllm-omni's per-request clips (ref_audio), encoded once (server/tts/clips.py)
        self.clips = ClipCache() if spec is not None and spec.clones_voices else None
        # the prompt layout, chosen once: Qwen3-TTS's rows, else text_template's ids
        self._qwen3 = Qwen3TtsPrompts(spec.qwen3_tts) if spec is not None and spec.qwen3_tts is not None else None

    @property
    def takes_reference_voices(self) -> bool:
        return self.spec is not None and self.spec.takes_reference_audio

    @property
    def task_type(self) -> str:
        """vllm-omni's name for what the model does: "VoiceDesign" (voice described by the
        instructions), "Base" (uploaded clips cloned), else "CustomVoice" (named voices)."""
        q = self.spec.qwen3_tts if self.spec is not None else None
        if q is not None and q.designs_voice:
            return "VoiceDesign"
        return "Base" if self.clones_voices else "CustomVoice"

    @property
    def clones_voices(self) -> bool:
        """Every voice is an upload (Qwen3-TTS Base): a transcript is optional (without one the
        voice is its x-vector alone), and no built-in speaker voices it."""
        return self.spec is not None and self.spec.clones_voices

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
        """The built-in voices, then the uploaded ones."""
        if self.spec is None:
            return ()
        return self.spec.voices + (tuple(v.name for v in self.store.list()) if self.store is not None else ())

    def reference_voice(self, name: str) -> ReferenceVoice | None:
        """An uploaded voice, or a per-request clip by its clip_key name."""
        voice = self.store.get(name) if self.store is not None else None
        if voice is None and self.clips is not None:
            voice = self.clips.get(name)
        return voice

    @property
    def languages(self) -> tuple[str, ...]:
        """Language names a request may pick besides auto (Qwen3-TTS's); () for a model that
        takes no language hint."""
        return tuple(self.spec.qwen3_tts.languages) if self._qwen3 is not None else ()

    @property
    def takes_instructions(self) -> bool:
        """Whether `instructions` reach the prompt (Qwen3-TTS's instruct turn)."""
        return self._qwen3 is not None and self._qwen3.ids.takes_instruct

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
        if not voice and s.clones_voices:
            raise self._no_voice()
        if voice is None:
            return s.default_voice
        if voice not in s.voices and self.reference_voice(voice) is None:
            raise invalid_request(
                f"voice: unknown voice {voice!r}; available voices: {', '.join(self.voices)}",
                param="voice",
            )
        return voice

    def _turn(self, body: list[int]) -> list[int]:
        s = self._need()
        return [*s.prefix_token_ids, *body, *s.suffix_token_ids]

    def _reference_ids(self, tokenizer: TextTokenizer, ref: ReferenceVoice | None) -> list[int]:
        """The voice's reference turn (transcript, frame positions, audio end); [] for a built-in voice."""
        if ref is None:
            return []
        s = self._need()
        frame_id, end_id = s.reference_audio_ids
        said = tokenizer.encode(s.text_template.format(voice=ref.speaker, text=ref.transcript), add_bos=s.add_bos)
        return [*self._turn(said), *([frame_id] * ref.num_frames), end_id]

    @staticmethod
    def _frames(ref: ReferenceVoice | None) -> list[list[int]] | None:
        return ref.codes.tolist() if ref is not None else None

    def _no_voice(self) -> APIError:
        uploaded = ", ".join(self.voices) or "none yet"
        return invalid_request(f"voice: this model speaks uploaded voices only: name one (uploaded: {uploaded}; "
                               "POST /v1/audio/voices adds one)", param="voice")

    def _known(self, voice: str) -> ReferenceVoice | None:
        """The voice's reference clip (None for a built-in voice). A session keeps its voice by
        name, so an uploaded voice deleted since is refused naming `voice` here, rather than
        spoken as a made-up speaker of that name."""
        if not voice and self._need().clones_voices:
            raise self._no_voice()
        ref = self.reference_voice(voice)
        if ref is None and voice not in self._need().voices:
            raise invalid_request(f"voice: {voice!r} is no longer available (an uploaded voice deleted since it was "
                                  "chosen)", param="voice")
        return ref

    def build_prompt(self, tokenizer: TextTokenizer, voice: str, text: str) -> SpeechPrompt:
        ref = self._known(voice)
        if self._qwen3 is not None:
            return _rows_prompt(self._qwen3.encode(tokenizer, voice, text, clone=_clone(ref)), ref)
        if ref is not None:
            return self.build_prompt_for(tokenizer, ref, text)
        s = self._need()
        return SpeechPrompt(self._turn(tokenizer.encode(s.text_template.format(voice=voice, text=text), add_bos=s.add_bos)))

    def build_prompt_for(self, tokenizer: TextTokenizer, ref: ReferenceVoice, text: str) -> SpeechPrompt:
        """The prompt of `text` in a reference voice (stored or about to be)."""
        if self._qwen3 is not None:
            return _rows_prompt(self._qwen3.encode(tokenizer, ref.name, text, clone=_clone(ref)), ref)
        s = self._need()
        body = tokenizer.encode(s.text_template.format(voice=ref.speaker, text=text), add_bos=s.add_bos)
        return SpeechPrompt([*self._reference_ids(tokenizer, ref), *self._turn(body)], self._frames(ref))

    async def build_prompt_async(self, tokenizer: TextTokenizer, voice: str, text: str, language: str | None = None,
                                 instructions: str | None = None) -> SpeechPrompt:
        """build_prompt with a long text tokenized off the event loop (TextTokenizer.encode_async).
        language (None: auto) / instructions: Qwen3-TTS only; others refuse them naming the field."""
        s = self._need()
        ref = self._known(voice)
        if self._qwen3 is not None:
            return _rows_prompt(await self._qwen3.encode_async(tokenizer, voice, text, language, instructions,
                                                               clone=_clone(ref)), ref)
        for name, value in (("language", language), ("instructions", instructions)):
            if value is not None:
                raise invalid_request(f"{name}: this model takes none", param=name)
        speaker = ref.speaker if ref is not None else voice
        body = await tokenizer.encode_async(s.text_template.format(voice=speaker, text=text), add_bos=s.add_bos)
        return SpeechPrompt([*self._reference_ids(tokenizer, ref), *self._turn(body)], self._frames(ref))

    @property
    def takes_streamed_text(self) -> bool:
        """Whether a request's text may keep arriving while it speaks (Qwen3-TTS's streaming
        text layout: one text id fed with each generated frame)."""
        return self._qwen3 is not None

    def end_of_text(self) -> list[int]:
        """The step text that closes a streamed text (Qwen3-TTS: tts_eos)."""
        return [self._qwen3.ids.tts_eos]

    async def build_open_prompt(self, tokenizer: TextTokenizer, voice: str, text_ids: list[int],
                                language: str | None = None, instructions: str | None = None) -> SpeechPrompt | None:
        """The prompt of a text still arriving (takes_streamed_text), `text_ids` its final ids
        so far (StreamedText); None until they fix the prompt. Its AddRequest goes with
        step_text_open; the rest of the text follows as AppendText, closed by end_of_text()."""
        if not self.takes_streamed_text:
            raise invalid_request("stream_input: this model speaks whole texts only", param="stream_input")
        ref = self._known(voice)
        rows = await self._qwen3.encode_open(tokenizer, voice, text_ids, language, instructions, clone=_clone(ref))
        return None if rows is None else _rows_prompt(rows, ref)


def _clone(ref: ReferenceVoice | None) -> tuple[str, list[list[int]]] | None:
    """A Base voice's (transcript, frames) for Qwen3TtsPrompts: ICL with a transcript, the
    x-vector alone without one. None for a built-in voice."""
    if ref is None:
        return None
    return (ref.transcript, ref.codes.tolist()) if ref.transcript else ("", [])


def _rows_prompt(rows: Qwen3TtsRows, ref: ReferenceVoice | None) -> SpeechPrompt:
    vectors = None
    if rows.vector_row is not None:
        assert ref is not None and ref.speaker_embedding is not None, "a clone prompt without its voice's x-vector"
        vectors = [PromptVector(rows.vector_row, ref.speaker_embedding.astype("<f4").tobytes())]
    return SpeechPrompt(rows.ids, rows.frames, rows.step_text_ids or None, vectors)
