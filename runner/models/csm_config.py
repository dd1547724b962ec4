"""Sesame CSM's architecture, read from the config.json of a transformers
`CsmForConditionalGeneration` folder.

CSM is two Llama decoders: the backbone (one step per audio frame, predicts codebook 0) and the
depth decoder (K - 1 sub-steps per frame, predicts codebooks 1..K-1). Each is described by a
plain `ModelConfig`, parsed by the same code as a Llama checkpoint (ModelConfig.from_dict), so
the decoder layers of runner/models/llama.py build them unchanged. The CSM-specific fields (the
codebook layout and the special ids of the prompt) are kept beside them.

transformers' defaults (configuration_csm.py) apply where the file leaves a field out: RoPE
theta 500000, 32 codebooks of 2051, codebook 0 = end of stream, 2050 = padding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runner.config import CSM_ROPE_THETA, ConfigError, ModelConfig

CSM_ARCHITECTURE = "CsmForConditionalGeneration"


@dataclass(frozen=True)
class CsmModelConfig:
    path: str
    backbone: ModelConfig  # vocab_size = codebook_size (the codebook-0 head's width)
    depth: ModelConfig  # the depth decoder's own transformer (hidden, layers, heads, RoPE)
    num_codebooks: int  # K: codes per frame
    codebook_size: int  # V: ids per codebook (padding and special ids included)
    text_vocab_size: int
    backbone_hidden_size: int  # the depth decoder's input width (its embeddings are this wide)
    tie_codebook_embeddings: bool  # backbone's audio embedding is the depth decoder's embedding
    codebook_eos_id: int  # a frame whose codebooks 0..K-2 all equal this ends the audio
    codebook_pad_id: int
    audio_token_id: int  # prompt position holding one audio frame
    audio_eos_token_id: int  # prompt position holding the all-`codebook_eos_id` frame
    bos_token_id: int | None

    @staticmethod
    def from_pretrained(path: str | Path) -> CsmModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"model: no config.json in {str(path)!r}")
        return CsmModelConfig.from_dict(json.loads(cfg_file.read_text()), str(path))

    @staticmethod
    def from_dict(raw: dict, path: str = "") -> CsmModelConfig:
        archs = raw.get("architectures") or []
        if CSM_ARCHITECTURE not in archs:
            raise ConfigError(f"model.architectures: {archs!r} does not name {CSM_ARCHITECTURE}")
        depth_raw = raw.get("depth_decoder_config")
        if not isinstance(depth_raw, dict):
            raise ConfigError("model config: missing field 'depth_decoder_config'")
        k = int(raw.get("num_codebooks", 32))
        v = int(raw.get("vocab_size", 2051))
        if int(depth_raw.get("num_codebooks", k)) != k:
            raise ConfigError(f"model config: depth_decoder_config.num_codebooks {depth_raw['num_codebooks']} != num_codebooks {k}")
        if int(depth_raw.get("vocab_size", v)) != v:
            raise ConfigError(f"model config: depth_decoder_config.vocab_size {depth_raw['vocab_size']} != vocab_size {v}")
        if k < 2:
            raise ConfigError(f"model config: num_codebooks {k} must be at least 2")
        backbone = _decoder_config(raw, "", path, vocab_size=v)
        depth = _decoder_config(depth_raw, "depth_decoder_config.", path, vocab_size=v)
        backbone_hidden = int(depth_raw.get("backbone_hidden_size", backbone.hidden_size))
        if backbone_hidden != backbone.hidden_size:
            raise ConfigError(f"model config: depth_decoder_config.backbone_hidden_size {backbone_hidden} != "
                              f"hidden_size {backbone.hidden_size}")
        if depth.max_position_embeddings < k:
            raise ConfigError(f"model config: depth_decoder_config.max_position_embeddings "
                              f"{depth.max_position_embeddings} < num_codebooks {k}")
        eos = raw.get("codebook_eos_token_id", 0)
        if isinstance(eos, list):  # transformers' stop rule compares every codebook with one id
            if len(set(eos)) != 1:
                raise ConfigError(f"model config: codebook_eos_token_id {eos!r}: one id for every codebook is supported")
            eos = eos[0]
        return CsmModelConfig(
            path=path,
            backbone=backbone,
            depth=depth,
            num_codebooks=k,
            codebook_size=v,
            text_vocab_size=int(raw.get("text_vocab_size", 128256)),
            backbone_hidden_size=backbone_hidden,
            tie_codebook_embeddings=bool(raw.get("tie_codebooks_embeddings", True)),
            codebook_eos_id=int(eos),
            codebook_pad_id=int(raw.get("codebook_pad_token_id", 2050)),
            audio_token_id=int(raw.get("audio_token_id", 128002)),
            audio_eos_token_id=int(raw.get("audio_eos_token_id", 128003)),
            bos_token_id=raw.get("bos_token_id"),
        )


def _decoder_config(raw: dict, field: str, path: str, vocab_size: int) -> ModelConfig:
    """A Llama ModelConfig of one of CSM's two decoders; `field` prefixes error messages."""
    for key, ok in (("hidden_act", "silu"), ("mlp_bias", False)):
        if raw.get(key, ok) != ok:
            raise ConfigError(f"model config: {field}{key} {raw[key]!r} is not supported ({ok!r} only)")
    plain = {k: val for k, val in raw.items() if k not in ("depth_decoder_config", "codec_config")}
    if not plain.get("rope_parameters") and "rope_theta" not in plain and not plain.get("rope_scaling"):
        plain["rope_parameters"] = {"rope_type": "default", "rope_theta": CSM_ROPE_THETA}
    elif isinstance(plain.get("rope_parameters"), dict) and "rope_theta" not in plain["rope_parameters"]:
        plain["rope_parameters"] = {**plain["rope_parameters"], "rope_theta": plain.get("rope_theta", CSM_ROPE_THETA)}
    plain.update(architectures=["LlamaForCausalLM"], vocab_size=vocab_size, tie_word_embeddings=False,
                 eos_token_id=None)
    try:
        return ModelConfig.from_dict(plain, path)
    except ConfigError as e:
        raise ConfigError(str(e).replace("model config: ", f"model config: {field}", 1)) from None
