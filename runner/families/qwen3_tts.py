"""Qwen3-TTS (12 Hz): a multi-codebook talker (docs/qwen3_tts.md). Each step yields a frame of K
codes per row (the talker predicts code 0, the code predictor groups 1..K-1 in the same step);
a generated position's input is its frame's summed codec embeddings plus a text id (the
request's trailing text, then tts_pad), and the 12 Hz codec turns frames into 24 kHz PCM.

What the engine asks of the family:
- the model: runner/models/qwen3_tts.py from a qwen-tts `Qwen3TTSForConditionalGeneration`
  folder; the engine's view of it is the talker (Qwen3TtsConfig.engine_view);
- rows (FrameLayout): a position's K codes (-1: a table the position does not read), then its
  text id. Prompts come as text ids (`prompt_token_ids`, one per position: every position of
  the reference's prompts has a text part) and their codec part (`prompt_frames` [P, K], all
  -1 on text-only positions); generated frames take their text id from `step_text_ids`;
- ids: a generated frame is reported as tts_pad, the frame that ends the audio as tts_eos (the
  view's end id, so the scheduler's stop rule is unchanged);
- code 0 (M:2044-2066): drawn from the codes and eos only, eos not before frame
  MIN_NEW_TOKENS; groups 1..K-1 drawn with the folder's subtalker_* parameters
  (generation_config.json, else qwen-tts's defaults) unless the request gives its own;
- code 0's repetition penalty (the reference's `repetition_penalty`, qwen-tts's default 1.05
  is the request's to give): over the code-0 ids the request generated, never its prompt's
  (generate() gets inputs_embeds: its input_ids start empty); groups take none;
- the end: code 0 == codec eos (Qwen3TtsModel.frame_is_eos); that frame is not audio;
- the codec: the folder's speech_tokenizer/ (or `codec.path`) as Qwen12HzCodecStage.

- voice clone (Base folders): a reference clip is encoded once (encode_reference: its 12 Hz
  codes and its x-vector, runner/models/qwen3_tts_speaker.py); a prompt adds the x-vector over
  its speaker position (prompt_vectors) and, in ICL mode, carries the clip's frames as rows
  whose K codes are all given; those frames prime the request's codec stream (codec_prefix),
  so its audio is the reference's decode of clip + generated frames with the clip cut off.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from runner.codecs.mimi_stage import MimiCodecConfig
from runner.codecs.qwen12hz_stage import Qwen12HzCodecStage
from runner.config import EngineConfig
from runner.families.base import (
    CodecStageLike,
    Code0Rule,
    EncodedReference,
    FrameLayout,
    LogitsConstraint,
    ModelFamily,
    PromptVectors,
    StepText,
    fill_random_,
)
from runner.layers.base import AttentionBackend, OpsBackend
from runner.models.frame_model import build_empty_frame_model
from runner.models.qwen3_tts import NO_CODE, Qwen3TtsModel
from runner.models.qwen3_tts_config import Qwen3TtsConfig
from runner.models.qwen3_tts_loader import load_qwen3_tts
from runner.models.qwen3_tts_speaker import SpeakerEncoder, load_speaker_encoder
from streaming import ipc
from streaming.profile import ModelProfile
from streaming.sampling_params import InvalidRequest, SamplingParams

# qwen-tts's generate (W:319-330): eos may end the audio from the third frame on
MIN_NEW_TOKENS = 2
# the subtalker's sampling where the folder has no generation_config.json (W:319-330)
SUBTALKER_DEFAULTS = {"subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
                      "subtalker_temperature": 0.9}


def subtalker_sampling(model_path: str | Path) -> SamplingParams:
    """Groups 1..K-1's parameters: the folder's generation_config.json subtalker_* over
    qwen-tts's defaults (do_sample false: greedy)."""
    raw = dict(SUBTALKER_DEFAULTS)
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        raw.update({k: v for k, v in json.loads(gen.read_text()).items() if k in SUBTALKER_DEFAULTS})
    temperature = float(raw["subtalker_temperature"]) if raw["subtalker_dosample"] else 0.0
    return SamplingParams(temperature=temperature, top_k=int(raw["subtalker_top_k"]),
                          top_p=float(raw["subtalker_top_p"]))


