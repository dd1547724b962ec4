"""A tiny random Qwen3-TTS 12 Hz tokenizer folder for tests that need no reference: config.json
in the reference's layout + model.safetensors with every decoder tensor of
runner.codecs.qwen12hz_loader.decoder_shapes, at scales that keep the signal O(1) (as
tests/reference/qwen3_tts_codec_golden.py does for the reference's tiny codec), and with
`encoder=True` an encoder (a tiny random MimiModel's encoder side as `encoder.*`, its config as
`encoder_config`) of the decoder's codebooks, for reference-clip uploads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import MimiConfig, MimiModel

from runner.codecs.qwen12hz_loader import random_decoder_tensors, read_config

TINY_DECODER_CONFIG = dict(codebook_size=32, hidden_size=32, latent_dim=24, codebook_dim=16,
                           max_position_embeddings=1024, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           sliding_window=3, intermediate_size=48, num_hidden_layers=2, num_quantizers=16,
                           upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=32, hidden_act="silu",
                           attention_bias=False, rms_norm_eps=1e-5, rope_theta=10000)


def make_tiny_qwen12hz(path: Path, seed: int = 0, encoder: bool = False, **decoder_overrides) -> Path:
    """The folder at `path` (created), its tensors drawn from `seed`."""
    path.mkdir(parents=True, exist_ok=True)
    cfg_json = {"model_type": "qwen3_tts_tokenizer_12hz", "decode_upsample_rate": 1920, "output_sample_rate": 24000,
                "decoder_config": {**TINY_DECODER_CONFIG, **decoder_overrides}}
    tensors = {}
    if encoder:  # the decoder's codebooks, 1920 samples a frame (8 * 6 * 5 * 4 * compress 2)
        dec = cfg_json["decoder_config"]
        torch.manual_seed(seed)
        mimi = MimiModel(MimiConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, num_filters=4, codebook_size=dec["codebook_size"],
                                    codebook_dim=16, vector_quantization_hidden_dimension=16,
                                    num_quantizers=dec["num_quantizers"], upsampling_ratios=[8, 6, 5, 4],
                                    upsample_groups=32, sliding_window=6, use_cache=False)).eval()
        cfg_json.update(encoder_config=mimi.config.to_dict(), encoder_valid_num_quantizers=dec["num_quantizers"],
                        input_sample_rate=24000, encode_downsample_rate=1920)
        tensors.update({"encoder." + k: v.contiguous() for k, v in mimi.state_dict().items()})
    (path / "config.json").write_text(json.dumps(cfg_json))
    tensors.update(random_decoder_tensors(read_config(path), seed))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
