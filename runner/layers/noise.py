"""The sampler's race noise: counter-based Exponential(1) draws keyed on (seed, counter, token id).

Keyed instead of drawn from a stateful generator, so a seeded request gets the same noise alone
or anywhere in any batch, and after a preemption (runner/layers/sampler.py has the race).
The Triton backend computes the same bits (runner/kernels/sampling.py, passed NOISE_SALTS).
"""

from __future__ import annotations

import torch
from torch import Tensor

from runner.layers.hashing import M32, hash32, uniform24

# Salts of the race-noise key; the Triton launcher takes them as an argument (the same values).
NOISE_SALTS = (0x5851F42D, 0x68E31DA4, 0x1B873593)


def race_noise(seeds: Tensor, counters: Tensor, vocab: int, out: Tensor | None = None) -> Tensor:
    """q [B, V] float32 ~ Exponential(1), a pure function of (seed, counter, token id).

    seeds [B] int64 in [0, 2^63): the row's noise seed; counters [B] int64 >= 0: the index,
    among its request's outputs, of the token being sampled. Each (seed, counter) key gets a
    fresh iid row: u = uniform24(hash of key and v) in (0, 1), q = -log(u) in (0, 17.4].
    """
    s0, s1, s2 = NOISE_SALTS
    lo, hi = seeds & M32, (seeds >> 32) & M32
    key = hash32(hash32(lo ^ s0) ^ hi)
    key = hash32(key ^ hash32((counters & M32) ^ s1))  # [B]
    key2 = hash32(key ^ s2)
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    u = uniform24(hash32(hash32(v[None, :] ^ key[:, None]) ^ key2[:, None]))
    if out is None:
        return u.log_().neg_()
    return torch.log(u, out=out).neg_()
