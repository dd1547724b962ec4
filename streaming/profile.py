"""What a model folder says about itself beyond config.json, read once: the model profile.

A folder may hold an `omnistream.json`; without one the family's defaults apply (Orpheus-3B's
layout for the `orpheus` family). The server reads the profile once at start-up and hands it to
the engine process inside its arguments, so neither side parses the file again:

    {"family": "orpheus",
     "voices": ["tara", "leo"], "default_voice": "tara", "text_template": "{voice}: {text}",
     "prefix_token_ids": [128259], "suffix_token_ids": [128009, 128260, 128261, 128257],
     "add_bos": true, "sample_rate": 24000,
     "sampling": {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.1,
                  "max_tokens": 1200, "stop_token_ids": [128258]},
     "codec": {"path": "snac", "audio_token_offset": 128266, "codebook_size": 4096,
               "end_token_id": 128258}}

Every key is optional; unknown keys are a start-up error naming the file (a typo must not
silently fall back to a default). `codec.path` is relative to the model folder or absolute; the
other `codec` keys are the codec stage's settings (runner/codecs), checked when it is built.

Families: `orpheus` (a Llama emitting SNAC codes one token at a time: a frame of one code per
step), `csm` (Sesame CSM: a frame of K codebooks per step, Mimi codec; its prompt is transformers'
chat template, `[speaker]text` between begin- and end-of-text, voices are speaker ids) and `text`
(a plain language model: no speech, no codec). A folder without the file is `csm` when
config.json names `CsmForConditionalGeneration` (its codec is the folder's own `codec_model`
unless `codec.path` or --codec names a Mimi folder); else `orpheus` when its vocabulary holds
Orpheus's audio tokens or a codec is given on the command line; else `text`: a plain Llama /
Qwen folder serves completions, never a speech profile it does not have. A folder naming
`Qwen3TTSForConditionalGeneration` is `qwen3_tts` (streaming/qwen3_tts_profile.py: voices are
its speakers, the prompt is laid out by server/tts/qwen3_tts_prompt.py; its codec is the
folder's `speech_tokenizer/` unless `codec.path` or --codec names one).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from streaming.qwen3_tts_ids import Qwen3TtsIdsError
from streaming.qwen3_tts_profile import (
    QWEN3_TTS_SAMPLE_RATE,
    VOICE_DESIGN_VOICE,
    Qwen3TtsPromptIds,
    qwen3_tts_prompt_ids,
    qwen3_tts_sampling,
)
from streaming.sampling_params import (
    InvalidRequest,
    SamplingParams,
    decode_sampling_params,
)

PROFILE_FILE = "omnistream.json"
FAMILIES = ("orpheus", "csm", "qwen3_tts", "text")

# Orpheus-3B's layout: the defaults of the `orpheus` family, stated here once.
ORPHEUS_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
# start_of_human; then end_of_text, end_of_human, start_of_ai, start_of_speech
ORPHEUS_PREFIX = (128259,)
ORPHEUS_SUFFIX = (128009, 128260, 128261, 128257)
ORPHEUS_END_OF_SPEECH = 128258
ORPHEUS_AUDIO_TOKEN_OFFSET = 128266  # audio token = offset + slot * codebook_size + code
ORPHEUS_CODEBOOK_SIZE = 4096
ORPHEUS_TOKENS_PER_FRAME = 7  # codebook slots per SNAC frame (runner/codecs/orpheus_tokens.py: its levels)
ORPHEUS_SAMPLE_RATE = 24000


# Sesame CSM-1B's layout (Llama-3 tokenizer; transformers' CsmProcessor chat template)
CSM_ARCHITECTURE = "CsmForConditionalGeneration"
CSM_BEGIN_OF_TEXT = 128000
CSM_END_OF_TEXT = 128001
CSM_VOICES = ("0", "1")  # speaker ids
CSM_SAMPLE_RATE = 24000

QWEN3_TTS_ARCHITECTURE = "Qwen3TTSForConditionalGeneration"
QWEN3_TTS_CODEC_DIR = "speech_tokenizer"  # the 12 Hz codec inside a released folder


def csm_speech() -> SpeechSpec:
    # Sesame's generator samples every codebook at temperature 0.9 among the top 50 codes;
    # max_tokens counts frames (12.5 a second): 90 s of speech
    return SpeechSpec(voices=CSM_VOICES, default_voice="0", text_template="[{voice}]{text}", prefix_token_ids=(),
                      suffix_token_ids=(CSM_END_OF_TEXT,), add_bos=True, sample_rate=CSM_SAMPLE_RATE,
                      sampling=SamplingParams(temperature=0.9, top_k=50, max_tokens=1125))


def orpheus_sampling(end_token_id: int = ORPHEUS_END_OF_SPEECH) -> SamplingParams:
    # Orpheus needs repetition_penalty >= 1.1 to avoid looping audio.
    return SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=1200,
                          stop_token_ids=[end_token_id])


class ProfileError(ValueError):
    """The model folder's profile is unusable; the message names the file and the field."""


class SpeechSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the front end turns (voice, text) into a prompt, and the speech defaults."""

    voices: tuple[str, ...] = ORPHEUS_VOICES
    default_voice: str = "tara"
    text_template: str = "{voice}: {text}"
    prefix_token_ids: tuple[int, ...] = ORPHEUS_PREFIX
    suffix_token_ids: tuple[int, ...] = ORPHEUS_SUFFIX
    add_bos: bool = True
    sample_rate: int = ORPHEUS_SAMPLE_RATE
    sampling: SamplingParams = msgspec.field(default_factory=orpheus_sampling)
    # (frame position id, audio end id) of a reference clip inside a prompt, for models that
    # take uploaded reference voices (CSM: config.json's audio_token_id, audio_eos_token_id);
    # None: only the built-in voices
    reference_audio_ids: tuple[int, int] | None = None
    # Qwen3-TTS: the prompt is rows of text and codec ids (server/tts/qwen3_tts_prompt.py), not
    # text_template; None for every other family
    qwen3_tts: Qwen3TtsPromptIds | None = None

    @property
    def clones_voices(self) -> bool:
        """Every voice is an uploaded clip (Qwen3-TTS Base): no built-in voice, no default."""
        return self.qwen3_tts is not None and self.qwen3_tts.clones_voice

    @property
    def takes_reference_audio(self) -> bool:
        """Whether voices may be uploaded as reference clips (CSM, Qwen3-TTS Base)."""
        return self.reference_audio_ids is not None or self.clones_voices

    def check(self) -> None:
        """Raise ProfileError naming the field."""
        if self.clones_voices:
            if self.voices or self.default_voice:
                raise ProfileError("voices: a voice-clone model has no built-in voices (its voices are uploaded)")
        elif not self.voices or len(set(self.voices)) != len(self.voices):
            raise ProfileError(f"voices: must be non-empty and unique, got {list(self.voices)!r}")
        elif self.default_voice not in self.voices:
            raise ProfileError(f"default_voice: {self.default_voice!r} is not one of {list(self.voices)!r}")
        if "{text}" not in self.text_template:
            raise ProfileError(f"text_template: must contain {{text}}, got {self.text_template!r}")
        try:
            self.text_template.format(voice="v", text="t")
        except (KeyError, IndexError, ValueError) as e:
            raise ProfileError(f"text_template: only {{voice}} and {{text}} may appear ({e})") from None
        if self.sample_rate <= 0:
            raise ProfileError(f"sample_rate: must be > 0, got {self.sample_rate}")
        try:
            self.sampling.validate(vocab_size=2**31)  # ids are checked against the real vocabulary per request
        except InvalidRequest as e:
            raise ProfileError(str(e)) from None


class ModelProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model folder's family, speech front end and codec section."""

    family: str = "orpheus"
    speech: SpeechSpec | None = msgspec.field(default_factory=SpeechSpec)  # None: no speech
    # The codec stage's settings with `path` resolved; None: no codec (text only).
    codec: dict | None = None

    @property
    def speaks(self) -> bool:
        """Speech needs both halves: the prompt format and a codec stage."""
        return self.speech is not None and self.codec is not None

    @property
    def sample_rate(self) -> int:
        return self.speech.sample_rate if self.speech is not None else 0


class _ProfileFile(msgspec.Struct, forbid_unknown_fields=True):
    family: str = "orpheus"
    voices: list[str] | None = None
    default_voice: str | None = None
    text_template: str | None = None
    prefix_token_ids: list[int] | None = None
    suffix_token_ids: list[int] | None = None
    add_bos: bool | None = None
    sample_rate: int | None = None
    sampling: dict | None = None
    codec: dict | None = None


def read_profile(model_dir: str | Path, codec_path: str | None = None) -> ModelProfile:
    """The folder's profile (its omnistream.json over the family's defaults). `codec_path`
    (the command line's --codec) overrides `codec.path`; an orpheus folder without a codec path
    has no codec stage. Raises ProfileError naming the file and field."""
    folder = Path(model_dir)
    path = folder / PROFILE_FILE
    if not path.is_file():
        arch = _architectures(folder)
        if CSM_ARCHITECTURE in arch:
            family = "csm"
        elif QWEN3_TTS_ARCHITECTURE in arch:
            family = "qwen3_tts"
        else:
            family = "orpheus" if codec_path is not None or _holds_orpheus_tokens(folder) else "text"
        raw = _ProfileFile(family=family)
    else:
        try:
            raw = msgspec.json.decode(path.read_bytes(), type=_ProfileFile)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ProfileError(f"{path}: {e}") from None
    if raw.family not in FAMILIES:
        raise ProfileError(f"{path}: family: {raw.family!r} is not one of {list(FAMILIES)}")
    if raw.family == "text":
        return ModelProfile(family="text", speech=None, codec=None)
    try:
        if raw.family == "qwen3_tts":
            defaults = _qwen3_tts_speech(folder)
        else:
            defaults = csm_speech() if raw.family == "csm" else SpeechSpec()
        speech = _speech(raw, defaults)
        speech.check()
    except (ProfileError, InvalidRequest) as e:
        raise ProfileError(f"{path}: {e}") from None
    if raw.family == "qwen3_tts":
        return ModelProfile(family="qwen3_tts", speech=speech,
                            codec=_csm_codec(folder, raw.codec, codec_path, default=folder / QWEN3_TTS_CODEC_DIR))
    if raw.family == "csm":
        cfg = _config(folder)
        speech = msgspec.structs.replace(speech, reference_audio_ids=(int(cfg.get("audio_token_id", 128002)),
                                                                      int(cfg.get("audio_eos_token_id", 128003))))
        return ModelProfile(family="csm", speech=speech, codec=_csm_codec(folder, raw.codec, codec_path))
    return ModelProfile(family=raw.family, speech=speech, codec=_codec(folder, raw.codec, codec_path))


