"""Fused Triton kernels for the decoder's elementwise ops (launched by runner/layers/triton_ops.py).

Why: at decode batch sizes the torch path launches ~36 tiny elementwise kernels per layer
(RMSNorm alone is float/pow/mean/add/rsqrt/mul/cast/mul, twice; RoPE ~14; SiLU*mul 2; KV write 2;
residual adds 2) next to 4 GEMMs and the attention kernel; even inside a CUDA graph each costs a
few microseconds, ~1000 per step on a 28-layer model. Here a layer is add+norm, RoPE (+ KV
write), add+norm, SiLU*mul: 4 launches (Qwen3 q/k norms: 2 more).

Numerics replicate the torch path's roundings, not just its maths: every place where torch
materialises a tensor in the model dtype, the kernel rounds to that dtype too (fp32 math in
between). A product of two bf16/fp16 values is exact in fp32, so those steps match torch bit for
bit; what can differ is the fp32 sum-of-squares order in RMSNorm and the exp/rsqrt
implementations, i.e. occasionally one unit in the last place of the model dtype (and for fp32
models, a few fp32 ulps). RoPE's products are kept out of FMA contraction
(runner/kernels/rope.py).

All launches read only tensor metadata on the host (shapes, strides, dtypes), never values, so
they can be captured in a CUDA graph once compiled (one eager call per shape/dtype beforehand).

Importing this module needs `triton`; callers import it only on CUDA (the tests run it under
TRITON_INTERPRET=1 on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.kernels.linear import Partials, silu_mul
from runner.kernels.pdl import pdl_enter
from runner.kernels.rope import rope_pair

# SiLU*mul: columns per program. 1024 bf16 = 2 KiB per operand: at T=1 and I=8192 that still
# spreads over 8 programs; at large T the grid is big anyway.
_SILU_BLOCK = 1024


def _norm_warps(block: int) -> int:
    # ~512 elements per warp keeps a row in registers (16 per thread) without idle warps.
    return max(1, min(8, block // 512))


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # rows of N, row r at (r // rows_inner) * stride_xo + (r % rows_inner) * stride_xi
    res_ptr,  # same layout via stride_ro / stride_ri; read only when HAS_RESIDUAL
    w_ptr,  # [N]
    out_ptr,  # [R, N] contiguous
    res_out_ptr,  # [R, N] contiguous, x + residual in x's dtype; written only when HAS_RESIDUAL
    rows_inner,  # 1 for [T, N]; H for per-head norms over [T, H, D]
    stride_xo,
    stride_xi,
    stride_ro,
    stride_ri,
    n_cols,
    eps,
    stride_part,  # NUM_PARTS: distance between the fp32 partials of x
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,  # next power of two >= n_cols: one row lives in registers
    USE_GDC: tl.constexpr,  # launched with PDL (runner/kernels/pdl.py)
    NUM_PARTS: tl.constexpr = 0,  # > 0: x is a split-K GEMM's fp32 partials (runner/triton_linear.Partials)
):
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    # The norm weight is never written by a kernel (runner/kernels/pdl.py), so it is loaded before
    # the wait, where its latency hides; after the row's reduction (two CTA barriers) it was one
    # more dependent round trip on every norm's critical path.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    pdl_enter(USE_GDC)
    r = tl.program_id(0).to(tl.int64)  # int64: prefill offsets can pass 2^31 on big batches
    ro = r // rows_inner
    ri = r % rows_inner
    if NUM_PARTS > 0:
        # the GEMM's output: its partials summed in split order in fp32, rounded once to the
        # model dtype (triton_linear.materialize computes the same)
        dt = res_ptr.dtype.element_ty
        row = x_ptr + ro * stride_xo + ri * stride_xi + cols
        xs = tl.load(row, mask=mask, other=0.0)
        for p in tl.static_range(1, NUM_PARTS):
            xs += tl.load(row + p * stride_part, mask=mask, other=0.0)
        x = xs.to(dt)
    else:
        dt = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + ro * stride_xo + ri * stride_xi + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + ro * stride_ro + ri * stride_ri + cols, mask=mask, other=0.0)
        # Sum in fp32, rounded to the model dtype: exactly torch's `x + residual`, and the value
        # that is normalised below.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + r * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols  # masked columns are 0
    normed = (xf * tl.math.rsqrt(var + eps)).to(dt)  # torch: .to(dtype)
    out = w.to(tl.float32) * normed.to(tl.float32)  # exact for 16-bit inputs, rounded once below
    tl.store(out_ptr + r * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


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


@triton.jit
def _rotate_heads(
    base,  # pointer to head 0, dim 0 of this token
    stride_h,
    offs_h,  # [HP]
    offs_d,  # [HALF_P]
    mask,  # [HP, HALF_P]
    c,  # [1, HALF_P] fp32 (already rounded to the model dtype)
    s,
    HALF: tl.constexpr,
    ROUND: tl.constexpr,  # 16-bit model dtype: round where torch materialises a tensor
):
    """Rotate-half RoPE of one token's heads in place; returns the rotated halves (model dtype)."""
    p1 = base + offs_h[:, None] * stride_h + offs_d[None, :]
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    o1, o2 = rope_pair(x1, x2, c, s, ROUND)
    tl.store(p1, o1, mask=mask)
    tl.store(p2, o2, mask=mask)
    return o1, o2


