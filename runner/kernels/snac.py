"""Fused Triton kernels for the SNAC decoder: the CUDA fast path of runner/codecs/decoder.py.

Why: the torch path runs every decoder layer as separate kernels over (B, C, T) tensors.
Per decoded 24 kHz frame that is ~150 MB of HBM traffic, mostly the Snake activation
(x + 1/(alpha + 1e-9) * sin(alpha x)^2 is 5 elementwise kernels, ~11 passes over the tensor,
run 7 times per DecoderBlock), the positional-noise hash (int64 ops) and the depthwise convs;
the matmul work (~0.8 GFLOP per frame) is small next to it. Here each decoder layer is one
kernel and every elementwise op is fused into a matmul's prologue or epilogue (about 22 MB per
frame, see runner.codecs.cost.codec_flops_and_bytes).

Layout: activations are channels-last rows, (B * T, C) contiguous (row = b * T + t), so a
pointwise conv is one (rows, C_in) @ (C_in, C_out) matmul and every tile load is contiguous
along channels. Kernels per DecoderBlock (alpha_* are the Snake parameters of the layer that
consumes the value; "u" always means Snake(x) of the value, materialised once by its producer):

* `_convt_kernel`: ConvTranspose1d(kernel 2s, stride s) as a matmul over rows m in [0, T_in]:
  out[m * s + r - pad] = [u[m], u[m - 1]] @ W2 with W2[(j, c), (r, o)] = W[c, o, r + j s].
  Two taps per output, so no overlap-add; the output row/col -> (t, o) mapping is a strided
  store. Epilogue: + bias.
* `_rows_gemm_kernel` with the NoiseBlock epilogue: x1 = y + noise(b, t) * (y @ Wn^T); stores
  x1 and u1 = Snake(x1) for the first ResidualUnit. The noise is the positional hash of
  runner.codecs.noise.positional_noise computed per row in registers (uint32 arithmetic, the same
  bits as the int64 torch emulation).
* `_rows_gemm_kernel` with the depthwise prologue, once per ResidualUnit: the A tile is
  Snake2(dwconv7_dil(u) + b_dw) computed in registers from 7 shifted loads of u (cache hits),
  then the pointwise matmul, then the epilogue x' = x + (acc + b_pw); it stores x' (unless no
  later unit needs it) and u' = Snake_next(x').
* After the last block, `_final_kernel`: conv(C -> 1, k=7) over u, + bias, tanh.

Precision: fp32 activations, fp32 accumulation, and `tl.dot` input precision chosen once by the
caller. Measured by emulating the splits on CPU on a random 24 kHz SNAC (2 x 12 frames), int16
LSB distance from the fp32 torch path: "tf32x3" (three TF32 tensor-core products, the default)
max 1 LSB, 0.7% of samples off by one; "bf16x3" (three bf16 products at twice the TF32 rate,
so ~half the matmul time; needs Triton >= 3.5) max 1 LSB, 6.5% off by one; "tf32" (one
product) max 26 LSB, mean 4; "ieee" (FMA, slow) exact fp32. A bf16 model (bf16 weights and
activations, as SNAC's own bf16 path) is ~400 LSB away, so bf16 is not the default.

Per-row results do not depend on the batch: tile shapes depend on the layer only and no
reduction is split across programs, so a window is expected to decode to the same bits alone or
in any batch (the tests allow 1e-6).

Importing this module needs `triton` (the CPU torch wheel does not bring it); tests run the
kernels under TRITON_INTERPRET=1 on CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runner.kernels.hashing import hash32, uniform24
from runner.kernels.tuning import Tables, load_tables, read_table
from runner.kernels.tuning.tiles import MATMUL_PRECISIONS as PRECISIONS
from runner.kernels.tuning.tiles import SAFE_SNAC_TILES, SnacTiles

# ---------------------------------------------------------------- jit helpers


@triton.jit
def _snake(x, alpha, inv_alpha, FAST_SIN: tl.constexpr):
    # SNAC's snake(): x + (alpha + 1e-9).reciprocal() * sin(alpha * x) ** 2; inv_alpha is
    # precomputed on the host with exactly that expression. FAST_SIN (CUDA, bf16 models): the
    # SFU's sin.approx (abs error ~1e-6 near 0, ~1e-5 at |x| ~ 100, against bf16's relative
    # 4e-3) instead of libdevice's range-reduced sinf, ~20 ALU instructions per call.
    if FAST_SIN:
        s = tl.inline_asm_elementwise("sin.approx.ftz.f32 $0, $1;", "=f,f", [alpha * x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        s = tl.sin(alpha * x)
    return x + inv_alpha * (s * s)


@triton.jit
def _store_snake(out_ptr, offs, val, alpha_ptr, inv_ptr, cols, col_ok, mask, FAST_SIN: tl.constexpr):
    # Epilogue shared by the matmul kernels: store Snake(val) with the per-channel parameters
    # of the layer that consumes it (cols: the tile's output channels).
    al = tl.load(alpha_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    iv = tl.load(inv_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _snake(val, al[None, :], iv[None, :], FAST_SIN).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _positional_noise(seed, pos, salt_a, salt_b):
    # runner.codecs.noise.positional_noise for one (seed, absolute position) per element: seed and pos
    # int64 (taken mod 2^32 like the torch version's `& 0xFFFFFFFF`), salts uint32.
    base = hash32(pos.to(tl.uint32) ^ hash32(seed.to(tl.uint32)))
    h1 = hash32(base ^ salt_a)
    h2 = hash32(base ^ salt_b)
    u1, u2 = uniform24(h1), uniform24(h2)
    return tl.sqrt_rn(-2.0 * tl.log(u1)) * tl.cos(6.283185307179586 * u2)


@triton.jit
def _tanh(x):
    # tanh via one exp of a non-positive argument (no overflow); abs error ~1e-7, far below
    # the int16 LSB (3e-5) of the decoder's output.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


# ---------------------------------------------------------------- kernels


# M and T change with every batch / window length: not specialising on them (divisibility by
# 16, == 1) keeps one compiled variant per layer type instead of one per window shape.
@triton.jit(do_not_specialize=["M", "T"])
def _rows_gemm_kernel(
    a_ptr,  # (M, K) A source rows (u, y or the latent), row = b * T + t
    dw_w_ptr,  # (K, 7) depthwise taps (DW only)
    dw_b_ptr,  # (K,) depthwise bias (DW only)
    a_alpha_ptr,  # (K,) Snake alpha applied after the depthwise conv (SNAKE_A only)
    a_inv_ptr,  # (K,) its 1 / (alpha + 1e-9)
    w_ptr,  # (K, N) pointwise weight, transposed (N contiguous)
    bias_ptr,  # (N,) (HAS_BIAS only)
    res_ptr,  # (M, N) residual added in the epilogue (HAS_RES only; may alias x_ptr)
    x_ptr,  # (M, N) output x (STORE_X only)
    u_ptr,  # (M, N) output Snake_next(x) (STORE_U only)
    u_alpha_ptr,  # (N,)
    u_inv_ptr,  # (N,)
    seed_ptr,  # (B,) int64 noise seeds (NOISE only)
    start_ptr,  # (B,) int64 first codec frame of each window (NOISE only)
    salt_ptr,  # (2,) int64 the block's two noise salts (NOISE only)
    rate,  # samples per codec frame at this block: row t of window b is sample start * rate + t
    M,
    T,
    K,
    N,
    DW: tl.constexpr,
    DIL: tl.constexpr,
    SNAKE_A: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    NOISE: tl.constexpr,
    STORE_X: tl.constexpr,
    STORE_U: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
    FAST_SIN: tl.constexpr,
):
    # 1-D grid, N tiles fastest: the programs sharing an A tile run together (L2 reuse of the
    # prologue's loads), and the row-tile count may exceed a grid axis' 65535 limit.
    nt = tl.cdiv(N, BN)
    pid_m = tl.program_id(0) // nt
    pid_n = tl.program_id(0) % nt
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < M
    t = rows % T
    rows64 = rows.to(tl.int64)
    ns = pid_n * BN + tl.arange(0, BN)
    n_ok = ns < N

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        if DW:
            # Depthwise conv, kernel 7, dilation DIL, zero padding at the window edges (the
            # conv input is zero outside [0, T) whatever the row's neighbours in memory are).
            a = tl.zeros((BM, BK), dtype=tl.float32) + tl.load(dw_b_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            for j in tl.static_range(7):
                ts = t + (j - 3) * DIL
                ok = row_ok & (ts >= 0) & (ts < T)
                v = tl.load(
                    a_ptr + (rows64 + (j - 3) * DIL)[:, None] * K + ks[None, :],
                    mask=ok[:, None] & k_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                wj = tl.load(dw_w_ptr + ks * 7 + j, mask=k_ok, other=0.0).to(tl.float32)
                a += v * wj[None, :]
            if SNAKE_A:
                al = tl.load(a_alpha_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                iv = tl.load(a_inv_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                a = _snake(a, al[None, :], iv[None, :], FAST_SIN)
        else:
            a = tl.load(a_ptr + rows64[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + ks[:, None] * N + ns[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a.to(w.dtype), w, acc, input_precision=PRECISION)

    val = acc
    if NOISE:
        # NoiseBlock: x + noise * linear(x); noise depends on (seed, block, absolute position).
        b = rows // T
        seed = tl.load(seed_ptr + b, mask=row_ok, other=0)
        pos = tl.load(start_ptr + b, mask=row_ok, other=0) * rate + t
        salt_a = tl.load(salt_ptr).to(tl.uint32)
        salt_b = tl.load(salt_ptr + 1).to(tl.uint32)
        val = _positional_noise(seed, pos, salt_a, salt_b)[:, None] * val
    if HAS_BIAS:
        val = val + tl.load(bias_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    offs = rows64[:, None] * N + ns[None, :]
    omask = row_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        val = tl.load(res_ptr + offs, mask=omask, other=0.0).to(tl.float32) + val
    if STORE_X:
        tl.store(x_ptr + offs, val.to(x_ptr.dtype.element_ty), mask=omask)
    if STORE_U:
        _store_snake(u_ptr, offs, val, u_alpha_ptr, u_inv_ptr, ns, n_ok, omask, FAST_SIN)


@triton.jit(do_not_specialize=["M", "T_in"])
def _convt_kernel(
    u_ptr,  # (B * T_in, C_in) Snake'd block input
    w_ptr,  # (2 * C_in, STRIDE * C_out): W2[(j, c), (r, o)] = W[c, o, r + j * STRIDE]
    bias_ptr,  # (C_out,)
    y_ptr,  # (B * T_in * STRIDE, C_out) output
    yu_ptr,  # (B * T_in * STRIDE, C_out) Snake(y) (STORE_U only: blocks without noise)
    u_alpha_ptr,
    u_inv_ptr,
    M,  # B * (T_in + 1): one row per (b, m), m in [0, T_in]
    T_in,
    C_in,
    C_out,
    STRIDE: tl.constexpr,
    PAD: tl.constexpr,
    STORE_U: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
    FAST_SIN: tl.constexpr,
):
    N = STRIDE * C_out
    nt = tl.cdiv(N, BN)
    pid_m = tl.program_id(0) // nt
    pid_n = tl.program_id(0) % nt
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < M
    b = rows // (T_in + 1)
    m = rows % (T_in + 1)
    ns = pid_n * BN + tl.arange(0, BN)
    n_ok = ns < N

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for j in tl.static_range(2):
        src = m - j
        ok = row_ok & (src >= 0) & (src < T_in)
        src_row = (b * T_in + src).to(tl.int64)
        for c0 in range(0, C_in, BK):
            cs = c0 + tl.arange(0, BK)
            c_ok = cs < C_in
            a = tl.load(u_ptr + src_row[:, None] * C_in + cs[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
            w = tl.load(w_ptr + (j * C_in + cs)[:, None] * N + ns[None, :], mask=c_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a.to(w.dtype), w, acc, input_precision=PRECISION)

    # Column n = (r, o) of row (b, m) is output time m * STRIDE + r - PAD, channel o; rows past
    # either end of the window (the first PAD and last STRIDE - PAD) are dropped.
    r = ns // C_out
    o = ns % C_out
    tt = m[:, None] * STRIDE + r[None, :] - PAD
    T_out = T_in * STRIDE
    omask = row_ok[:, None] & n_ok[None, :] & (tt >= 0) & (tt < T_out)
    val = acc + tl.load(bias_ptr + o, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    offs = (b.to(tl.int64)[:, None] * T_out + tt) * C_out + o[None, :]
    tl.store(y_ptr + offs, val.to(y_ptr.dtype.element_ty), mask=omask)
    if STORE_U:
        _store_snake(yu_ptr, offs, val, u_alpha_ptr, u_inv_ptr, o, n_ok, omask, FAST_SIN)


@triton.jit(do_not_specialize=["M", "T"])
def _final_kernel(
    u_ptr,  # (M, C) Snake'd last block output
    w_ptr,  # (C, 7) conv weight (one output channel)
    bias_ptr,  # (1,)
    out_ptr,  # (M,) float32 audio
    M,
    T,
    C,
    BM: tl.constexpr,
    BC: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    t = rows % T
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BM, BC), dtype=tl.float32)
    for c0 in range(0, C, BC):
        cs = c0 + tl.arange(0, BC)
        c_ok = cs < C
        for j in tl.static_range(7):
            ts = t + (j - 3)
            ok = row_ok & (ts >= 0) & (ts < T)
            v = tl.load(u_ptr + (rows64 + (j - 3))[:, None] * C + cs[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
            wj = tl.load(w_ptr + cs * 7 + j, mask=c_ok, other=0.0).to(tl.float32)
            acc += v.to(tl.float32) * wj[None, :]
    y = tl.sum(acc, axis=1) + tl.load(bias_ptr).to(tl.float32)
    tl.store(out_ptr + rows, _tanh(y), mask=row_ok)


@triton.jit
def _noise_kernel(seed_ptr, start_ptr, salt_ptr, out_ptr, M, T, BM: tl.constexpr):
    # positional_noise alone (tests; the decoder computes it inside _rows_gemm_kernel).
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    ok = rows < M
    b = rows // T
    seed = tl.load(seed_ptr + b, mask=ok, other=0)
    pos = tl.load(start_ptr + b, mask=ok, other=0) + rows % T
    salt_a = tl.load(salt_ptr).to(tl.uint32)
    salt_b = tl.load(salt_ptr + 1).to(tl.uint32)
    tl.store(out_ptr + rows, _positional_noise(seed, pos, salt_a, salt_b), mask=ok)


# ---------------------------------------------------------------- launchers


# The tile type lives with the tuning tables (runner/kernels/tuning); the CUDA tiles per model
# dtype come from the device's table (`SnacTuning`), chosen once when the decoder is built.
Tiles = SnacTiles
# Always valid on CUDA (the untuned choice): 32 KiB of pipeline buffers, no inline PTX.
SAFE_TILES = SAFE_SNAC_TILES
# The reference device's tiles (runner/kernels/tuning/nvidia_h200.json "snac"): fp32, and bf16
# models (the CUDA serving default: wider N tiles, 3 stages, the SFU sine).
_REFERENCE = read_table("nvidia_h200").snac
CUDA_TILES, CUDA_TILES_BF16 = _REFERENCE.float32, _REFERENCE.bfloat16
# Under the interpreter a program costs ~ms whatever its size: few, tall tiles.
INTERPRETER_TILES = Tiles(bm=4096, bn=64, bk=32, num_warps=4, num_stages=1)
_INTERPRETER_PRECISIONS = ("tf32", "tf32x3", "ieee")  # it runs every fp32 dot as numpy fp32


def cuda_precisions() -> tuple[str, ...]:
    """tl.dot input precisions the installed Triton compiles for NVIDIA GPUs ("bf16x3" is
    recent: Triton 3.5+)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        return tuple(CUDAOptions.allowed_dot_input_precisions)
    except (ImportError, AttributeError):
        return _INTERPRETER_PRECISIONS