def _config(folder: Path) -> dict:
    cfg = folder / "config.json"
    try:
        raw = json.loads(cfg.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{cfg}: missing (a model folder needs config.json, *.safetensors and tokenizer.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"{cfg}: not a JSON object ({e})") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"{cfg}: not a JSON object")
    return raw


def _architectures(folder: Path) -> list:
    arch = _config(folder).get("architectures") or []
    return arch if isinstance(arch, list) else []


def _holds_orpheus_tokens(folder: Path) -> bool:
    """Whether config.json's vocabulary reaches past Orpheus-3B's audio tokens and end token."""
    vocab = _config(folder).get("vocab_size", 0)
    return isinstance(vocab, int) and vocab >= ORPHEUS_AUDIO_TOKEN_OFFSET + ORPHEUS_TOKENS_PER_FRAME * ORPHEUS_CODEBOOK_SIZE


def _speech(raw: _ProfileFile, defaults: SpeechSpec) -> SpeechSpec:
    """The file's speech keys over the family's defaults."""
    kw: dict = {}
    for name in ("text_template", "add_bos", "sample_rate"):
        if (value := getattr(raw, name)) is not None:
            kw[name] = value
    for name in ("voices", "prefix_token_ids", "suffix_token_ids"):
        if (value := getattr(raw, name)) is not None:
            kw[name] = tuple(value)
    if raw.default_voice is not None:
        kw["default_voice"] = raw.default_voice
    elif raw.voices:
        kw["default_voice"] = raw.voices[0]
    if raw.sampling is not None:
        kw["sampling"] = decode_sampling_params(raw.sampling)
    return msgspec.structs.replace(defaults, **kw)


def _qwen3_tts_speech(folder: Path) -> SpeechSpec:
    """Qwen3-TTS's defaults: its speakers as voices (the first the default), its prompt ids and
    code-0 sampling. VoiceDesign: one voice, VOICE_DESIGN_VOICE (the request's instructions
    describe it). Base: no built-in voice (each is an uploaded clip, server/tts/voice_store.py)."""
    try:
        ids = qwen3_tts_prompt_ids(folder)
        sampling = qwen3_tts_sampling(folder)
    except Qwen3TtsIdsError as e:
        raise ProfileError(str(e)) from None
    if ids.designs_voice:
        voices: tuple[str, ...] = (VOICE_DESIGN_VOICE,)
    elif ids.clones_voice:
        voices = ()
    elif ids.speakers:
        voices = tuple(ids.speakers)
    else:
        raise ProfileError("voices: this Qwen3-TTS folder has no speakers (talker_config.spk_id) and is not a Base "
                           "(voice clone) folder (tts_model_type)")
    return SpeechSpec(voices=voices, default_voice=voices[0] if voices else "", text_template="{text}",
                      prefix_token_ids=(),
                      suffix_token_ids=(), add_bos=False, sample_rate=QWEN3_TTS_SAMPLE_RATE, sampling=sampling,
                      qwen3_tts=ids)


def _csm_codec(folder: Path, section: dict | None, codec_path: str | None, default: Path | None = None) -> dict:
    """A MimiCodecConfig-style codec section (runner/codecs/mimi_stage.py): its path is `default`
    (CSM: the model folder itself, the checkpoint's `codec_model`; Qwen3-TTS: its
    speech_tokenizer/) unless a codec folder is named."""
    section = dict(section or {})
    path = codec_path or section.get("path")
    p = (default or folder) if path is None else Path(path)
    if not p.is_absolute() and (folder / p).exists():
        p = folder / p
    section["path"] = str(p)
    return section


def _codec(folder: Path, section: dict | None, codec_path: str | None) -> dict | None:
    section = dict(section or {})
    path = codec_path or section.get("path")
    if path is None:
        return None
    p = Path(path)
    if not p.is_absolute() and (folder / p).exists():
        p = folder / p
    section["path"] = str(p)
    section.setdefault("audio_token_offset", ORPHEUS_AUDIO_TOKEN_OFFSET)
    section.setdefault("codebook_size", ORPHEUS_CODEBOOK_SIZE)
    section.setdefault("end_token_id", ORPHEUS_END_OF_SPEECH)
    return section