@triton.jit
def _rope_kernel(
    q_ptr,  # [T, Hq, D], last dim contiguous (a view into the fused qkv output is fine)
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]              read only when WRITE_KV
    cos_ptr,  # [P, D] fp32; only columns [0, D/2) are read (the table is cat(f, f))
    sin_ptr,
    pos_ptr,  # [T] int
    kv_ptr,  # [2, NB*BS, Hkv, D]      written only when WRITE_KV
    slot_ptr,  # [T] int64 flat slots  read only when WRITE_KV
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_kv,  # K -> V distance in the cache (may exceed int32; triton then types it int64)
    stride_slot,
    stride_kvh,
    max_pos,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HQ_P: tl.constexpr,  # head counts padded to powers of two
    HKV_P: tl.constexpr,
    HALF: tl.constexpr,  # D // 2
    HALF_P: tl.constexpr,
    ROUND: tl.constexpr,
    WRITE_KV: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)
    t = tl.program_id(0).to(tl.int64)  # one program per token: all its q and k heads
    # Clamp: a stale position in a padded graph row must not read past the table.
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + t).to(tl.int64), 0), max_pos - 1)
    offs_d = tl.arange(0, HALF_P)
    d_mask = offs_d < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]  # [1, HALF_P]
    s = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=d_mask, other=0.0)[None, :]
    if ROUND:
        # torch casts the fp32 table rows to the model dtype before use.
        c = c.to(q_ptr.dtype.element_ty).to(tl.float32)
        s = s.to(q_ptr.dtype.element_ty).to(tl.float32)

    offs_hq = tl.arange(0, HQ_P)
    q_mask = (offs_hq[:, None] < HQ) & d_mask[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, offs_hq, offs_d, q_mask, c, s, HALF, ROUND)

    offs_hk = tl.arange(0, HKV_P)
    k_mask = (offs_hk[:, None] < HKV) & d_mask[None, :]
    k1, k2 = _rotate_heads(k_ptr + t * stride_kt, stride_kh, offs_hk, offs_d, k_mask, c, s, HALF, ROUND)

    if WRITE_KV:
        # The cache write of runner.layers.attention.write_kv, from registers: rotated k, then v.
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dst = kv_ptr + slot * stride_slot + offs_hk[:, None] * stride_kvh + offs_d[None, :]
        ety = kv_ptr.dtype.element_ty
        tl.store(dst, k1.to(ety), mask=k_mask)
        tl.store(dst + HALF, k2.to(ety), mask=k_mask)
        vp = v_ptr + t * stride_vt + offs_hk[:, None] * stride_vh + offs_d[None, :]
        v1 = tl.load(vp, mask=k_mask, other=0.0)
        v2 = tl.load(vp + HALF, mask=k_mask, other=0.0)
        tl.store(dst + stride_kv, v1.to(ety), mask=k_mask)
        tl.store(dst + stride_kv + HALF, v2.to(ety), mask=k_mask)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I], last dim contiguous: gate | up
    out_ptr,  # [T, I] contiguous
    stride_xt,
    inter,  # I
    BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + t * stride_xt
    g = tl.load(row + cols, mask=mask, other=0.0)
    u = tl.load(row + inter + cols, mask=mask, other=0.0)
    # torch: F.silu rounds to the model dtype, then the product rounds again.
    tl.store(out_ptr + t * inter + cols, silu_mul(g, u).to(out_ptr.dtype.element_ty), mask=mask)