class Qwen3TtsFamily(ModelFamily):
    name = "qwen3_tts"

    def __init__(self, profile: ModelProfile, model_path: str = ""):
        super().__init__(profile, model_path)
        self.config = Qwen3TtsConfig.from_pretrained(model_path)
        self.codes_per_frame = self.config.num_code_groups
        self.group_sampling = subtalker_sampling(model_path)
        self.group_sampling.validate(self.config.codebook_size, self.codes_per_frame)
        self.codec_config = MimiCodecConfig(**profile.codec) if profile.codec is not None else None
        self._speaker_encoder: SpeakerEncoder | None = None  # Base: loaded at the first upload

    def load_model(self, cfg: EngineConfig, attn: AttentionBackend, ops: OpsBackend,
                   random_weights: bool = False) -> Qwen3TtsModel:
        r = cfg.runner
        if random_weights:
            return fill_random_(build_empty_frame_model(Qwen3TtsModel, self.config, r.torch_device, r.torch_dtype, attn, ops), r.torch_device)
        return load_qwen3_tts(self.config, r.torch_device, r.torch_dtype, attn, ops)

    def frame_layout(self) -> FrameLayout:
        c = self.config
        # the reference suppresses ids [vocab - 1024, vocab) but eos: the specials, past the codes
        code0 = Code0Rule(vocab=c.codec_vocab_size, num_codes=c.codebook_size, eos=c.codec.eos,
                          min_frames=MIN_NEW_TOKENS, repetition_penalty=True)
        return FrameLayout(num_codebooks=c.num_code_groups, codebook_size=c.codebook_size, frame_id=c.tts_pad_id,
                           end_id=c.tts_eos_id, text_column=True, code0=code0, group_sampling=self.group_sampling)

    def build_codec(self, device: torch.device, dtype: torch.dtype, tuning: str = "auto") -> CodecStageLike | None:
        c = self.codec_config
        if c is None:
            return None
        stage = Qwen12HzCodecStage(c, device, dtype, tuning)
        if (stage.num_codebooks, stage.codebook_size) != (self.codes_per_frame, self.config.codebook_size):
            raise ValueError(f"codec: the 12 Hz codec decodes frames of {stage.num_codebooks} codes of "
                             f"{stage.codebook_size}, the model emits {self.codes_per_frame} of {self.config.codebook_size}")
        return stage

    def logits_constraint(self, backend: str) -> LogitsConstraint | None:
        return None  # code 0's window is the frame runner's (FrameLayout.code0)

    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.config.tts_eos_id,)

    def check_group_sampling(self, params: SamplingParams | None) -> SamplingParams | None:
        """The groups' parameters judged on a group's vocabulary, errors named as the request's
        `group_sampling.*` fields (not `sampling.*`)."""
        if params is not None:
            try:
                params.validate(self.config.codebook_size, self.codes_per_frame)
            except InvalidRequest as e:
                field = "group_sampling" + e.field.removeprefix("sampling")
                raise InvalidRequest(field, str(e).removeprefix(f"{e.field}: ")) from None
        return params

    def step_text(self, step_text_ids: list[int] | None, open: bool = False) -> StepText:
        """The trailing text (streaming text mode), one id a generated frame, then tts_pad;
        None or [] for the non-streaming mode (every frame gets tts_pad). open: the text is
        still arriving (Engine.append_text adds the rest, its last piece ending in tts_eos)."""
        ids = list(step_text_ids or ())
        v = self.config.text_vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or not 0 <= t < v:
                raise InvalidRequest("step_text_ids", f"id {t!r} at index {i} is outside the text vocabulary [0, {v})")
        return StepText(ids, self.config.tts_pad_id, closed=not open)

    def prompt_frames(self, prompt_token_ids: list[int], frames: np.ndarray | None) -> np.ndarray:
        """Rows [P, K + 1]: the codec part of every prompt position (`frames` [P, K]: code 0
        any id of the talker's codec table (codes, pad, bos, speakers, languages, think tags),
        groups codes of their codebook, NO_CODE (-1) where the position reads no table), then
        its text id (the prompt's id)."""
        c, k, p = self.config, self.codes_per_frame, len(prompt_token_ids)
        if frames is None:
            raise InvalidRequest("prompt_frames", f"the {self.name} family needs the codec part of every "
                                 f"prompt position ([{p}, {k}], -1 where none)")
        frames = np.asarray(frames)
        if frames.ndim != 2 or frames.shape != (p, k) or frames.dtype.kind not in "iu":
            raise InvalidRequest("prompt_frames", f"must be integer codes of shape [{p}, {k}] (one row a prompt "
                                 f"position), got {frames.dtype} {list(frames.shape)}")
        for col, hi in ((0, c.codec_vocab_size), (slice(1, None), c.codebook_size)):
            part = frames[:, col]
            if part.size and (part.min() < NO_CODE or part.max() >= hi):
                which = "code 0" if col == 0 else "groups 1.."
                raise InvalidRequest("prompt_frames", f"{which} must lie in [{NO_CODE}, {hi}) ({NO_CODE}: none)")
        groups = frames[:, 1:]
        full = (groups >= 0).all(axis=1)
        if ((groups >= 0).any(axis=1) & ~full).any() or (frames[full, 0] >= c.codebook_size).any() \
                or (frames[full, 0] < 0).any():
            raise InvalidRequest("prompt_frames", f"a position with group codes is a reference frame: all {k} of its "
                                 f"codes must be codes (code 0 in [0, {c.codebook_size}))")
        return np.concatenate([frames.astype(np.int64), np.asarray(prompt_token_ids, dtype=np.int64)[:, None]], axis=1)

    def warm_up_args(self, prompt_token_ids: list[int]) -> dict:
        """Text-only positions (no codec part) and a trailing text: the streaming layout's path."""
        return {"prompt_frames": np.full((len(prompt_token_ids), self.codes_per_frame), NO_CODE, dtype=np.int64),
                "step_text_ids": list(prompt_token_ids[:8])}

    def codec_prefix(self, rows: np.ndarray | None) -> np.ndarray | None:
        """A voice-clone prompt's reference frames (rows whose K codes are all given, W:612-629:
        the reference decodes ref_code + the generated codes and cuts the reference's share)."""
        k = self.codes_per_frame
        full = (rows[:, :k] >= 0).all(axis=1)
        return rows[full, :k] if full.any() else None

    def prompt_vectors(self, prompt_len: int, vectors: list[ipc.PromptVector] | None) -> PromptVectors | None:
        """A voice's x-vector over its speaker position (M:2101-2110, 2168-2175): positions
        distinct and inside the prompt, each the talker's hidden size of float32s."""
        if not vectors:
            return None
        h = self.config.talker.hidden_size
        positions = [v.position for v in vectors]
        for v in vectors:
            if not 0 <= v.position < prompt_len:
                raise InvalidRequest("prompt_vectors", f"position {v.position} is outside the prompt [0, {prompt_len})")
            if len(v.values) != 4 * h:
                raise InvalidRequest("prompt_vectors", f"position {v.position}: {len(v.values)} bytes, expected {h} "
                                     f"float32 ({4 * h} bytes)")
        if len(set(positions)) != len(positions):
            raise InvalidRequest("prompt_vectors", "positions must be distinct")
        values = np.stack([np.frombuffer(v.values, dtype="<f4") for v in vectors])
        if not np.isfinite(values).all():
            raise InvalidRequest("prompt_vectors", "values must be finite")
        return PromptVectors.of(positions, values)

    def encode_reference(self, codec: CodecStageLike, pcm: np.ndarray) -> EncodedReference:
        """A Base folder's reference clip: its 12 Hz codes and its x-vector (the speaker encoder
        of the folder, loaded at the first upload on the codec's device, in float32)."""
        if self.config.model_type != "base":
            raise InvalidRequest("audio", f"a Qwen3-TTS {self.config.model_type} folder takes no reference audio (its "
                                 "voices are built in; voice cloning needs a Base folder)")
        assert isinstance(codec, Qwen12HzCodecStage)
        if self._speaker_encoder is None:
            raw = json.loads((Path(self.model_path) / "config.json").read_text())
            self._speaker_encoder = load_speaker_encoder(self.model_path, raw, codec.decoder.device)
        try:
            xvector = self._speaker_encoder.embed(pcm)
        except ValueError as e:
            raise InvalidRequest("audio", str(e).removeprefix("audio: ")) from None
        return EncodedReference(codec.encode(pcm), xvector)
