"""Random-weight SNAC folders, built locally with no download: the tiny SNAC of the embedded
default model (runner/models/default_model.py) and tests, and the full-size snac_24khz
architecture with random weights that benchmarks and GPU tests decode with."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from snac import SNAC
from snac.layers import Snake1d

# The published snac_24khz architecture (what Orpheus decodes with); benchmarks and GPU tests
# build it with random weights, since nothing is downloaded.
SNAC_24KHZ_CONFIG = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "latent_dim": None,
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}


# make_tiny_snac's widths: the 24 kHz topology, tiny channels and codebook
TINY_SNAC_CONFIG = {**SNAC_24KHZ_CONFIG, "encoder_dim": 4, "latent_dim": 32, "decoder_dim": 32, "codebook_size": 64}


def random_snac(config: dict, seed: int, random_alphas: bool) -> SNAC:
    """SNAC(**config) with random weights drawn from `seed` (the global RNG state is restored).
    random_alphas: Snake alphas uniform in [0.5, 3] instead of SNAC's initial 1, so the output
    is a busy signal (|x| ~ 0.4 on average, rarely clipped): a near-silent random decoder would
    make PCM comparisons vacuous."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = SNAC(**config)
        if random_alphas:
            with torch.no_grad():
                for m in model.decoder.modules():
                    if isinstance(m, Snake1d):
                        m.alpha.uniform_(0.5, 3.0)
    finally:
        torch.random.set_rng_state(gen_state)
    return model


def write_random_snac(path: str | Path, config: dict = SNAC_24KHZ_CONFIG, seed: int = 0, random_alphas: bool = False) -> Path:
    """A loadable SNAC folder (config.json + pytorch_model.bin) from random_snac."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    torch.save(random_snac(config, seed, random_alphas).state_dict(), path / "pytorch_model.bin")
    return path


def make_tiny_snac(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny random SNAC (24 kHz layout: hop 512, strides [4, 2, 1]) to `path`.

    Same topology as snac_24khz (depthwise, noise, no attention, rates 8/8/4/2) so frames are
    2048 samples and the receptive field is the real one; only the widths are tiny
    (decoder 32 -> 2 channels, codebook 64) so a 12-frame window decodes in ~20 ms on one
    CPU core. Random Snake alphas (random_snac). Saved as config.json + pytorch_model.bin
    with legacy weight_g/weight_v keys (what torch.nn.utils.weight_norm checkpoints such as
    the published one hold), so tests exercise the legacy-key conversion; parametrized keys
    load too.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = TINY_SNAC_CONFIG
    model = random_snac(config, seed, random_alphas=True)
    sd = {}
    for k, v in model.state_dict().items():
        k = k.replace("parametrizations.weight.original0", "weight_g").replace("parametrizations.weight.original1", "weight_v")
        sd[k] = v.contiguous()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    torch.save(sd, path / "pytorch_model.bin")
    return path