def _rows_layout(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, rows_inner, stride_outer, stride_inner) addressing the rows of x [T, N] or [T, H, N]."""
    assert x.stride(-1) == 1, f"last dim must be contiguous, strides {x.stride()}"
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    assert x.dim() == 3, x.shape
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


def rmsnorm(x: torch.Tensor | Partials, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            pdl: bool = False):
    """RMSNorm over the last dim of x [T, N] or [T, H, N] (strided rows allowed), one launch.

    With `residual` (same shape as x), returns (normed, x + residual) with the sum in x.dtype;
    otherwise just normed. Outputs are fresh contiguous tensors. x may be a split-K GEMM's
    `Partials` (with a residual): summed here, like `materialize` would.
    """
    parts = None
    if isinstance(x, Partials):
        assert residual is not None and x.parts.is_contiguous() and x.parts.dtype == torch.float32
        parts, x = x, x.parts[0]  # rows of partial 0; the others at + p * stride_part
        dtype = parts.dtype
    else:
        dtype = x.dtype
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous(), (weight.shape, n)
    rows, inner, sxo, sxi = _rows_layout(x)
    out = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(dtype, weight.dtype))
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == dtype, (residual.shape, residual.dtype)
        _, _, sro, sri = _rows_layout(residual)
        res_out = torch.empty(x.shape, device=x.device, dtype=dtype)
    else:
        res_out, sro, sri = out, 0, 0  # never touched (HAS_RESIDUAL False)
    if rows:
        block = triton.next_power_of_2(n)
        _rmsnorm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, res_out,
            inner, sxo, sxi, sro, sri, n, eps, parts.parts.stride(0) if parts else 0,
            HAS_RESIDUAL=residual is not None, BLOCK_N=block, num_warps=_norm_warps(block),
            USE_GDC=pdl, NUM_PARTS=parts.parts.shape[0] if parts else 0, launch_pdl=pdl,
        )  # fmt: skip
    return out if residual is None else (out, res_out)


def rope_(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [P, D] fp32, cat(f, f) layout
    sin: torch.Tensor,
    positions: torch.Tensor,  # [T]
    v: torch.Tensor | None = None,  # [T, Hkv, D], with kv_cache / slot_mapping: write the cache
    kv_cache: torch.Tensor | None = None,  # [2, NB, BS, Hkv, D]
    slot_mapping: torch.Tensor | None = None,  # [T] int64
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place (one launch); optionally also write rotated k and v to the cache."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    assert k.shape == (t, hkv, d) and d % 2 == 0, (q.shape, k.shape)
    assert q.dtype == k.dtype and q.stride(2) == 1 and k.stride(2) == 1, (q.stride(), k.stride())
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape and cos.shape[1] == d
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and positions.shape == (t,)
    write = kv_cache is not None
    if write:
        assert v is not None and slot_mapping is not None
        assert v.shape == k.shape and v.stride(2) == 1 and slot_mapping.shape == (t,)
        _, nb, bs, hkv_c, d_c = kv_cache.shape
        assert (hkv_c, d_c) == (hkv, d), (kv_cache.shape, k.shape)
        flat = kv_cache.view(2, nb * bs, hkv, d)  # needs contiguous blocks, like write_kv
        assert flat.stride(3) == 1
        kv_strides = (flat.stride(0), flat.stride(1), flat.stride(2))
        v_strides = (v.stride(0), v.stride(1))
    else:
        flat, v, slot_mapping = q, q, positions  # never touched (WRITE_KV False)
        kv_strides, v_strides = (0, 0, 0), (0, 0)
    if t:
        half = d // 2
        _rope_kernel[(t,)](
            q, k, v, cos, sin, positions, flat, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), *v_strides,
            cos.stride(0), sin.stride(0), *kv_strides, cos.shape[0],
            HQ=hq, HKV=hkv, HQ_P=triton.next_power_of_2(hq), HKV_P=triton.next_power_of_2(hkv),
            HALF=half, HALF_P=triton.next_power_of_2(half),
            ROUND=q.dtype != torch.float32, WRITE_KV=write, num_warps=4, USE_GDC=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return q, k


def silu_and_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """[T, 2I] (gate | up) -> [T, I] = silu(gate) * up, one launch."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1, gate_up.shape
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(t, inter, device=gate_up.device, dtype=gate_up.dtype)
    if t and inter:
        grid = (t, triton.cdiv(inter, _SILU_BLOCK))
        _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), inter, BLOCK=_SILU_BLOCK, num_warps=4,
                                   USE_GDC=pdl, launch_pdl=pdl)
    return out
