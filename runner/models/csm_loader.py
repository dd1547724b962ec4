"""Load a transformers `CsmForConditionalGeneration` folder (config.json + safetensors) into
`CsmModel`, in the style of runner/models/loader.py: every tensor is matched to a destination and
shape-checked from the safetensors headers before anything is allocated, the coverage of every
parameter is checked, then tensors are copied in one at a time.

The decoder layers of both transformers go through loader.expected_tensors (the Llama mapping,
q/k/v and gate/up fused); `codec_model.*` (the Mimi codec) is not part of this model and is left
to the codec's loader. With tied codebook embeddings a checkpoint stores the table under either
name (transformers saves the depth decoder's); both fill the one shared parameter.
"""

from __future__ import annotations

from pathlib import Path

import torch

from runner.layers.base import AttentionBackend, OpsBackend
from runner.models.csm import CsmModel
from runner.models.csm_config import CsmModelConfig
from runner.models.frame_model import build_empty_frame_model
from runner.models.loader import (
    _Target,
    fill_planned,
    find_safetensors,
    plan_tensors,
    stack_tensors,
)

_IGNORED_PREFIXES = ("codec_model.",)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "audio_tokens_offsets")
_BACKBONE_AUDIO = "backbone_model.embed_tokens.embed_audio_tokens.weight"
_DEPTH_AUDIO = "depth_decoder.model.embed_tokens.weight"


def expected_csm_tensors(cfg: CsmModelConfig) -> dict[str, _Target]:
    """transformers tensor name -> destination in CsmModel, with its shape. With tied codebook
    embeddings only the depth decoder's name is listed (plan_csm_load accepts either)."""
    k, v, h, hd = cfg.num_codebooks, cfg.codebook_size, cfg.backbone.hidden_size, cfg.depth.hidden_size
    out = {
        "embed_text_tokens.weight": _Target("embed_text_tokens.weight", 0, (cfg.text_vocab_size, h)),
        "lm_head.weight": _Target("lm_head.weight", 0, (v, h)),
        "depth_decoder.model.inputs_embeds_projector.weight":
            _Target("depth.inputs_embeds_projector.weight", 0, (hd, h)),
        "depth_decoder.codebooks_head.weight": _Target("depth.codebooks_head", 0, (k - 1, hd, v)),
    }
    if cfg.tie_codebook_embeddings:  # one parameter (named_parameters lists the first owner)
        out[_DEPTH_AUDIO] = _Target("embed_audio_tokens.weight", 0, (k * v, h))
    else:
        out[_BACKBONE_AUDIO] = _Target("embed_audio_tokens.weight", 0, (k * v, h))
        out[_DEPTH_AUDIO] = _Target("depth.embed_tokens.weight", 0, (k * v, h))
    out.update(stack_tensors(cfg.backbone, "backbone_model.", "backbone."))
    out.update(stack_tensors(cfg.depth, "depth_decoder.model.", "depth."))
    return out


def plan_csm_load(cfg: CsmModelConfig, files: list[Path]) -> dict[str, tuple[Path, _Target, str]]:
    """Match checkpoint tensors to destinations from headers only: expected name -> (file,
    destination, the name it is stored under). LoadError names the tensor and its file on any
    mismatch, and lists what is missing or unexpected."""
    def ignored(name: str) -> bool:
        return name.startswith(_IGNORED_PREFIXES) or name.endswith(_IGNORED_SUFFIXES)

    aliases = {_BACKBONE_AUDIO: _DEPTH_AUDIO} if cfg.tie_codebook_embeddings else None
    return plan_tensors(expected_csm_tensors(cfg), files, ignored, f" {str(cfg.path)!r}", aliases)


@torch.no_grad()
def load_csm(cfg: CsmModelConfig, device: torch.device | str, dtype: torch.dtype,
             attn: AttentionBackend | None = None, ops: OpsBackend | None = None) -> CsmModel:
    """CsmModel for `cfg` on `device` in `dtype`, filled from the safetensors in cfg.path."""
    plan = plan_csm_load(cfg, find_safetensors(cfg.path))
    model = build_empty_frame_model(CsmModel, cfg, device, dtype, attn, ops)
    fill_planned(model, plan)
    return model
