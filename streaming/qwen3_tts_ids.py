"""The ids of a Qwen3-TTS folder's config.json (docs/qwen3_tts.md §1) that both processes need,
read with json alone: the front end lays prompts out with them (streaming/qwen3_tts_profile.py)
and the engine's Qwen3TtsConfig (runner/models/qwen3_tts_config.py) embeds and stops with them.
Why here and torch-free: streaming/ is imported by clients and the front end, which must not
import the runner (torch); the runner may import streaming.

Layout: `talker_config` holds the codec ids, speakers and languages and `code_predictor_config`;
the prompt's text ids (tts_pad/bos/eos, im_start/end) are top-level fields.
"""

from __future__ import annotations

from dataclasses import dataclass


class Qwen3TtsIdsError(ValueError):
    """config.json lacks an id or holds a bad one; the message names the field."""


@dataclass(frozen=True)
class Qwen3TtsCodecIds:
    """The talker's codec-table ids with a meaning of their own (all >= codebook_size)."""

    pad: int
    bos: int
    eos: int  # code 0 == eos ends the audio
    think: int
    nothink: int
    think_bos: int
    think_eos: int


@dataclass(frozen=True)
class Qwen3TtsIds:
    model_type: str  # tts_model_type: "base" | "custom_voice" | "voice_design"
    model_size: str  # tts_model_size ("0b6", "1b7"; "" when absent)
    num_code_groups: int  # K: codes per frame
    codec_vocab_size: int  # the talker's codec table and code-0 head: codes 0..V-1 + special ids
    codebook_size: int  # V: codes per group
    codec: Qwen3TtsCodecIds
    tts_pad_id: int  # text ids of the prompt's text part
    tts_bos_id: int
    tts_eos_id: int
    im_start_id: int
    im_end_id: int
    speakers: dict[str, int]  # spk_id: name -> codec id (CustomVoice)
    speaker_dialects: dict[str, str | None]  # spk_is_dialect: name -> dialect language, None if not one
    languages: dict[str, int]  # codec_language_id: name -> codec id

    @staticmethod
    def from_dict(raw: dict) -> Qwen3TtsIds:
        talker = section(raw, "talker_config")
        pred = section(talker, "code_predictor_config", "talker_config.")
        k = int(need(talker, "num_code_groups", "talker_config."))
        if int(pred.get("num_code_groups", k)) != k:
            raise Qwen3TtsIdsError(f"model config: talker_config.code_predictor_config.num_code_groups "
                                   f"{pred['num_code_groups']} != talker_config.num_code_groups {k}")
        if k < 2:
            raise Qwen3TtsIdsError(f"model config: talker_config.num_code_groups {k} must be at least 2")
        v0 = int(need(talker, "vocab_size", "talker_config."))
        v = int(need(pred, "vocab_size", "talker_config.code_predictor_config."))
        if v0 < v:
            raise Qwen3TtsIdsError(f"model config: talker_config.vocab_size {v0} < code_predictor_config.vocab_size "
                                   f"{v}: the talker's codec table embeds every code of group 0")

        def codec_id(key: str) -> int:
            value = int(need(talker, key, "talker_config."))
            if not v <= value < v0:  # a special id must not be a code, and must be in the table
                raise Qwen3TtsIdsError(f"model config: talker_config.{key} {value} is not in [{v}, {v0})")
            return value

        languages = _id_map(talker, "codec_language_id", v, v0)
        dialects: dict[str, str | None] = {}
        for name, dialect in (talker.get("spk_is_dialect") or {}).items():
            if dialect is not False and dialect not in languages:
                raise Qwen3TtsIdsError(f"model config: talker_config.spk_is_dialect[{name!r}] {dialect!r} "
                                       f"is not in codec_language_id")
            dialects[name] = None if dialect is False else dialect
        return Qwen3TtsIds(
            model_type=str(raw.get("tts_model_type", "")),
            model_size=str(raw.get("tts_model_size", "")),
            num_code_groups=k,
            codec_vocab_size=v0,
            codebook_size=v,
            codec=Qwen3TtsCodecIds(pad=codec_id("codec_pad_id"), bos=codec_id("codec_bos_id"),
                                   eos=codec_id("codec_eos_token_id"), think=codec_id("codec_think_id"),
                                   nothink=codec_id("codec_nothink_id"), think_bos=codec_id("codec_think_bos_id"),
                                   think_eos=codec_id("codec_think_eos_id")),
            # qwen-tts's defaults (C:474) where a field is absent
            tts_pad_id=int(raw.get("tts_pad_token_id", 151671)),
            tts_bos_id=int(raw.get("tts_bos_token_id", 151672)),
            tts_eos_id=int(raw.get("tts_eos_token_id", 151673)),
            im_start_id=int(raw.get("im_start_token_id", 151644)),
            im_end_id=int(raw.get("im_end_token_id", 151645)),
            speakers=_id_map(talker, "spk_id", v, v0),
            speaker_dialects=dialects,
            languages=languages,
        )


def section(raw: dict, key: str, field: str = "") -> dict:
    value = raw.get(key)
    if not isinstance(value, dict):
        raise Qwen3TtsIdsError(f"model config: missing field '{field}{key}'")
    return value


def need(raw: dict, key: str, field: str):
    if key not in raw:
        raise Qwen3TtsIdsError(f"model config: missing field '{field}{key}'")
    return raw[key]


def _id_map(talker: dict, key: str, lo: int, hi: int) -> dict[str, int]:
    """A {name: codec id} field of talker_config, each id a special id of the codec table."""
    out = {}
    for name, value in (talker.get(key) or {}).items():
        if not isinstance(value, int) or not lo <= value < hi:
            raise Qwen3TtsIdsError(f"model config: talker_config.{key}[{name!r}] {value!r} is not an id in [{lo}, {hi})")
        out[name] = value
    return out
