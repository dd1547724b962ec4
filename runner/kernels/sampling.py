"""Triton kernels of the sampler's 'triton' backend (runner/layers/sampler.py has the semantics).

Why: at batch 256 x 156940 the sort-based top-p sorted 40M floats per step (most of ~7.5 ms of
sampling) and the rest was ~15 elementwise passes. Here a step is:

  * `_penalty_kernel`: repetition / frequency / presence penalties in one pass that reads the
    slot-state rows in place (no [B, V] gathers), with the reference roundings (x * p, x / p,
    x - f * c, x - p * 1; launched with fp fusion off so x - f * c is not turned into an FMA).
  * `_filter_sample_kernel`: one program per row does the whole stage 4 (+ the race):
      pass 1   y = x / T written in place; row max (greedy id), min finite value, #finite;
      top-k    search for the count threshold   (keep key(y) > lo, count(key > lo) < k);
      top-p    search for the mass threshold    (mass(key > lo) < p * Z, mass = exp(y - max));
      last     min-p (exp(y - max) >= min_p), then either the exponential race
               argmax(e / q) (SAMPLE) or the filtered logits written in place.
    A search keeps an interval (lo, hi] of order keys with stat(lo) >= bound > stat(hi).
    While it holds more than C tokens, a pivot pass evaluates the statistic at NP pivots in one
    read of the row (NP - 1 evenly spaced in value, which adapts to where the logits are, plus
    the key midpoint, which bounds the passes at 32 however the values are spread) and shrinks
    the interval to the bucket where the statistic crosses the bound. Then one pass compacts
    the <= C tokens of the interval into a per-row scratch, and a bisection on the key
    finishes in registers. Peaked rows need ~1 pivot pass, near-uniform rows (random weights:
    the nucleus is most of the vocabulary) ~2, each a read of 4 B/token.

Keys: `_order_key` is the int32 image of the float that preserves order and maps -0.0 and
+0.0 to the same key (they are equal logits). Tokens tied at the threshold value are all kept
(see runner/layers/sampler.py). Statistics are fp32 sums in a fixed order per row (no atomics), so a
row's result does not depend on the other rows of the batch. One caveat: the program width
(num_warps vs num_warps_small, picked by B against the SM count) changes the reduction tree
of the mass sums, i.e. their last-bit rounding; a seeded row is bit-reproducible across
batches on the same side of the SM count, and across it unless a cumulative mass lands within
rounding of its bound. The default sets num_warps_small = num_warps, removing even that.

Importing this module needs `triton`; the sampler imports it only for the triton backend
(tests run it under TRITON_INTERPRET=1 on CPU).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from runner.kernels.gpu_info import num_sms
from runner.kernels.hashing import hash32, uniform24
from runner.kernels.tuning.tiles import SamplingTuning

if TYPE_CHECKING:  # annotations only: kernels never import runner.layers at run time
    from runner.layers.sampling_batch import SamplingBatch
    from runner.layers.slot_state import SlotState

# Launch configuration of `_filter_sample_kernel` (runner/kernels/tuning/tiles.py SamplingTuning
# says what each one is): a backend passes its device's (`Tables.sampling`, chosen once at its
# construction) to each launch; a caller that passes none gets the untuned values. Every pass
# loads the next chunk before working on the current one (a hand-rolled pipeline: with one or two
# programs per SM nothing else would hide the memory latency).
DEFAULT_TUNING = SamplingTuning()
_PENALTY_BLOCK = 2048


# --------------------------------------------------------------------------- helpers


@triton.jit
def _order_key(y):
    """int32 key with y1 < y2 <=> key1 < key2 for non-NaN fp32; -0.0 and +0.0 -> 0.

    Sign-magnitude -> two's complement: (mag ^ s) - s negates mag where s = -1 (sign bit set).
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = bits >> 31  # arithmetic: 0 or -1
    mag = bits & 0x7FFFFFFF
    return (mag ^ sign) - sign


