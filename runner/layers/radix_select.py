"""Top-k / top-p thresholds without sorting [B, V]: radix select on an order-preserving key
(the torch sampling backend; runner/layers/sampler.py has the semantics).

Both filters keep an upper set {key(y) >= t} of the row; t is the smallest key such that the
statistic (count or mass) of the strictly larger tokens is below the bound. The statistic is
monotone in t, so t is found digit by digit, MSB first: a level histograms the tokens still in
play (one index_add_ over [B, V]) and picks the digit where the suffix sum crosses the bound.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runner.layers.sampling_batch import SamplingBatch
from runner.layers.workspaces import Workspaces

# 16-bit digits (two levels cover the 32-bit key) once the vocabulary is at least as large as
# the [B, 65536] histogram, 8-bit digits below that.
_DIGIT_BITS = 16
_NUM_DIGITS = 1 << _DIGIT_BITS


def order_key(y: Tensor, out: Tensor | None = None, tmp: Tensor | None = None) -> Tensor:
    """Order-preserving int32 image of float32 `y` (any shape): y1 < y2 <=> key1 < key2.

    Sign-magnitude bits -> two's complement: key = bits for y >= 0, -(bits & 0x7FFFFFFF) for
    y < 0, so -0.0 and +0.0 both map to 0 (they are equal floats, hence ties), -inf to
    -0x7F800000 and +inf to 0x7F800000. NaN keys lie beyond +-inf (NaN logits are not
    supported). `out`/`tmp` are optional int32 workspaces shaped like y.
    """
    bits = y.view(torch.int32)
    sign = torch.bitwise_right_shift(bits, 31, out=tmp)  # 0 or -1 (arithmetic shift)
    key = torch.bitwise_and(bits, 0x7FFFFFFF, out=out)  # magnitude
    key ^= sign
    key -= sign  # (mag ^ s) - s: negates where s == -1
    return key


def thresholds(key: Tensor, e: Tensor | None, batch: SamplingBatch, ws: Workspaces) -> Tensor:
    """Per-row key threshold t [B, 1] int32 of top-k then top-p (keep key >= t)."""
    inf = float("inf")
    v = key.shape[1]
    t = None
    if batch.any_top_k:
        k = batch.top_k
        bound = torch.where((k <= 0) | (k >= v), inf, k.to(torch.float64))  # off rows keep all
        t = radix_select(key, None, bound, None, ws)
    if batch.any_top_p:
        assert e is not None
        frac = torch.where(batch.top_p < 1, batch.top_p.to(torch.float64), inf)  # p = 1: off
        tp = radix_select(key, e, frac, t, ws)
        t = tp if t is None else torch.maximum(t, tp)
    assert t is not None
    return t


def radix_select(key: Tensor, weight: Tensor | None, bound: Tensor, floor: Tensor | None, ws: Workspaces) -> Tensor:
    """Smallest key t per row with stat({key > t}) < bound, over the tokens with key >= floor.

    key [B, V] int32; weight [B, V] f32 (stat = mass) or None (stat = count); bound [B] f64:
    the count bound, or with a weight the fraction p of the total mass (inf = keep all);
    floor [B, 1] int32 or None. Returns t [B, 1] int32; keep key >= t.

    MSB-first radix select: level l histograms digit l of the tokens whose higher digits
    equal the prefix chosen so far, then picks the first digit (from the bottom) whose
    suffix stat (everything strictly above it, plus what lies above the prefix) is below
    the bound. Digits are 16 bits (2 levels) for a large vocabulary, 8 bits (4 levels)
    otherwise, so the [B, 2^bits] histogram never outgrows [B, V]. One flattened histogram
    (+1 trash bin for tokens out of play), so a level is one index_add_ over [B, V].
    """
    b, v = key.shape
    bits = _DIGIT_BITS if v >= _NUM_DIGITS else 8
    nb = 1 << bits
    trash = b * nb  # int32 bin indices: fine up to B = 32767 rows
    if trash >= 2**31:
        raise ValueError(f"batch of {b} rows too large for the int32 histogram index")
    base = torch.arange(b, device=key.device, dtype=torch.int32).unsqueeze(1) * nb  # [B, 1] bin offset per row
    idx = ws.get("idx", b, v, torch.int32)
    out_of_play = ws.get("oop", b, v, torch.bool)
    hi_bits = ws.get("tmp", b, v, torch.int32)  # free once order_key is done
    floor_mask = None
    if floor is not None:
        floor_mask = torch.lt(key, floor, out=ws.get("floor", b, v, torch.bool))
    lim = None
    above = None
    prefix = None  # [B] int64: the key's bits above the current digit (signed)
    for level in range(32 // bits):
        shift = 32 - bits * (level + 1)
        torch.bitwise_right_shift(key, shift, out=idx)
        if level == 0:
            idx += base + nb // 2  # signed top digit -> [0, nb)
            dead = floor_mask  # True = out of play
        else:
            assert prefix is not None
            # In play: higher bits == prefix; tell them apart before masking the digit out.
            # (key >> shift) >> bits == key >> (shift + bits) for arithmetic shifts.
            torch.bitwise_right_shift(idx, bits, out=hi_bits)
            dead = torch.ne(hi_bits, prefix.unsqueeze(1).to(torch.int32), out=out_of_play)
            if floor_mask is not None:
                dead |= floor_mask
            idx &= nb - 1
            idx += base
        if dead is not None:
            idx.masked_fill_(dead, trash)
        cum = _histogram(idx, weight, b, nb)  # [B, nb] f64 inclusive prefix sums
        if lim is None:
            # Level 0 sees every token in play: its total is Z for the mass bound.
            lim = bound if weight is None else bound * cum[:, -1]  # inf * Z = inf: row off
            above = torch.zeros_like(lim)
        digit, above = _pick_digit(cum, above, lim)
        prefix = digit - nb // 2 if level == 0 else prefix * nb + digit
    assert prefix is not None
    return prefix.to(torch.int32).unsqueeze(1)


def _histogram(idx: Tensor, weight: Tensor | None, b: int, nb: int) -> Tensor:
    """Per-row inclusive prefix sums [B, nb] float64 of the per-bin count (weight None) or
    weight sum; flat bin b*nb is the trash bin and is dropped. One index_add_, no host sync."""
    n = b * nb + 1
    hist = torch.zeros(n, dtype=torch.float32, device=idx.device)
    if weight is None:
        # Counts as fp32 sums of ones: exact below 2^24. (Not bincount: on CUDA it reads
        # idx.max() back to the host to size its output.)
        weight = torch.ones((), dtype=torch.float32, device=idx.device).expand(idx.shape)
    hist.index_add_(0, idx.view(-1), weight.reshape(-1))
    return torch.cumsum(hist[:-1].view(b, nb), dim=-1, dtype=torch.float64)


def _pick_digit(cum: Tensor, above: Tensor, lim: Tensor) -> tuple[Tensor, Tensor]:
    """cum [B, D] f64 prefix sums of this level's histogram, above [B] (stat above this
    level's prefix), lim [B] -> (digit [B] int64, stat strictly above that digit [B]).

    suffix[d] = above + total - cum[d] (everything strictly above digit d) is non-increasing
    in d, also in floating point (cum only grows and subtraction is monotone), so the first
    digit with suffix < lim is the number of digits with suffix >= lim, i.e. with
    cum[d] <= above + total - lim. suffix[D-1] = above < lim holds by the caller's invariant
    (the prefix bucket was chosen with its suffix below the bound; at level 0 above = 0).
    float64 keeps the subtraction's error far below the fp32 error of the sums themselves.
    """
    d = cum.shape[1]
    total = cum[:, -1]
    digit = (cum <= (above + total - lim).unsqueeze(1)).sum(dim=-1).clamp_(max=d - 1)  # [B]
    above_digit = above + total - cum.gather(1, digit.unsqueeze(1)).squeeze(1)
    return digit, above_digit
