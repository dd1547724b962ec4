"""RoPE's roundings in Triton: `rope_pair`, the one definition shared by every kernel that
rotates q / k (runner/kernels/fused_ops.py's RoPE kernel, the decode attention kernel's fused RoPE
in runner/kernels/attention.py, the qkv GEMM's epilogue in runner/kernels/qkv_rope.py), so they
agree bit for bit.

Importing this module needs `triton` (CUDA, or the interpreter in tests).
"""

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
    the model dtype, with torch's roundings (module docstring).

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
