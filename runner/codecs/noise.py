"""Positional decoder noise: SNAC's NoiseBlock noise as a function of (seed, block, sample position).

SNAC's decoder injects noise (`NoiseBlock`: x + randn * linear(x)). With fresh random noise per
call, a window decoded in a batch, alone, or offline would differ, so the codec draws that noise
from a counter-based hash of (seed, block, absolute sample position): every sample gets the same
noise whichever window, batch or step produces it, and the model still sees noise of the trained
distribution. The fused kernels (runner/kernels/snac.py) compute the same bits in registers.
"""

from __future__ import annotations

import math

import torch

from runner.layers.hashing import M32, hash32, hash32_int, uniform24


def noise_salts(block: int) -> tuple[int, int]:
    """The two 32-bit salts of DecoderBlock `block`'s positional noise (see positional_noise)."""
    return hash32_int(2 * block + 0x9E37), hash32_int(2 * block + 1 + 0x9E37)


def positional_noise(seeds: torch.Tensor, block: int, start: torch.Tensor, length: int) -> torch.Tensor:
    """Standard normal noise (B, 1, length) keyed on (seed, block, absolute position).

    seeds, start: (B,) int64 on the target device; start is the absolute index (at this
    block's sample rate) of the window's first position. Same key -> same value, bitwise,
    on one device, so overlapping windows agree wherever they cover the same sample.
    """
    pos = (start[:, None] + torch.arange(length, device=start.device)) & M32  # (B, T)
    salt_a, salt_b = noise_salts(block)
    base = hash32(pos ^ hash32(seeds[:, None] & M32))
    h1 = hash32(base ^ salt_a)
    h2 = hash32(base ^ salt_b)
    # Top 24 bits -> uniforms in (0, 1) that float32 represents exactly; Box-Muller.
    u1, u2 = uniform24(h1), uniform24(h2)
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return z[:, None, :]