@triton.jit
def _key_value(key):
    """Inverse of `_order_key` (key 0 -> +0.0)."""
    neg = key < 0
    mag = tl.where(neg, -key, key)
    bits = tl.where(neg, mag | -2147483648, mag)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pivots(lo, hi, NP: tl.constexpr):
    """[NP] int32 pivots inside (lo, hi) (requires hi - lo >= 2): pivot 0 is the key midpoint,
    pivots 1..NP-1 are j/NP of the way from value(lo) to value(hi). Duplicates are harmless."""
    j = tl.arange(0, NP)
    lo64 = lo.to(tl.int64)
    hi64 = hi.to(tl.int64)
    mid = lo64 + (hi64 - lo64) // 2
    # Clamp to finite keys first (the key below -FLT_MAX would decode to NaN bits).
    vlo = _key_value(tl.maximum(lo, -0x7F7FFFFF))
    vhi = _key_value(tl.minimum(hi, 0x7F7FFFFF))
    f = j.to(tl.float32) / NP
    v = vlo * (1.0 - f) + vhi * f  # no overflow: each term is finite
    piv = tl.where(j == 0, mid, _order_key(v).to(tl.int64))
    piv = tl.minimum(tl.maximum(piv, lo64 + 1), hi64 - 1)
    return piv.to(tl.int32)


@triton.jit
def _load_row(y_row, offs, V):
    """One chunk of a row; lanes past V read -inf (key below every `lo`, e = 0)."""
    return tl.load(y_row + offs, mask=offs < V, other=float("-inf"))


