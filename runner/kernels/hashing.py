"""Triton twins of runner/layers/hashing.py: the same bits on uint32 (wrapping multiplies, logical
shifts), so a kernel and the torch reference draw identical noise keys."""

import triton
import triton.language as tl


@triton.jit
def hash32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def uniform24(h):
    return ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
