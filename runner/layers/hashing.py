"""Counter-based 32-bit hashing shared by the stages that need reproducible noise.

Noise keyed on (seed, position) instead of drawn from a stateful generator gives the same value
whatever batch, window or step computes it: the codec's decoder noise (runner/codecs/noise.py) and the
sampler's race noise (runner/layers/sampler.py) both rely on that. The Triton kernels use
runner/kernels/hashing.py, which computes the same bits on uint32.

All values are int64 tensors holding integers in [0, 2^32).
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32), split in 16-bit halves so no product exceeds
    2^48 (int64 overflow would be undefined behaviour in the kernels)."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply), a bijection on [0, 2^32)."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash32_int(x: int) -> int:
    return int(hash32(torch.tensor([x & M32], dtype=torch.int64))[0])


def uniform24(h: torch.Tensor) -> torch.Tensor:
    """Top 24 bits of a hash -> float32 uniform in (0, 1), every value exact in float32."""
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))
