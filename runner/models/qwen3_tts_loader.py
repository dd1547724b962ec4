"""Load a qwen-tts `Qwen3TTSForConditionalGeneration` folder (config.json + safetensors) into
`Qwen3TtsModel`, in csm_loader's style: every tensor is matched to a destination and
shape-checked from the safetensors headers before anything is allocated, the coverage of every
parameter is checked, then tensors are copied in one at a time.

Both decoders' layers go through loader.expected_tensors (the Llama/Qwen3 mapping, q/k/v and
gate/up fused, q/k norms). The talker's codec table and the code predictor's K - 1 group tables
fill row ranges of the one concatenated `codec_embedding` (at cfg.table_offsets), the K - 1
group heads row ranges of `predictor.lm_head`. `speaker_encoder.*` (Base's x-vector encoder)
is not part of this model and is left to its own loader; the codec is a folder of its own
(speech_tokenizer/).
"""

from __future__ import annotations

from pathlib import Path

import torch

from runner.layers.base import AttentionBackend, OpsBackend
from runner.models.frame_model import build_empty_frame_model
from runner.models.loader import (
    _Target,
    fill_planned,
    find_safetensors,
    plan_tensors,
    stack_tensors,
)
from runner.models.qwen3_tts import Qwen3TtsModel
from runner.models.qwen3_tts_config import Qwen3TtsConfig

_IGNORED_PREFIXES = ("speaker_encoder.",)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_qwen3_tts_tensors(cfg: Qwen3TtsConfig) -> dict[str, _Target]:
    """qwen-tts tensor name -> destination in Qwen3TtsModel, with its shape."""
    k, v, v0 = cfg.num_code_groups, cfg.codebook_size, cfg.codec_vocab_size
    h, hp, th = cfg.talker.hidden_size, cfg.predictor.hidden_size, cfg.text_hidden_size
    out = {
        "talker.model.text_embedding.weight": _Target("text_embedding.weight", 0, (cfg.text_vocab_size, th)),
        "talker.text_projection.linear_fc1.weight": _Target("text_projection.linear_fc1.weight", 0, (th, th)),
        "talker.text_projection.linear_fc1.bias": _Target("text_projection.linear_fc1.bias", 0, (th,)),
        "talker.text_projection.linear_fc2.weight": _Target("text_projection.linear_fc2.weight", 0, (h, th)),
        "talker.text_projection.linear_fc2.bias": _Target("text_projection.linear_fc2.bias", 0, (h,)),
        "talker.model.codec_embedding.weight": _Target("codec_embedding.weight", 0, (v0, h)),
        "talker.codec_head.weight": _Target("codec_head.weight", 0, (v0, h)),
    }
    offsets = cfg.table_offsets
    for g in range(1, k):
        out[f"talker.code_predictor.model.codec_embedding.{g - 1}.weight"] = \
            _Target("codec_embedding.weight", offsets[g], (v, h))
        out[f"talker.code_predictor.lm_head.{g - 1}.weight"] = _Target("predictor.lm_head", (g - 1) * v, (v, hp))
    if cfg.predictor_projects:
        out["talker.code_predictor.small_to_mtp_projection.weight"] = \
            _Target("predictor.inputs_embeds_projector.weight", 0, (hp, h))
        out["talker.code_predictor.small_to_mtp_projection.bias"] = \
            _Target("predictor.inputs_embeds_projector.bias", 0, (hp,))
    out.update(stack_tensors(cfg.talker, "talker.model.", "backbone."))
    out.update(stack_tensors(cfg.predictor, "talker.code_predictor.model.", "predictor."))
    return out


def plan_qwen3_tts_load(cfg: Qwen3TtsConfig, files: list[Path]) -> dict[str, tuple[Path, _Target, str]]:
    """Match checkpoint tensors to destinations from headers only: name -> (file, destination,
    stored name). LoadError names the tensor and its file on any mismatch, and lists what is
    missing or unexpected."""
    def ignored(name: str) -> bool:
        return name.startswith(_IGNORED_PREFIXES) or name.endswith(_IGNORED_SUFFIXES)

    return plan_tensors(expected_qwen3_tts_tensors(cfg), files, ignored, f" {str(cfg.path)!r}")


@torch.no_grad()
def load_qwen3_tts(cfg: Qwen3TtsConfig, device: torch.device | str, dtype: torch.dtype,
                   attn: AttentionBackend | None = None, ops: OpsBackend | None = None) -> Qwen3TtsModel:
    """Qwen3TtsModel for `cfg` on `device` in `dtype`, filled from the safetensors in cfg.path."""
    plan = plan_qwen3_tts_load(cfg, find_safetensors(cfg.path))
    model = build_empty_frame_model(Qwen3TtsModel, cfg, device, dtype, attn, ops)
    fill_planned(model, plan)
    return model