@triton.jit
def _search(y_row, sk_row, V, m, lo, hi, n_in, bound, frac, on,
            MASS: tl.constexpr, BLOCK_P: tl.constexpr, NP: tl.constexpr, BLOCK_S: tl.constexpr,
            C: tl.constexpr, MAX_PASSES: tl.constexpr):
    """Smallest key t with stat(key > t) < bound; returns (lo, count(key > lo)): keep key > lo.

    In: (lo, hi] with stat(lo) >= bound > stat(hi) = 0 (hi = key of the row max), lo above
    key(-inf) (so -inf tokens and padding lanes are never in play); n_in >= the number of
    tokens in (lo, hi] (exact for count searches, an upper bound for mass ones); bound: k
    (count) or < 0 = "frac * mass(key > lo), measured on the first look at the row" (mass).
    `on` False: returns lo unchanged. stat = count (MASS False) or sum of exp(y - m).
    """
    arp2 = tl.arange(0, BLOCK_P)[:, None]
    ars = tl.arange(0, BLOCK_S)
    fhi_c = n_in * 0  # count(key > hi): 0 above the row max
    fhi_m = tl.full([], 0.0, tl.float32)  # mass(key > hi)
    flo_c = n_in
    it = n_in * 0
    go = on & (n_in > C) & (hi.to(tl.int64) - lo.to(tl.int64) > 1)
    # ---- pivot passes over the whole row until the interval fits the scratch
    while go:
        piv = _pivots(lo, hi, NP)  # [NP]
        piv2 = piv[None, :]  # [1, NP]
        acc_c = tl.zeros([BLOCK_P, NP], dtype=tl.float32)  # counts in fp32: exact below 2^24
        acc_m = tl.zeros([BLOCK_P, NP], dtype=tl.float32)
        lo_c = tl.zeros([BLOCK_P, 1], dtype=tl.int32)
        lo_m = tl.zeros([BLOCK_P, 1], dtype=tl.float32)
        # The chunk is loaded as a [BLOCK_P, 1] column so that it already has the layout of the
        # [BLOCK_P, NP] tile (a 1-D load would be re-laid out through shared memory each chunk).
        y_next = _load_row(y_row, arp2, V)
        for start in range(0, V, BLOCK_P):
            y = y_next
            y_next = _load_row(y_row, start + BLOCK_P + arp2, V)  # prefetch: in flight during the math
            key = _order_key(y)  # [BLOCK_P, 1]
            gt = key > piv2  # [BLOCK_P, NP]
            acc_c += tl.where(gt, 1.0, 0.0)  # (an int32 count compiles to 3 instructions, this to 2)
            above_lo = key > lo
            lo_c += above_lo.to(tl.int32)
            if MASS:
                e = tl.exp(y - m)  # exp(-inf) = 0
                acc_m += tl.where(gt, e, 0.0)
                lo_m += tl.where(above_lo, e, 0.0)
        fc = tl.sum(acc_c, axis=0).to(tl.int32)  # [NP] count(key > pivot)
        flo_c = tl.sum(tl.sum(lo_c, axis=1), axis=0)  # exact count(key > lo)
        if MASS:
            fm = tl.sum(acc_m, axis=0)
            bound = tl.where(bound < 0, frac * tl.sum(tl.sum(lo_m, axis=1), axis=0), bound)
            stat = fm
        else:
            fm = fc.to(tl.float32)  # unused
            stat = fc.to(tl.float32)
        # Within a pass the stats are monotone in the pivot (same accumulation order, termwise
        # >=), so every pivot with stat >= bound lies below every pivot with stat < bound.
        drop = stat >= bound
        new_hi = tl.min(tl.where(drop, hi, piv), axis=0)
        new_lo = tl.minimum(tl.max(tl.where(drop, piv, lo), axis=0), new_hi - 1)  # (a guard; never binds)
        fhi_c = tl.where(new_hi == hi, fhi_c, tl.max(tl.where(piv == new_hi, fc, 0), axis=0))
        fhi_m = tl.where(new_hi == hi, fhi_m, tl.max(tl.where(piv == new_hi, fm, 0.0), axis=0))
        flo_c = tl.where(new_lo == lo, flo_c, tl.max(tl.where(piv == new_lo, fc, 0), axis=0))
        lo = new_lo
        hi = new_hi
        n_in = flo_c - fhi_c
        it += 1
        go = (n_in > C) & (hi.to(tl.int64) - lo.to(tl.int64) > 1) & (it < MAX_PASSES)
    # ---- compact the interval's tokens into the scratch, finish by bisection in registers
    fin = on & (n_in > 1) & (hi.to(tl.int64) - lo.to(tl.int64) > 1)
    if fin:
        tl.debug_barrier()  # the scratch may still be read by a previous search's bisection
        n_c = n_in * 0
        y_next = _load_row(y_row, ars, V)
        for start in range(0, V, BLOCK_S):
            y = y_next
            y_next = _load_row(y_row, start + BLOCK_S + ars, V)
            key = _order_key(y)
            sel = (key > lo) & (key <= hi)
            pos = n_c + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            w = sel & (pos < C)  # only short of room after MAX_PASSES (NaN rows)
            tl.store(sk_row + pos, key, mask=w)  # keys only: the masses are recomputed from them
            n_c += tl.sum(sel.to(tl.int32), axis=0)
        tl.debug_barrier()  # make the scratch writes visible to the whole program
        ci = tl.arange(0, C)
        have = ci < n_c
        kc = tl.load(sk_row + ci, mask=have, other=lo)  # padding: key lo is outside (lo, hi]
        if MASS:
            # _key_value inverts _order_key exactly (bar -0.0 -> +0.0): the same e as the passes'.
            ec = tl.where(have, tl.exp(_key_value(kc) - m), 0.0)
            bound = tl.where(bound < 0, frac * (fhi_m + tl.sum(ec, axis=0)), bound)
        n_in = n_c
        go = (n_in > 1) & (hi.to(tl.int64) - lo.to(tl.int64) > 1)
        while go:  # <= 32 rounds: the key range halves each time
            mid = (lo.to(tl.int64) + (hi.to(tl.int64) - lo.to(tl.int64)) // 2).to(tl.int32)
            s = (kc > mid) & (kc <= hi)
            c = tl.sum(s.to(tl.int32), axis=0)
            fc_mid = fhi_c + c
            if MASS:
                fm_mid = fhi_m + tl.sum(tl.where(s, ec, 0.0), axis=0)
                drop = fm_mid >= bound
                fhi_m = tl.where(drop, fhi_m, fm_mid)
            else:
                drop = fc_mid.to(tl.float32) >= bound
            lo = tl.where(drop, mid, lo)
            hi = tl.where(drop, hi, mid)
            fhi_c = tl.where(drop, fhi_c, fc_mid)
            n_in = tl.where(drop, c, n_in - c)
            go = (n_in > 1) & (hi.to(tl.int64) - lo.to(tl.int64) > 1)
        flo_c = fhi_c + n_in
    return lo, flo_c


# --------------------------------------------------------------------------- kernels


# The batch's filter flags are runtime arguments (uniform branches), not constexprs: with 2^3
# combinations a combination first met mid-serving would compile then (~1 s with every stream
# waiting; tests/gpu/test_gpu.py holds it to none). Not specialised, so 0 and 1 share one variant; nor
# are the row strides: a prefill step's logits can be a view of the padded lm_head output (row
# stride 156992, a multiple of 16) where warm-up saw contiguous rows (156940), and that alone
# compiled a second variant for the first long prompt. With V not a multiple of 16
# the row loads are not vectorised either way.
@triton.jit(do_not_specialize=["stride_y", "stride_q", "has_top_k", "has_top_p", "has_min_p"])
def _filter_sample_kernel(
    y_ptr, stride_y,  # logits [B, V] f32; scaled (and in WRITE mode filtered) in place
    q_ptr, stride_q,  # race noise [B, V] f32 (SAMPLE only)
    ids_ptr,  # [B] int64 out (SAMPLE only)
    temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # [B] f32, i64, f32, f32
    sk_ptr,  # scratch [B, C] int32: the keys of a search's last interval
    V,
    has_top_k, has_top_p, has_min_p,  # int 0/1: some row of the batch uses top-k / top-p / min-p
    SAMPLE: tl.constexpr,  # True: race -> ids; False: write the filtered logits
    BLOCK_P: tl.constexpr, NP: tl.constexpr, BLOCK_S: tl.constexpr, C: tl.constexpr,
    MAX_PASSES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * stride_y
    sk_row = sk_ptr + row * C
    ars = tl.arange(0, BLOCK_S)
    filt = (has_top_k != 0) | (has_top_p != 0)
    no_filter = ~filt
    no_min_p = has_min_p == 0
    t_raw = tl.load(temp_ptr + row)
    greedy = t_raw == 0.0
    temp = tl.where(greedy, 1.0, t_raw)  # greedy rows are filtered unscaled (WRITE mode)
    rescale = temp != 1.0
    if SAMPLE:
        active = t_raw != 0.0  # a greedy row only needs its argmax (pass 1)
    else:
        active = t_raw == t_raw

    # ---- pass 1: y = x / T in place; max (first argmax), min finite value, #finite
    mx = tl.full([BLOCK_S], float("-inf"), tl.float32)
    mxi = tl.zeros([BLOCK_S], dtype=tl.int32)
    mn = tl.full([BLOCK_S], float("inf"), tl.float32)
    nf = tl.zeros([BLOCK_S], dtype=tl.int32)
    x_next = _load_row(y_row, ars, V)
    for start in range(0, V, BLOCK_S):
        x = x_next
        x_next = _load_row(y_row, start + BLOCK_S + ars, V)
        offs = start + ars
        y = tl.div_rn(x, temp)  # IEEE division, as torch's (plain `/` is div.full: 2 ulp)
        if rescale:  # uniform branch (a scalar-bool mask trips the interpreter)
            tl.store(y_row + offs, y, mask=offs < V)
        upd = y > mx  # strict: each lane keeps its first max
        mx = tl.where(upd, y, mx)
        mxi = tl.where(upd, offs, mxi)
        finite = y > float("-inf")
        mn = tl.where(finite, tl.minimum(mn, y), mn)
        nf += finite.to(tl.int32)
    m = tl.max(mx, axis=0)
    greedy_id = tl.min(tl.where(mx == m, mxi, V), axis=0)
    n_fin = tl.sum(nf, axis=0)
    hi = _order_key(m)
    lo = _order_key(tl.min(mn, axis=0)) - 1  # every finite token is above lo, -inf below
    n_in = n_fin

    # ---- top-k, then top-p over what top-k kept
    if has_top_k != 0:
        k = tl.load(topk_ptr + row)
        k_on = active & (k > 0) & (k < n_fin)  # k >= #finite keeps every finite token
        lo, n_in = _search(y_row, sk_row, V, m, lo, hi, n_in, k.to(tl.float32), 0.0, k_on,
                           False, BLOCK_P, NP, BLOCK_S, C, MAX_PASSES)
    if has_top_p != 0:
        p = tl.load(topp_ptr + row)
        p_on = active & (p < 1.0)
        # Tokens more than 120 below the max have exp(y - max) == 0 in fp32: massless, they
        # never cross the bound; starting above them narrows the value range of the pivots.
        lo = tl.maximum(lo, _order_key(m - 120.0) - 1)  # n_in stays an upper bound
        unknown = p * 0.0 - 1.0  # bound < 0: p * Z, Z measured by the search itself
        lo_p, n_in = _search(y_row, sk_row, V, m, lo, hi, n_in, unknown, p, p_on,
                             True, BLOCK_P, NP, BLOCK_S, C, MAX_PASSES)
        lo = tl.where(p_on, lo_p, lo)
    min_p = tl.load(minp_ptr + row)  # read (and applied) only where has_min_p

    # ---- last pass: min-p, then the race or the filtered logits
    if SAMPLE:
        best = tl.full([BLOCK_S], -1.0, tl.float32)
        besti = tl.zeros([BLOCK_S], dtype=tl.int32)
        if active:
            q_row = q_ptr + row * stride_q
            y_next = _load_row(y_row, ars, V)
            q_next = tl.load(q_row + ars, mask=ars < V, other=1.0)
            for start in range(0, V, BLOCK_S):
                y = y_next
                q = q_next
                offs = start + ars
                nxt = offs + BLOCK_S
                y_next = _load_row(y_row, nxt, V)
                q_next = tl.load(q_row + nxt, mask=nxt < V, other=1.0)
                e = tl.exp(y - m)
                keep = (offs < V) & ((_order_key(y) > lo) | no_filter) & ((e >= min_p) | no_min_p)
                # race_noise is > 0; the clamp guards hand-made q (e/0 = inf or NaN).
                score = tl.where(keep, e / tl.maximum(q, 1.1754943508222875e-38), -1.0)
                upd = score > best
                best = tl.where(upd, score, best)
                besti = tl.where(upd, offs, besti)
        top = tl.max(best, axis=0)
        win = tl.min(tl.where(best == top, besti, V), axis=0)
        tl.store(ids_ptr + row, tl.where(greedy, greedy_id, win).to(tl.int64))
    else:
        if filt | (has_min_p != 0):
            y_next = _load_row(y_row, ars, V)
            for start in range(0, V, BLOCK_S):
                y = y_next
                offs = start + ars
                y_next = _load_row(y_row, offs + BLOCK_S, V)
                keep = (offs < V) & ((_order_key(y) > lo) | no_filter) & ((tl.exp(y - m) >= min_p) | no_min_p)
                tl.store(y_row + offs, tl.where(keep, y, float("-inf")), mask=offs < V)


# Flags and the logits' row stride at run time, for the reasons given at _filter_sample_kernel.
@triton.jit(do_not_specialize=["stride_x", "has_rep", "has_freq", "has_pres"])
def _penalty_kernel(
    x_ptr, stride_x,  # logits [B, V] f32, in place
    rows_ptr,  # [B] int64 state row per batch row (padding -> scratch row S)
    mask_ptr, stride_mask,  # prompt mask [S+1, V] uint8
    cnt_ptr, stride_cnt,  # output counts [S+1, V] int32
    rep_ptr, freq_ptr, pres_ptr,  # [B] f32
    V,
    has_rep, has_freq, has_pres,  # int 0/1: some row of the batch uses this penalty
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < V
    r = tl.load(rows_ptr + b)
    x_row = x_ptr + b * stride_x
    x = tl.load(x_row + offs, mask=valid, other=0.0)
    c = tl.load(cnt_ptr + r * stride_cnt + offs, mask=valid, other=0)
    if has_rep != 0:
        pm = tl.load(mask_ptr + r * stride_mask + offs, mask=valid, other=0)
        rep = tl.load(rep_ptr + b)
        seen = (pm != 0) | (c > 0)
        x = tl.where(seen, tl.where(x < 0, x * rep, tl.div_rn(x, rep)), x)  # IEEE division, as torch's
    if has_freq != 0:
        x = x - tl.load(freq_ptr + b) * c.to(tl.float32)
    if has_pres != 0:
        x = x - tl.load(pres_ptr + b) * tl.where(c > 0, 1.0, 0.0)
    tl.store(x_row + offs, x, mask=valid)


# --------------------------------------------------------------------------- launchers


def apply_penalties(logits: torch.Tensor, batch: "SamplingBatch", state: "SlotState", col0: int = 0) -> None:
    """Stage 1 in place on logits [B, N] f32 of ids [col0, col0 + N), reading the state rows
    directly (the state's columns from col0 on are a view: the kernel sees them as its ids)."""
    prompt_mask, counts = state.penalty_buffers()  # [S+1, V] each (raises if never allocated)
    b, v = logits.shape
    if b == 0:
        return
    if logits.stride(1) != 1:
        dense = logits.contiguous()
        apply_penalties(dense, batch, state, col0)
        logits.copy_(dense)
        return
    prompt_mask, counts = prompt_mask[:, col0:], counts[:, col0:]
    rows = state.row_index(batch.slots)  # [B] int64, on device
    mask = prompt_mask.view(torch.uint8)
    grid = (b, triton.cdiv(v, _PENALTY_BLOCK))
    _penalty_kernel[grid](
        logits, logits.stride(0), rows, mask, mask.stride(0), counts, counts.stride(0),
        batch.repetition_penalty, batch.frequency_penalty, batch.presence_penalty, v,
        int(batch.any_repetition), int(batch.any_frequency), int(batch.any_presence),
        BLOCK=_PENALTY_BLOCK, num_warps=4, enable_fp_fusion=False,
    )


@triton.jit
def _race_noise_kernel(seed_ptr, ctr_ptr, salt_ptr, out_ptr, stride_o, V, BLOCK: tl.constexpr):
    # runner.layers.noise.race_noise, one [BLOCK] piece of one row per program: same hash bits
    # (uint32 here, int64 in [0, 2^32) there); -log may round differently in the last ulp.
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row)
    ctr = tl.load(ctr_ptr + row)
    s0 = tl.load(salt_ptr).to(tl.uint32)
    s1 = tl.load(salt_ptr + 1).to(tl.uint32)
    s2 = tl.load(salt_ptr + 2).to(tl.uint32)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = hash32(hash32(lo ^ s0) ^ hi)
    key = hash32(key ^ hash32((ctr & 0xFFFFFFFF).to(tl.uint32) ^ s1))
    key2 = hash32(key ^ s2)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = hash32(hash32(cols.to(tl.uint32) ^ key) ^ key2)
    q = -tl.log(uniform24(h))
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, q, mask=cols < V)


_NOISE_BLOCK = 2048


@functools.lru_cache(maxsize=None)
def _salts(device: torch.device, salts: tuple[int, int, int]) -> torch.Tensor:
    return torch.tensor(salts, dtype=torch.int64, device=device)


def race_noise(seeds: torch.Tensor, counters: torch.Tensor, out: torch.Tensor,
               salts: tuple[int, int, int]) -> torch.Tensor:
    """Fill out [B, V] (contiguous rows) with runner.layers.noise.race_noise(seeds, counters, V), one
    launch; `salts`: runner.layers.noise.NOISE_SALTS."""
    b, v = out.shape
    assert out.stride(1) == 1 and seeds.shape == (b,) and counters.shape == (b,)
    if b:
        grid = (b, triton.cdiv(v, _NOISE_BLOCK))
        _race_noise_kernel[grid](seeds, counters, _salts(out.device, tuple(salts)), out, out.stride(0), v, BLOCK=_NOISE_BLOCK, num_warps=4)
    return out


def _launch(logits: torch.Tensor, batch: "SamplingBatch", q: torch.Tensor | None, ids: torch.Tensor | None,
            tuning: SamplingTuning | None) -> None:
    b, v = logits.shape
    if b == 0:
        return
    if logits.stride(1) != 1:  # the kernel walks rows with unit stride; rare, so a copy is fine
        dense = logits.contiguous()
        _launch(dense, batch, q, ids, tuning)
        logits.copy_(dense)
        return
    if v >= 1 << 24:
        raise ValueError(f"vocabulary {v} too large: pivot counts are accumulated in fp32 (exact below 2^24)")
    t = tuning or DEFAULT_TUNING
    warps = t.num_warps_small if b <= num_sms(logits.device) else t.num_warps
    filt = batch.any_top_k or batch.any_top_p
    c = t.C if filt else 1  # no search: no scratch
    sk = torch.empty(b, c, dtype=torch.int32, device=logits.device)
    sample = q is not None
    _filter_sample_kernel[(b,)](
        logits, logits.stride(0),
        q if sample else logits, q.stride(0) if sample else 0,
        ids if ids is not None else torch.empty(1, dtype=torch.int64, device=logits.device),  # (unused)
        batch.temperature, batch.top_k, batch.top_p, batch.min_p,
        sk, v,
        int(batch.any_top_k), int(batch.any_top_p), int(batch.any_min_p),
        SAMPLE=sample,
        BLOCK_P=t.BLOCK_P, NP=t.NP, BLOCK_S=t.BLOCK_S, C=t.C, MAX_PASSES=t.MAX_PASSES,
        num_warps=warps,
    )


def filter_and_sample(logits: torch.Tensor, batch: "SamplingBatch", q: torch.Tensor,
                      tuning: SamplingTuning | None = None) -> torch.Tensor:
    """Stages 3-5: ids [B] int64 (greedy rows: argmax). logits are left scaled, not masked.
    `tuning`: the device's launch configuration (None: DEFAULT_TUNING, the untuned one)."""
    if q.stride(1) != 1 or q.shape != logits.shape:
        raise ValueError("noise must be [B, V] with contiguous rows")
    ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _launch(logits, batch, q, ids, tuning)
    return ids


def filter_logits(logits: torch.Tensor, batch: "SamplingBatch", tuning: SamplingTuning | None = None) -> None:
    """Stage 4 in place: scaled logits with -inf on the filtered tokens (greedy rows: T = 1)."""
    _launch(logits, batch, None, None, tuning)


# --------------------------------------------------------------------------- slot state, code windows
# Per-step bookkeeping that torch spells as ~10-30 small ops (where, index_put_ with a sort for
# accumulate, gather, cat): one launch each here. At 400 rows the host cost of those ops was
# about a sixth of the step's host time.

_ROW_BLOCK = 256


# B (and the row counts below) change every step: not specialising on them (== 1, % 16) keeps one
# compiled variant, so no Triton compile (hundreds of ms) lands in a serving step.
@triton.jit(do_not_specialize=["B"])
def _record_kernel(slots_ptr, tok_ptr, idx_ptr, last_ptr, hist_ptr, stride_h, cnt_ptr, stride_c, B,
                   HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr):
    # runner.layers.slot_state.SlotState.record: padding rows (slot < 0) write nothing; real slots are
    # distinct within a call, so only the counts need atomics (and only for their bincount).
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < B
    slot = tl.load(slots_ptr + offs, mask=ok, other=-1)
    ok = ok & (slot >= 0)
    tok = tl.load(tok_ptr + offs, mask=ok, other=0)
    idx = tl.load(idx_ptr + offs, mask=ok, other=0)
    tl.store(last_ptr + slot, tok, mask=ok)
    tl.store(hist_ptr + slot * stride_h + idx, tok, mask=ok)
    if HAS_COUNTS:
        tl.atomic_add(cnt_ptr + slot * stride_c + tok, tl.full(tok.shape, 1, tl.int32), mask=ok)


def record_tokens(last_token: torch.Tensor, history: torch.Tensor, counts: torch.Tensor | None,
                  slots: torch.Tensor, tokens: torch.Tensor, out_index: torch.Tensor) -> None:
    """SlotState.record in one launch: last_token [S+1] int64, history [S+1, L] int64, counts
    [S+1, V] int32 or None; slots / tokens / out_index [B] int64 (slot -1 = padding)."""
    b = slots.shape[0]
    if b == 0:
        return
    assert history.stride(1) == 1 and (counts is None or counts.stride(1) == 1)
    _record_kernel[(triton.cdiv(b, _ROW_BLOCK),)](
        slots, tokens, out_index, last_token, history, history.stride(0),
        counts if counts is not None else last_token, counts.stride(0) if counts is not None else 0, b,
        HAS_COUNTS=counts is not None, BLOCK=_ROW_BLOCK, num_warps=4,
    )


@triton.jit
def _code_window_kernel(x_ptr, stride_x, ctr_ptr, out_ptr, stride_o, first_col, end_col, CB, GROUPS,
                        HAS_END: tl.constexpr, BLOCK: tl.constexpr):
    # out[r, j] = x[r, first_col + (ctr[r] % GROUPS) * CB + j] for j < CB; out[r, CB] = the end
    # column where ctr[r] % GROUPS == 0, else -inf (runner.families.orpheus.OrpheusCodeConstraint).
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    k = tl.load(ctr_ptr + r) % GROUPS
    x_row = x_ptr + r * stride_x
    inside = j < CB
    v = tl.load(x_row + first_col + k * CB + j, mask=inside, other=0.0)
    tl.store(out_ptr + r * stride_o + j, v, mask=inside)
    if tl.program_id(1) == 0:
        if HAS_END:
            e = tl.where(k == 0, tl.load(x_row + end_col), float("-inf"))
        else:
            e = tl.full([], float("-inf"), tl.float32)
        tl.store(out_ptr + r * stride_o + CB, e)


@triton.jit(do_not_specialize=["B"])
def _code_window_ids_kernel(col_ptr, ctr_ptr, out_ptr, offset, end_id, CB, GROUPS, B, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < B
    col = tl.load(col_ptr + offs, mask=ok, other=0)
    k = tl.load(ctr_ptr + offs, mask=ok, other=0) % GROUPS
    tl.store(out_ptr + offs, tl.where(col < CB, offset + k * CB + col, end_id), mask=ok)


def code_window(logits: torch.Tensor, counters: torch.Tensor, first_col: int, codebook: int, groups: int,
                end_col: int | None) -> torch.Tensor:
    """[R, codebook + 1] windows of logits [R, N] (contiguous rows): see _code_window_kernel;
    end_col None: the end column is -inf everywhere."""
    r = logits.shape[0]
    assert logits.stride(1) == 1 and counters.shape == (r,)
    out = torch.empty(r, codebook + 1, dtype=logits.dtype, device=logits.device)
    if r:
        _code_window_kernel[(r, triton.cdiv(codebook, 1024))](
            logits, logits.stride(0), counters, out, out.stride(0), first_col, end_col if end_col is not None else 0,
            codebook, groups, HAS_END=end_col is not None, BLOCK=1024, num_warps=4,
        )
    return out


def code_window_ids(cols: torch.Tensor, counters: torch.Tensor, offset: int, codebook: int, groups: int,
                    end_id: int) -> torch.Tensor:
    """Token ids [R] int64 of sampled window columns cols [R] (see code_window)."""
    r = cols.shape[0]
    out = torch.empty(r, dtype=torch.int64, device=cols.device)
    if r:
        _code_window_ids_kernel[(triton.cdiv(r, _ROW_BLOCK),)](cols, counters, out, offset, end_id, codebook, groups, r,
                                                               BLOCK=_ROW_BLOCK, num_warps=4)
    return out
