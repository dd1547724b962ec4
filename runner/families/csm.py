"""Sesame CSM: a multi-codebook talker. Each step yields a frame of K codes per row (the
backbone predicts codebook 0, the depth decoder the other K - 1 in the same step), the frame's
summed codebook embeddings feed the next step, and Mimi turns frames into 24 kHz PCM.

What the engine asks of the family:
- the model: runner/models/csm.py from a transformers `CsmForConditionalGeneration` folder;
- frames: `codes_per_frame` = K, so the engine runs runner/engine/frame_runner.py;
- the end: a frame whose codebooks 0..K-2 all equal the end-of-stream code (transformers'
  generate rule). The runner reports that frame's position as `audio_eos_token_id`, the
  model's end id (runner/config.py's CSM view), so the scheduler's stop rule is unchanged;
- prompts: text ids with `audio_token_id` at positions of a reference clip's frames and
  `audio_eos_token_id` after them (transformers' chat template); `prompt_frames` gives the
  clip's codes, one row per `audio_token_id`;
- the codec: the folder's own `codec_model` (a MimiModel), or a Mimi folder named by
  `codec.path`.
"""

from __future__ import annotations

import numpy as np
import torch

from runner.codecs.mimi_loader import load_csm_codec
from runner.codecs.mimi_stage import MimiCodecConfig, MimiCodecStage
from runner.config import EngineConfig
from runner.families.base import (CodecStageLike, EncodedReference, FrameLayout, LogitsConstraint, ModelFamily,
                                  fill_random_)
from runner.layers.base import AttentionBackend, OpsBackend
from runner.models.csm import CsmModel
from runner.models.csm_config import CsmModelConfig
from runner.models.csm_loader import load_csm
from runner.models.frame_model import build_empty_frame_model
from streaming.profile import ModelProfile
from streaming.sampling_params import InvalidRequest


class CsmFamily(ModelFamily):
    name = "csm"

    def __init__(self, profile: ModelProfile, model_path: str = ""):
        super().__init__(profile, model_path)
        self.config = CsmModelConfig.from_pretrained(model_path)
        self.codes_per_frame = self.config.num_codebooks
        self.codec_config = MimiCodecConfig(**profile.codec) if profile.codec is not None else None

    def load_model(self, cfg: EngineConfig, attn: AttentionBackend, ops: OpsBackend,
                   random_weights: bool = False) -> CsmModel:
        r = cfg.runner
        if random_weights:
            return fill_random_(build_empty_frame_model(CsmModel, self.config, r.torch_device, r.torch_dtype, attn, ops), r.torch_device)
        return load_csm(self.config, r.torch_device, r.torch_dtype, attn, ops)

    def build_codec(self, device: torch.device, dtype: torch.dtype, tuning: str = "auto") -> CodecStageLike | None:
        c = self.codec_config
        if c is None:
            return None
        stage = MimiCodecStage(c, device, dtype, tuning, model=load_csm_codec(c.path, device, dtype))
        if stage.num_codebooks != self.config.num_codebooks:
            raise ValueError(f"codec: Mimi decodes {stage.num_codebooks} codebooks, the model emits "
                             f"{self.config.num_codebooks} (codec.num_codebooks)")
        return stage

    def code_limit(self, codec: CodecStageLike | None) -> int | None:
        if codec is None:
            return None
        assert isinstance(codec, MimiCodecStage)
        return codec.codebook_size if codec.codebook_size < self.config.codebook_size else None

    def encode_reference(self, codec: CodecStageLike, pcm: np.ndarray) -> EncodedReference:
        assert isinstance(codec, MimiCodecStage)
        return EncodedReference(codec.encode(pcm))

    def frame_layout(self) -> FrameLayout:
        c = self.config
        return FrameLayout(num_codebooks=c.num_codebooks, codebook_size=c.codebook_size,
                           frame_id=c.audio_token_id, end_id=c.audio_eos_token_id)

    def logits_constraint(self, backend: str) -> LogitsConstraint | None:
        return None  # every codebook's logits are its codes: nothing to mask

    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.config.audio_eos_token_id,)

    def warm_up_args(self, prompt_token_ids: list[int]) -> dict:
        """Codes (all 0) for the audio positions a start-up prompt's ids happen to hold (a small
        text vocabulary has the audio token among them)."""
        n_audio = prompt_token_ids.count(self.config.audio_token_id)
        return {"prompt_frames": np.zeros((n_audio, self.config.num_codebooks), np.int64)} if n_audio else {}

    def prompt_frames(self, prompt_token_ids: list[int], frames: np.ndarray | None) -> np.ndarray:
        c, k = self.config, self.config.num_codebooks
        ids = np.asarray(prompt_token_ids, dtype=np.int64)
        is_audio = ids == c.audio_token_id
        n_audio = int(is_audio.sum())
        got = 0 if frames is None else len(frames)
        if got != n_audio:
            raise InvalidRequest("prompt_frames", f"{got} frame(s) for {n_audio} audio position(s) "
                                 f"(token {c.audio_token_id}) in the prompt")
        rows = np.zeros((len(ids), k), dtype=np.int64)
        if n_audio:
            frames = np.asarray(frames)
            if frames.ndim != 2 or frames.shape[1] != k or frames.dtype.kind not in "iu":
                raise InvalidRequest("prompt_frames", f"must be integer codes of shape [n, {k}], got "
                                     f"{frames.dtype} {list(frames.shape)}")
            if frames.min() < 0 or frames.max() >= c.codebook_size:
                raise InvalidRequest("prompt_frames", f"codes must lie in [0, {c.codebook_size})")
            rows[is_audio] = frames
        rows[ids == c.audio_eos_token_id] = c.codebook_eos_id
        return rows
