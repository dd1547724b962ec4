"""RoPE's arithmetic as Triton helpers, shared by the RoPE kernel (runner/triton_fused_ops.py) and
the decode attention kernel's fused RoPE (runner/triton_attention.py), so the two round alike."""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Under the interpreter there is no libdevice (and numpy never contracts); on the GPU the
# products of RoPE go through mul.rn, which ptxas never fuses into an FMA: with plain `*`, LLVM
# contracts x1*c - r(x2*s) into one fma.rn.bf16 and the result is no longer torch's r(r(x1*c) -
# r(x2*s)) (one ulp apart now and then, and differently in different kernels).
_EXACT_MUL = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _mul(a, b):
    if _EXACT_MUL:
        return tl.extra.cuda.libdevice.mul_rn(a, b)
    else:
        return a * b


@triton.jit
def rope_pair(x1, x2, c, s, ROUND: tl.constexpr):
    """Rotate-half RoPE of the two halves (x1, x2) of head vectors: (x1*c - x2*s, x2*c + x1*s) in
    the model dtype. The one definition of RoPE's roundings, shared by the RoPE kernel and the
    decode attention kernel's fused RoPE (runner/triton_attention.py), so the two agree bit for bit.

    torch computes q*cos + cat(-x2, x1)*sin with every product and the sum rounded to the model
    dtype (ROUND); (-a)*b rounds to -(a*b), and p + (-q) == p - q exactly. c, s: fp32, already
    rounded to the model dtype when ROUND.
    """
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if ROUND:
        o1 = _mul(f1, c).to(dt).to(tl.float32) - _mul(f2, s).to(dt).to(tl.float32)
        o2 = _mul(f2, c).to(dt).to(tl.float32) + _mul(f1, s).to(dt).to(tl.float32)
    else:
        o1 = _mul(f1, c) - _mul(f2, s)
        o2 = _mul(f2, c) + _mul(f1, s)
    return o1.to(dt), o2.to(dt)


@triton.jit
def rope_rows(
    rows,  # [R, 1] pointers to dim 0 of each head vector
    stride_d,
    offs_d,  # [D] = arange(0, D)
    mask,  # broadcastable to [R, D]
    c,  # [1, D] fp32 table row (cat(f, f)), rounded to the model dtype when ROUND
    s,
    HEAD_DIM: tl.constexpr,
    ROUND: tl.constexpr,
):
    """RoPE of whole head vectors [R, D] (model dtype), loaded here: rope_pair on the halves,
    with each half read a second time swapped instead of concatenating two half tiles."""
    half: tl.constexpr = HEAD_DIM // 2
    x = tl.load(rows + offs_d[None, :] * stride_d, mask=mask, other=0.0)
    xs = tl.load(rows + ((offs_d + half) % HEAD_DIM)[None, :] * stride_d, mask=mask, other=0.0)
    lo, _ = rope_pair(x, xs, c, s, ROUND)  # columns < D/2: x1*c - x2*s
    _, hi = rope_pair(xs, x, c, s, ROUND)  # columns >= D/2: x2*c + x1*s
    return tl.where(offs_d[None, :] < half, lo, hi)
