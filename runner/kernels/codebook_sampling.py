"""One launch per codebook: the codec range, stages 3-5 of the sampler and the race noise, fused
for a small vocabulary (a multi-codebook talker's codes: CSM's 2051, Qwen3-TTS's ~2050).

Why: the general path (runner/kernels/sampling.py, built for 156k-token rows) costs a codebook
a .float() cast, the codec range's masked_fill_, a counter add, the race-noise launch writing
[B, V] and the multi-pass filter kernel: ~8 launches, and a CSM frame draws 32 codebooks in a
row. Here one program per row holds the whole row in registers (V <= MAX_VOCAB) and does:

  load       x = float(logits) (bf16 / fp16 / fp32, any row stride); on rows flagged in
             `rows`, columns >= limit are -inf (models/csm_sampling.CodecRange);
  greedy     temperature 0: the first index of the maximum (torch.argmax), nothing else;
  scale      y = x / T (correctly rounded, as torch's division), e = exp(y - max y);
  top-k      keep key(y) > t_k with t_k the largest key such that count(key > t_k) >= k
             (so every token tied with the k-th value survives);
  top-p      over what top-k kept: keep key > t_p, the largest key with mass(key > t_p) >=
             p * Z (Z = the mass top-k kept): the smallest upper set reaching p, top token kept;
  min-p      e >= min_p;
  race       argmax over the kept tokens of e / q, q = -log(u) with u the bits of
             runner/layers/noise.race_noise for (seed, counter * K + codebook, column),
             computed in place of a [B, V] noise tensor.
A greedy row stops after its argmax; a row with a filter off skips its search (a uniform branch).

Keys are `_order_key` (an order-preserving int32 image of the float, -0.0 = +0.0), as in the
general kernel and the torch backend. A threshold search keeps (lo, hi] with stat(lo) >= bound
> stat(hi). A round evaluates the statistic at NP pivots (the general kernel's `_pivots`) in one pass over the row in registers
(the key midpoint, which bounds the search at 33 rounds whatever the values, and values evenly
spaced between value(lo) and value(hi), which adapt to where the logits are) and, in the same
pass, the smallest and largest key strictly inside the interval, to which it shrinks; it ends
when those two are equal (bf16 logits often tie at the threshold). 2051 random bf16 logits
take about 6 rounds at k = 50 and 4 at p = 0.8 with NP = 4. Masses are fp32 sums over a fixed
reduction tree per row, so a row never depends on the other rows of the batch; they differ
from the torch backend's only in summation order (a kept set can differ only where a
cumulative mass is within fp32 rounding of its bound).

Importing this module needs `triton` (tests run it under TRITON_INTERPRET=1 on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from runner.kernels.hashing import hash32, uniform24
from runner.kernels.sampling import _order_key, _pivots

MAX_VOCAB = 4096  # the row lives in registers: BLOCK (+ TAIL) lanes per program (row_split)
_NP = 4  # pivots per search round (a power of 2): more spill the [BLOCK, NP] tile out of registers

_KEY_NEG_INF = tl.constexpr(-0x7F800000)  # _order_key(-inf)


@triton.jit
def _span(lo_a, hi_a, z_a, lo_b, hi_b, z_b):
    return tl.minimum(lo_a, lo_b), tl.maximum(hi_a, hi_b), z_a + z_b


@triton.jit
def _search(key, e, tkey, te, lo, hi, bound, frac, MASS: tl.constexpr, NP: tl.constexpr, SPAN_REDUCE: tl.constexpr,
            HAS_TAIL: tl.constexpr):
    """The largest key lo' with stat(key > lo') >= bound: keep key > lo'.

    In: (lo, hi] with stat(lo) >= bound > stat(hi) (hi: the key of the row max, where stat is
    0); key / e [BLOCK] the row's keys and masses (padding lanes: key(-inf), never above lo),
    tkey / te [TAIL] the tail's (HAS_TAIL: added to every statistic after the block's).
    stat: count (MASS False) or sum of e. MASS: bound = frac * mass(key > lo).
    A round evaluates stat at NP pivots and, in the same pass, the smallest and largest key of
    the tokens in (lo, hi]: stat does not change between lo and that smallest key - 1, nor
    between that largest key and hi, so the interval shrinks to the tokens themselves, and the
    search ends when they all share one key (e.g. bf16 logits tied at the threshold).
    """
    k2 = key[:, None]
    tk2 = tkey[:, None]
    if MASS:
        w2 = e[:, None]
        tw2 = te[:, None]
    else:
        w2 = tl.full([1, 1], 1.0, tl.float32)  # counts in fp32: exact below 2^24
        tw2 = w2
    go = hi.to(tl.int64) - lo.to(tl.int64) > 1
    while go:
        piv = _pivots(lo, hi, NP)  # [NP]
        stat = tl.sum(tl.where(k2 > piv[None, :], w2, 0.0), axis=0)  # [NP]
        inside = (key > lo) & (key <= hi)
        if SPAN_REDUCE:
            kmin, kmax, z = tl.reduce((tl.where(inside, key, 0x7FFFFFFF), tl.where(inside, key, -0x7FFFFFFF),
                                       tl.where(inside, e, 0.0)), 0, _span)
        else:
            kmin = tl.min(tl.where(inside, key, 0x7FFFFFFF), axis=0)
            kmax = tl.max(tl.where(inside, key, -0x7FFFFFFF), axis=0)
            z = tl.sum(tl.where(inside, e, 0.0), axis=0)
        if HAS_TAIL:
            stat += tl.sum(tl.where(tk2 > piv[None, :], tw2, 0.0), axis=0)
            tin = (tkey > lo) & (tkey <= hi)
            kmin = tl.minimum(kmin, tl.min(tl.where(tin, tkey, 0x7FFFFFFF), axis=0))
            kmax = tl.maximum(kmax, tl.max(tl.where(tin, tkey, -0x7FFFFFFF), axis=0))
            z += tl.sum(tl.where(tin, te, 0.0), axis=0)
        if MASS:
            bound = tl.where(bound < 0, frac * z, bound)  # first round: z = mass(key > lo) (hi is the max)
        # Stats are monotone in the pivot (termwise >=, one reduction tree), so every pivot
        # with stat >= bound lies below every pivot with stat < bound.
        drop = stat >= bound
        new_hi = tl.min(tl.where(drop, hi, piv), axis=0)
        new_lo = tl.max(tl.where(drop, piv, lo), axis=0)
        some = kmin <= kmax  # (always: stat(lo) > stat(hi) puts a token inside)
        lo = tl.where(some, tl.maximum(new_lo, kmin - 1), new_lo)
        hi = tl.where(some, tl.minimum(new_hi, kmax), new_hi)
        go = hi.to(tl.int64) - lo.to(tl.int64) > 1
    return lo


@triton.jit
def _load_row(row_ptr, cols, V, flag_ptr, limit, HAS_RANGE: tl.constexpr):
    """float(logits) of `cols`: -inf past V, for NaN (broken weights: never drawn, ids stay in
    range) and, on a flagged row (HAS_RANGE), at columns >= limit."""
    x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))
    if HAS_RANGE:
        x = tl.where((tl.load(flag_ptr) != 0) & (cols >= limit), float("-inf"), x)
    return x


@triton.jit
def _div(x, t, r):
    """x / t correctly rounded (as torch's division) for finite x and normal quotients, from
    r = 1 / t: one Newton correction with FMAs. (div_rn's full-range path cost a program
    several microseconds.)"""
    q = x * r
    return tl.fma(tl.fma(-q, t, x), r, q)


@triton.jit(do_not_specialize=["stride_x", "limit", "num_codebooks", "codebook", "stride_o"],
            do_not_specialize_on_alignment=["x_ptr", "out_ptr"])
def _codebook_sample_kernel(
    x_ptr, stride_x,  # logits [B, V] bf16 / fp16 / fp32 (read only)
    rows_ptr, limit,  # [B] bool: rows whose codes stay below `limit` (HAS_RANGE)
    temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # [B] f32, i64, f32, f32
    seed_ptr, ctr_ptr, num_codebooks, codebook,  # [B] i64 noise seeds and frame counters
    out_ptr, stride_o,  # ids [B] int64 (any stride)
    V,
    HAS_RANGE: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr, HAS_TAIL: tl.constexpr, NP: tl.constexpr,
    SPAN_REDUCE: tl.constexpr, SALT0: tl.constexpr, SALT1: tl.constexpr, SALT2: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    tcols = BLOCK + tl.arange(0, TAIL)  # columns past the block (HAS_TAIL), each reduction's second part
    x = _load_row(x_ptr + row * stride_x, cols, V, rows_ptr + row, limit, HAS_RANGE)
    tx = _load_row(x_ptr + row * stride_x, tcols, V, rows_ptr + row, limit, HAS_RANGE)
    mx, ids = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)  # torch.argmax
    if HAS_TAIL:  # a tail column wins only above the block's max (ties: the first index)
        tmx, tids = tl.max(tx, axis=0, return_indices=True, return_indices_tie_break_left=True)
        ids = tl.where(tmx > mx, BLOCK + tids, ids)
        mx = tl.maximum(mx, tmx)
    t = tl.load(temp_ptr + row)
    if t != 0.0:
        r = tl.div_rn(1.0, t)
        m = _div(mx, t, r)  # = max y: correctly rounded division is monotone
        y = tl.where(x > float("-inf"), _div(x, t, r), float("-inf"))
        e = tl.exp(y - m)  # padding and -inf: 0
        key = _order_key(y)
        ty = tl.where(tx > float("-inf"), _div(tx, t, r), float("-inf"))
        te = tl.exp(ty - m)
        tkey = _order_key(ty)
        lo = tl.full([], _KEY_NEG_INF, tl.int32)  # every finite token lies above lo
        hi = _order_key(m)
        k = tl.load(topk_ptr + row)
        if (k > 0) & (k < V):
            # (k >= #finite tokens: no pivot reaches k, the search keeps every finite token)
            lo = _search(key, e, tkey, te, lo, hi, k.to(tl.float32), 0.0, False, NP, SPAN_REDUCE, HAS_TAIL)
        p = tl.load(topp_ptr + row)
        if p < 1.0:
            # Tokens more than 120 below the max have e == 0 in fp32: massless, they never
            # cross the bound; starting above them narrows the value range of the pivots.
            lo = tl.maximum(lo, _order_key(m - 120.0) - 1)
            lo = _search(key, e, tkey, te, lo, hi, tl.full([], -1.0, tl.float32), p, True, NP, SPAN_REDUCE, HAS_TAIL)
        minp = tl.load(minp_ptr + row)
        keep = (key > lo) & (e >= minp)
        # the race noise of runner/layers/noise.race_noise, column by column
        seed = tl.load(seed_ptr + row)
        ctr = tl.load(ctr_ptr + row) * num_codebooks + codebook
        s0 = tl.full([], SALT0, tl.int64).to(tl.uint32)
        s1 = tl.full([], SALT1, tl.int64).to(tl.uint32)
        s2 = tl.full([], SALT2, tl.int64).to(tl.uint32)
        hkey = hash32(hash32((seed & 0xFFFFFFFF).to(tl.uint32) ^ s0) ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        hkey = hash32(hkey ^ hash32((ctr & 0xFFFFFFFF).to(tl.uint32) ^ s1))
        hkey2 = hash32(hkey ^ s2)
        q = -tl.log(uniform24(hash32(hash32(cols.to(tl.uint32) ^ hkey) ^ hkey2)))  # > 0
        score = tl.where(keep, e / q, -1.0)  # the top token is always kept, with a score > 0
        best, ids = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        if HAS_TAIL:
            tq = -tl.log(uniform24(hash32(hash32(tcols.to(tl.uint32) ^ hkey) ^ hkey2)))
            tscore = tl.where((tkey > lo) & (te >= minp), te / tq, -1.0)
            tbest, tids = tl.max(tscore, axis=0, return_indices=True, return_indices_tie_break_left=True)
            ids = tl.where(tbest > best, BLOCK + tids, ids)
    tl.store(out_ptr + row * stride_o, tl.where(ids < V, ids, 0).to(tl.int64))


# Triton's interpreter runs a tl.reduce combine function in Python, element by element (about a
# second per search round on CPU): there the span is three built-in reductions, the same values
# up to the summation order of z. Compiled kernels reduce the three in one pass.
_SPAN_REDUCE = type(_codebook_sample_kernel).__name__ != "InterpretedFunction"


MAX_TAIL = 16  # columns past a power of two held as a second small tensor (CSM's 2051 = 2048 + 3)


def row_split(v: int) -> tuple[int, int]:
    """(BLOCK, TAIL) lanes for a row of v columns: the power of two below v plus a tail of up to
    MAX_TAIL columns (TAIL 0: none) where that covers it, else the power of two above. Why: a
    whole power of two above 2051 is 4096 lanes, twice the registers and the work; at 4096 lanes
    and 16 warps one program took an SM's whole register file (127 a thread), so 512 rows ran
    in four waves."""
    block = triton.next_power_of_2(v)
    if block // 2 >= 4 * MAX_TAIL and v <= block // 2 + MAX_TAIL:  # (v > block / 2 always)
        return block // 2, triton.next_power_of_2(v - block // 2)
    return block, 0


def num_warps(block: int) -> int:
    """Warps of a program holding `block` lanes: 8 to 16 values per thread keeps a search
    round's [BLOCK, NP] tile in registers (no spills: the offline compile test checks)."""
    return max(4, min(16, block // 256))


def max_registers(warps: int) -> int | None:
    """The launch's register cap (maxnreg): at 8 warps, 128 a thread, so that two programs fit
    an SM's 64K registers (unbounded, ptxas took 156 and an SM ran one program: rows wait in
    waves at large batch); no spills (the offline compile test checks). None: no cap."""
    return 128 if warps == 8 else None


def codebook_sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, seeds: Tensor,
                    counters: Tensor, num_codebooks: int, codebook: int, salts: tuple[int, int, int],
                    rows: Tensor | None = None, limit: int = 0, out: Tensor | None = None,
                    np_pivots: int = _NP, warps: int | None = None, span_reduce: bool | None = None) -> Tensor:
    """ids [B] int64 of codebook `codebook` from logits [B, V] (V <= MAX_VOCAB, unit column
    stride); the sampling rows' parameters and race keys are [B] device tensors (SamplingBatch's
    fields; the race counter is counters * num_codebooks + codebook); `salts`:
    runner.layers.noise.NOISE_SALTS. rows [B] bool / limit: the codec range (None: off).
    out: a [B] int64 view to write (e.g. a column of the frames), else a new tensor. No host
    sync, no allocation besides the output. np_pivots / warps / span_reduce override the launch
    configuration (tests and sweeps)."""
    b, v = logits.shape
    if v > MAX_VOCAB or logits.stride(1) != 1:
        raise ValueError(f"logits {tuple(logits.shape)} with column stride {logits.stride(1)}: "
                         f"need V <= {MAX_VOCAB} and unit column stride")
    block, tail = row_split(v)
    w = warps or num_warps(block)
    if out is None:
        out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b:
        _codebook_sample_kernel[(b,)](
            logits, logits.stride(0), rows if rows is not None else temperature, limit,
            temperature, top_k, top_p, min_p, seeds, counters, num_codebooks, codebook,
            out, out.stride(0), v,
            HAS_RANGE=rows is not None, BLOCK=block, TAIL=max(tail, 1), HAS_TAIL=tail > 0, NP=np_pivots,
            SPAN_REDUCE=_SPAN_REDUCE if span_reduce is None else span_reduce,
            SALT0=salts[0], SALT1=salts[1], SALT2=salts[2], num_warps=w, maxnreg=max_registers(w),
        )
    return out

