"""A Qwen3-TTS folder's speech profile (docs/qwen3_tts.md §1, Stage 4): the voices are the
talker's `spk_id` speakers (CustomVoice), the ids of the prompt layout come from config.json
and the code-0 sampling defaults from generation_config.json. Read once by
streaming/profile.py; the prompt itself is built per request by server/tts/qwen3_tts_prompt.py
from the `Qwen3TtsPromptIds` this module fills."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from streaming.qwen3_tts_ids import Qwen3TtsIds, Qwen3TtsIdsError
from streaming.sampling_params import SamplingParams

QWEN3_TTS_SAMPLE_RATE = 24000  # the 12 Hz codec's output rate
# qwen-tts's generate defaults (W:319-330) where generation_config.json lacks a key
CODE0_DEFAULTS = {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05}
# Frames a request may generate by default: 90 s at 12.5 frames a second (as CSM's profile).
QWEN3_TTS_MAX_FRAMES = 1125
SIZE_WITHOUT_INSTRUCT = "0b6"  # config.json tts_model_size of the 0.6B folders
VOICE_DESIGN_TYPE = "voice_design"  # config.json tts_model_type
BASE_TYPE = "base"  # config.json tts_model_type of the voice-clone folders
VOICE_DESIGN_VOICE = "design"  # a VoiceDesign folder's one voice name: the instructions describe it


class Qwen3TtsPromptIds(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ids the front end lays a Qwen3-TTS prompt out with (M:2022-2234): text ids of the
    text part, talker codec-table ids of the codec part, the speakers and languages."""

    num_code_groups: int  # K: a prompt row's codec part is K codes (-1 where absent)
    tts_pad: int
    tts_bos: int
    tts_eos: int
    codec_pad: int
    codec_bos: int
    think: int
    nothink: int
    think_bos: int
    think_eos: int
    speakers: dict[str, int]  # spk_id: name -> codec id
    speaker_dialects: dict[str, str]  # the speakers that are a dialect: name -> language name
    languages: dict[str, int]  # codec_language_id: name -> codec id ("auto" is not one: no id)
    # the wrapper's default for CustomVoice/VoiceDesign (W:642, W:738): every text id in the
    # prompt, no trailing text
    non_streaming: bool = True
    # whether an instruct turn reaches the prompt: the wrapper drops it for the 0.6B folders
    # (W:799, tts_model_size "0b6"); this server refuses it there instead
    takes_instruct: bool = True
    # VoiceDesign (tts_model_type "voice_design"): no speaker row; the voice is described by
    # the request's instructions, and the profile's one voice is VOICE_DESIGN_VOICE
    designs_voice: bool = False
    # Base (tts_model_type "base"): no built-in voices; a voice is an uploaded clip, its
    # x-vector over the speaker position and, with a transcript, its frames in the prompt (ICL)
    clones_voice: bool = False


def qwen3_tts_prompt_ids(folder: str | Path) -> Qwen3TtsPromptIds:
    """The prompt ids of the folder's config.json; Qwen3TtsIdsError naming the field."""
    cfg_file = Path(folder) / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Qwen3TtsIdsError(f"{cfg_file}: not a readable JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise Qwen3TtsIdsError(f"{cfg_file}: not a JSON object")
    c = Qwen3TtsIds.from_dict(raw)
    base = c.model_type == BASE_TYPE
    return Qwen3TtsPromptIds(
        num_code_groups=c.num_code_groups, tts_pad=c.tts_pad_id, tts_bos=c.tts_bos_id, tts_eos=c.tts_eos_id,
        codec_pad=c.codec.pad, codec_bos=c.codec.bos, think=c.codec.think, nothink=c.codec.nothink,
        think_bos=c.codec.think_bos, think_eos=c.codec.think_eos, speakers=dict(c.speakers),
        speaker_dialects={k: v for k, v in c.speaker_dialects.items() if v is not None},
        languages=dict(c.languages),
        # the wrapper's generate_voice_clone passes no instruct and defaults to streaming text (W:478)
        takes_instruct=c.model_size != SIZE_WITHOUT_INSTRUCT and not base, non_streaming=not base,
        designs_voice=c.model_type == VOICE_DESIGN_TYPE, clones_voice=base)


def qwen3_tts_sampling(folder: str | Path) -> SamplingParams:
    """Code 0's defaults: generation_config.json's do_sample/top_k/top_p/temperature and
    repetition_penalty (over code 0's generated ids: the engine's Code0Rule) over qwen-tts's
    (do_sample false: greedy)."""
    raw = dict(CODE0_DEFAULTS)
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():
        try:
            got = json.loads(gen.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise Qwen3TtsIdsError(f"{gen}: not JSON ({e})") from None
        raw.update({k: v for k, v in got.items() if k in CODE0_DEFAULTS})
    temperature = float(raw["temperature"]) if raw["do_sample"] else 0.0
    return SamplingParams(temperature=temperature, top_k=int(raw["top_k"]), top_p=float(raw["top_p"]),
                          repetition_penalty=float(raw["repetition_penalty"]), max_tokens=QWEN3_TTS_MAX_FRAMES)