def _fit(block: int, n: int) -> int:
    return max(16, min(block, triton.next_power_of_2(n)))


def rows_gemm(
    a: torch.Tensor,
    w_t: torch.Tensor,
    T: int,
    tiles: Tiles,
    precision: str,
    *,
    dw: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    snake_a: tuple[torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
    res: torch.Tensor | None = None,
    noise: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
    x_out: torch.Tensor | None = None,
    u_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """out = epilogue(prologue(a) @ w_t); see _rows_gemm_kernel. Writes x_out / u_out in place.

    a: (M, K) rows (M = B * T); w_t: (K, N); dw = (taps (K, 7), bias (K,), dilation);
    snake_a = (alpha, inv_alpha) (K,) after the depthwise conv; noise = (seeds (B,), window
    start frames (B,), salts (2,) int64, samples per frame); u_out = (buffer (M, N), alpha (N,),
    inv_alpha (N,)).
    """
    M, K = a.shape
    N = w_t.shape[1]
    assert w_t.shape[0] == K and M % T == 0 and a.is_contiguous() and w_t.is_contiguous()
    assert snake_a is None or dw is not None
    bn, bk = _fit(tiles.bn, N), _fit(tiles.bk, K)
    dummy = w_t  # stands in for pointers a flag switches off (never dereferenced)
    dw_w, dw_b, dil = dw if dw is not None else (dummy, dummy, 1)
    a_alpha, a_inv = snake_a if snake_a is not None else (dummy, dummy)
    seeds, starts, salts, rate = noise if noise is not None else (dummy, dummy, dummy, 1)
    u_buf, u_alpha, u_inv = u_out if u_out is not None else (dummy, dummy, dummy)
    for out in (x_out, u_buf if u_out is not None else None, res):
        assert out is None or (out.shape == (M, N) and out.is_contiguous())
    grid = (triton.cdiv(M, tiles.bm) * triton.cdiv(N, bn),)
    _rows_gemm_kernel[grid](
        a, dw_w, dw_b, a_alpha, a_inv, w_t,
        bias if bias is not None else dummy,
        res if res is not None else dummy,
        x_out if x_out is not None else dummy,
        u_buf, u_alpha, u_inv, seeds, starts, salts, rate,
        M, T, K, N,
        DW=dw is not None, DIL=dil, SNAKE_A=snake_a is not None, HAS_BIAS=bias is not None,
        HAS_RES=res is not None, NOISE=noise is not None, STORE_X=x_out is not None,
        STORE_U=u_out is not None, BM=tiles.bm, BN=bn, BK=bk, PRECISION=precision, FAST_SIN=tiles.fast_sin,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def conv_transpose_weight(weight: torch.Tensor, stride: int) -> torch.Tensor:
    """ConvTranspose1d weight (C_in, C_out, 2 * stride) -> W2 (2 * C_in, stride * C_out)."""
    c_in, c_out, k = weight.shape
    assert k == 2 * stride
    return weight.reshape(c_in, c_out, 2, stride).permute(2, 0, 3, 1).reshape(2 * c_in, stride * c_out).contiguous()


def conv_transpose(
    u: torch.Tensor,
    w2: torch.Tensor,
    bias: torch.Tensor,
    T_in: int,
    stride: int,
    pad: int,
    tiles: Tiles,
    precision: str,
    u_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """ConvTranspose1d(kernel 2 * stride, `stride`, padding `pad`) on rows: u (B * T_in, C_in)
    -> y (B * T_in * stride, C_out). The output length is exactly T_in * stride, which holds
    for SNAC's padding ceil(s / 2) with output_padding s % 2 (checked by the caller)."""
    rows, c_in = u.shape
    B = rows // T_in
    c_out = w2.shape[1] // stride
    assert w2.shape[0] == 2 * c_in and 0 <= pad <= stride and u.is_contiguous()
    y = torch.empty(B * T_in * stride, c_out, device=u.device, dtype=u.dtype)
    yu, al, iv = u_out if u_out is not None else (y, y, y)
    M, N = B * (T_in + 1), stride * c_out
    bn, bk = _fit(tiles.bn, N), _fit(tiles.bk, c_in)
    grid = (triton.cdiv(M, tiles.bm) * triton.cdiv(N, bn),)
    _convt_kernel[grid](
        u, w2, bias, y, yu, al, iv, M, T_in, c_in, c_out,
        STRIDE=stride, PAD=pad, STORE_U=u_out is not None, BM=tiles.bm, BN=bn, BK=bk,
        PRECISION=precision, FAST_SIN=tiles.fast_sin, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return y


def final_conv_tanh(u: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, T: int, block_rows: int = 128) -> torch.Tensor:
    """tanh(Conv1d(C -> 1, kernel 7, padding 3)) on rows u (B * T, C) -> (B, T) float32."""
    M, C = u.shape
    out = torch.empty(M, device=u.device, dtype=torch.float32)
    bc = max(16, min(128, triton.next_power_of_2(C)))
    _final_kernel[(triton.cdiv(M, block_rows),)](u, w, bias, out, M, T, C, BM=block_rows, BC=bc, num_warps=4)
    return out.view(M // T, T)


def positional_noise_rows(seeds: torch.Tensor, starts: torch.Tensor, salts: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T) float32 noise as computed inside the NoiseBlock epilogue (for tests)."""
    M = seeds.shape[0] * T
    out = torch.empty(M, device=seeds.device, dtype=torch.float32)
    _noise_kernel[(triton.cdiv(M, 256),)](seeds, starts, salts, out, M, T, BM=256)
    return out.view(-1, T)


# ---------------------------------------------------------------- the decoder plan


@dataclass(frozen=True)
class _Snake:
    alpha: torch.Tensor  # (C,)
    inv: torch.Tensor  # (C,) (alpha + 1e-9).reciprocal(), as SNAC computes it

    def args(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.alpha, self.inv


@dataclass(frozen=True)
class _Unit:  # one ResidualUnit: x + pw(Snake2(dw(Snake1(x))))
    snake1: _Snake
    dw_w: torch.Tensor  # (C, 7)
    dw_b: torch.Tensor  # (C,)
    dilation: int
    snake2: _Snake
    pw_t: torch.Tensor  # (C, C) transposed: (in, out)
    pw_b: torch.Tensor  # (C,)


@dataclass(frozen=True)
class _Block:  # one DecoderBlock
    snake_in: _Snake
    w2: torch.Tensor  # (2 * C_in, stride * C_out), see conv_transpose_weight
    b: torch.Tensor  # (C_out,)
    stride: int
    pad: int
    rate: int  # output samples per codec frame (positional noise index scale)
    noise_t: torch.Tensor | None  # (C_out, C_out) NoiseBlock.linear transposed, no bias
    salts: torch.Tensor  # (2,) int64 noise salts of this block
    units: tuple[_Unit, ...]


def _snake_of(m: torch.nn.Module) -> _Snake:
    from snac.layers import Snake1d

    if not isinstance(m, Snake1d):
        raise ValueError(f"expected Snake1d, got {type(m).__name__}")
    alpha = m.alpha.detach()
    return _Snake(alpha.reshape(-1).contiguous(), (alpha + 1e-9).reciprocal().reshape(-1).contiguous())


def _conv(m: torch.nn.Module, *, k: int, dilation: int = 1, groups: int | None = None, out: int | None = None) -> torch.nn.Conv1d:
    """Check m is a 'same' Conv1d of the given shape (stride 1, padding (k-1)/2 * dilation)."""
    ok = (
        isinstance(m, torch.nn.Conv1d)
        and m.kernel_size == (k,)
        and m.stride == (1,)
        and m.dilation == (dilation,)
        and m.padding == ((k - 1) // 2 * dilation,)
        and m.padding_mode == "zeros"
        and (groups is None or m.groups == groups)
        and (out is None or m.out_channels == out)
    )
    if not ok:
        raise ValueError(f"unsupported conv {m}")
    return m


def _unit_of(m: torch.nn.Module, channels: int) -> _Unit:
    from snac.layers import ResidualUnit

    if not isinstance(m, ResidualUnit) or len(m.block) != 4:
        raise ValueError(f"expected ResidualUnit, got {type(m).__name__}")
    dw = m.block[1]
    dil = dw.dilation[0] if isinstance(dw, torch.nn.Conv1d) else 0
    _conv(dw, k=7, dilation=dil, groups=channels, out=channels)  # depthwise only
    pw = _conv(m.block[3], k=1, groups=1, out=channels)
    return _Unit(
        snake1=_snake_of(m.block[0]),
        dw_w=dw.weight.detach().reshape(channels, 7).contiguous(),
        dw_b=dw.bias.detach().contiguous(),
        dilation=dil,
        snake2=_snake_of(m.block[2]),
        pw_t=pw.weight.detach()[:, :, 0].t().contiguous(),
        pw_b=pw.bias.detach().contiguous(),
    )


class FusedSnacDecoder:
    """SNAC's decoder (24 kHz topology: depthwise, optional noise, no attention) as Triton
    kernels on channels-last rows. Built once from a loaded model (weight norm baked)."""

    def __init__(
        self,
        model: torch.nn.Module,
        block_rates: list[int],
        salts: list[tuple[int, int]],
        frame_layout: tuple[tuple[int, ...], ...],
        precision: str = "tf32x3",
        tiles: Tiles | None = None,
        tables: Tables | None = None,
    ) -> None:
        """block_rates / salts: per DecoderBlock, output samples per codec frame and the two noise
        salts; frame_layout: per quantizer level, the positions of its codes among a frame's
        tokens in time order (Orpheus: (0,), (1, 4), (2, 3, 5, 6)). Raises ValueError (naming
        the layer) when the model's topology is not the one the kernels implement. `tiles`
        overrides the device's (benchmarks, tests); else on CUDA `tables` (None: the device's,
        runner.kernels.tuning.load_tables) gives them per model dtype."""
        from snac.layers import DecoderBlock, NoiseBlock

        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"fused SNAC decoder supports float32 and bfloat16, not {self.dtype}")
        if self.device.type == "cuda" and precision not in cuda_precisions():
            raise ValueError(f"Triton {triton.__version__} cannot compile {precision!r} dots (it has {cuda_precisions()})")
        if self.device.type != "cuda" and precision not in _INTERPRETER_PRECISIONS:
            precision = "ieee"  # same numpy fp32 matmul under the interpreter
        # The knob is about fp32 operands ("ieee" = FMA loops, slow); bf16 dots use the
        # default setting every bf16 Triton dot compiles with.
        self.precision = precision if self.dtype == torch.float32 else "tf32"
        if tiles is None and self.device.type == "cuda":
            tiles = (tables or load_tables(self.device)).snac.tiles(self.dtype)
        self.tiles = tiles or INTERPRETER_TILES
        if any(t.fast_sin for t in (self.tiles, *(t for _, t in self.tiles.per_block))) and self.device.type != "cuda":
            raise ValueError("Tiles.fast_sin is inline PTX: CUDA only")

        with torch.no_grad():
            # Quantizer: out_proj(codebook[code]) is a lookup into a precomputed table
            # (codebook_size, latent), computed in float64 once. A level of stride s holds one
            # code per s latent steps; token_of[q] = which of a frame's tokens feeds latent step
            # q of that frame, so the per-call work is a gather, no repeat_interleave.
            self.tables, self.token_of = [], []
            per_frame = int(model.quantizer.quantizers[0].stride)  # latent steps per frame
            if len(frame_layout) != len(model.quantizer.quantizers):
                raise ValueError("frame_layout does not match the quantizer levels")
            for q, toks in zip(model.quantizer.quantizers, frame_layout):
                st = int(q.stride)
                if st * len(toks) != per_frame:
                    raise ValueError(f"quantizer stride {st} does not fit {len(toks)} codes per frame")
                w = q.out_proj.weight.detach().double()[:, :, 0]  # (latent, codebook_dim)
                tab = q.codebook.weight.detach().double() @ w.t() + q.out_proj.bias.detach().double()
                self.tables.append(tab.to(self.dtype).contiguous())
                self.token_of.append(torch.tensor([toks[i // st] for i in range(per_frame)], device=self.device))

            layers = list(model.decoder.model)
            blocks = [m for m in layers if isinstance(m, DecoderBlock)]
            if len(layers) != len(blocks) + 5 or not isinstance(layers[-1], torch.nn.Tanh):
                raise ValueError("decoder layout is not [dw conv, 1x1 conv, DecoderBlock..., Snake1d, conv, Tanh]")
            if len(blocks) != len(block_rates) or len(salts) != len(blocks):
                raise ValueError("block_rates / salts do not match the decoder's blocks")
            latent = layers[0]
            c_lat = self.tables[0].shape[1]
            _conv(latent, k=7, groups=c_lat, out=c_lat)
            lat_pw = _conv(layers[1], k=1, groups=1)
            self.lat_dw = (latent.weight.detach().reshape(c_lat, 7).contiguous(), latent.bias.detach().contiguous(), 1)
            self.lat_pw_t = lat_pw.weight.detach()[:, :, 0].t().contiguous()
            self.lat_pw_b = lat_pw.bias.detach().contiguous()

            self.blocks: list[_Block] = []
            for blk, rate, (sa, sb) in zip(blocks, block_rates, salts):
                mods = list(blk.block)
                ct = mods[1]
                s = int(ct.stride[0])
                if not (
                    isinstance(ct, torch.nn.ConvTranspose1d)
                    and ct.kernel_size == (2 * s,)
                    and ct.padding == ((s + 1) // 2,)
                    and ct.output_padding == (s % 2,)
                    and ct.dilation == (1,)
                    and ct.groups == 1
                ):
                    raise ValueError(f"unsupported transposed conv {ct}")
                c_out = ct.out_channels
                noise = mods[2] if isinstance(mods[2], NoiseBlock) else None
                noise_t = None if noise is None else _conv(noise.linear, k=1, groups=1).weight.detach()[:, :, 0].t().contiguous()
                units = mods[3:] if noise is not None else mods[2:]
                if len(units) != 3:
                    raise ValueError("DecoderBlock must end in 3 ResidualUnits")
                self.blocks.append(
                    _Block(
                        snake_in=_snake_of(mods[0]),
                        w2=conv_transpose_weight(ct.weight.detach(), s),
                        b=ct.bias.detach().contiguous(),
                        stride=s,
                        pad=(s + 1) // 2,
                        rate=rate,
                        noise_t=noise_t,
                        salts=torch.tensor([sa, sb], dtype=torch.int64, device=self.device),
                        units=tuple(_unit_of(u, c_out) for u in units),
                    )
                )
            self.final_snake = _snake_of(layers[-3])
            fin = _conv(layers[-2], k=7, groups=1, out=1)
            self.final_w = fin.weight.detach()[0].contiguous()  # (C, 7)
            self.final_b = fin.bias.detach().contiguous()

    def decode(self, codes: torch.Tensor, window_start: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """codes (B, W, tokens per frame) int64; window_start, seeds (B,) int64 -> float32
        audio (B, W * samples_per_frame), same contract as the torch path."""
        tiles, prec = self.tiles, self.precision
        B, W, _ = codes.shape
        # Latent rows (B * T, latent): sum over levels of table[code of this latent step], in
        # the quantizer's order ((0 + z0) + z1) + z2, like from_codes.
        z = None
        for tab, token_of in zip(self.tables, self.token_of):
            zi = tab[codes.index_select(2, token_of)]  # (B, W, latent steps per frame, latent)
            z = zi if z is None else z + zi
        T = z.shape[1] * z.shape[2]
        z = z.reshape(B * T, -1)

        first = self.blocks[0]
        u = torch.empty(B * T, self.lat_pw_t.shape[1], device=self.device, dtype=self.dtype)
        rows_gemm(z, self.lat_pw_t, T, tiles, prec, dw=self.lat_dw, bias=self.lat_pw_b, u_out=(u, *first.snake_in.args()))

        for i, blk in enumerate(self.blocks):
            bt = tiles.for_block(i)  # this block's layers' tiles
            unit0 = blk.units[0]
            c = blk.b.shape[0]
            y_u = None
            if blk.noise_t is None:  # no NoiseBlock: the transposed conv writes Snake(y) for unit 0
                y_u = (torch.empty(B * T * blk.stride, c, device=self.device, dtype=self.dtype), *unit0.snake1.args())
            y = conv_transpose(u, blk.w2, blk.b, T, blk.stride, blk.pad, bt, prec, u_out=y_u)
            T *= blk.stride
            if blk.noise_t is not None:
                x, u = torch.empty_like(y), torch.empty_like(y)
                noise = (seeds, window_start, blk.salts, blk.rate)
                rows_gemm(y, blk.noise_t, T, bt, prec, res=y, noise=noise, x_out=x,
                          u_out=(u, *unit0.snake1.args()))  # fmt: skip
            else:
                x, u = y, y_u[0]
            for k, unit in enumerate(blk.units):
                if k + 1 < len(blk.units):
                    nxt = blk.units[k + 1].snake1
                elif i + 1 < len(self.blocks):
                    nxt = self.blocks[i + 1].snake_in
                else:
                    nxt = self.final_snake
                u_next = torch.empty_like(u)
                last = k + 1 == len(blk.units)  # x is not needed after the last unit: only u
                rows_gemm(
                    u, unit.pw_t, T, bt, prec,
                    dw=(unit.dw_w, unit.dw_b, unit.dilation), snake_a=unit.snake2.args(), bias=unit.pw_b,
                    res=x, x_out=None if last else x, u_out=(u_next, *nxt.args()),
                )  # fmt: skip
                u = u_next
        return final_conv_tanh(u, self.final_w, self.final_b, T, min(tiles.bm, 4096))
