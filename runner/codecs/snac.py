"""Loading SNAC from a local folder for decoding: checked against the CodecConfig, weight norm baked."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from snac import SNAC

from runner.codecs.config import CodecConfig, CodecError
from runner.codecs.orpheus_tokens import ORPHEUS_LEVELS


def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    st = folder / "model.safetensors"
    if st.is_file():
        return load_file(str(st), device="cpu")
    pt = folder / "pytorch_model.bin"
    if pt.is_file():
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise CodecError(f"CodecConfig.path: {folder} has neither model.safetensors nor pytorch_model.bin")


def load_snac(cfg: CodecConfig, device: torch.device, dtype: torch.dtype = torch.float32) -> SNAC:
    """Build SNAC from a local folder (never the hub), check it matches cfg, bake weight norm.

    The published checkpoints store weight norm as weight_g/weight_v; torch's parametrized
    weight_norm converts those on load, so both key layouts load with strict=True.
    """
    folder = Path(cfg.path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise CodecError(f"CodecConfig.path: {cfg_file} not found")
    snac_cfg = json.loads(cfg_file.read_text())
    model = SNAC(**snac_cfg)
    model.load_state_dict(_read_state_dict(folder), strict=True)

    hop = int(model.hop_length)
    strides = list(model.vq_strides)
    checks = {
        "sample_rate": (cfg.sample_rate, model.sampling_rate),
        "codebook_size": (cfg.codebook_size, model.codebook_size),
        "samples_per_frame": (cfg.samples_per_frame, hop * strides[0]),
    }
    for name, (want, got) in checks.items():
        if want != got:
            raise CodecError(f"CodecConfig.{name}: {want} does not match the SNAC model in {folder} ({got})")
    if len(strides) != len(ORPHEUS_LEVELS) or any(strides[0] // s != len(g) for s, g in zip(strides, ORPHEUS_LEVELS)):
        raise CodecError(f"CodecConfig.path: SNAC vq_strides {strides} do not fit the Orpheus 1/2/4 layout")
    if model.attn_window_size is not None:
        # LocalMHA attends in fixed blocks of the latent sequence, which windowed decoding
        # would misalign; the 24 kHz model has none.
        raise CodecError(f"CodecConfig.path: SNAC with local attention (attn_window_size={model.attn_window_size}) is not supported")

    # Only the quantizer's from_codes and the decoder are used: drop the encoder, and bake
    # weight norm into plain weights (recomputing it every forward is pure overhead).
    model.encoder = torch.nn.Identity()
    for m in model.modules():
        if torch.nn.utils.parametrize.is_parametrized(m):
            for name in list(m.parametrizations.keys()):
                torch.nn.utils.parametrize.remove_parametrizations(m, name, leave_parametrized=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
