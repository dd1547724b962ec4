"""Fused Triton SNAC decoder (runner/kernels/snac.py) vs the torch path.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) on
small shapes and the tiny random SNAC; without `triton` installed the file is skipped. On CUDA
the `gpu` tests compare the compiled kernels with the torch path on a random SNAC of the real
24 kHz shape (snac_24khz's architecture, random weights: no download).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.triton_interpreter import interpret_without_cuda, interpreted_or_skip

_CUDA = interpret_without_cuda()  # before runner.kernels.snac is imported
triton = pytest.importorskip("triton", reason="triton not installed (CPU torch wheel does not bring it)")

from runner.codecs.config import CodecConfig  # noqa: E402
from runner.codecs.decoder import SnacWindowDecoder, float_to_s16  # noqa: E402
from runner.codecs.noise import noise_salts, positional_noise  # noqa: E402
from runner.codecs.orpheus_tokens import ORPHEUS_LEVELS  # noqa: E402
from runner.codecs.snac import load_snac  # noqa: E402
from runner.kernels import snac as sk  # noqa: E402
from runner.models.builders import TINY_SNAC_CONFIG, write_random_snac  # noqa: E402

INTERPRET = not _CUDA
DEVICE = "cuda" if _CUDA else "cpu"
TILES = sk.CUDA_TILES if _CUDA else sk.INTERPRETER_TILES
# Small tiles under the interpreter where a test wants several row / column tiles.
SMALL = sk.Tiles(bm=32, bn=16, bk=16, num_warps=4, num_stages=1)


if INTERPRET:
    interpreted_or_skip(sk._rows_gemm_kernel, "runner.kernels.snac")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    if INTERPRET:
        torch.set_num_threads(1)  # the test machine's cores are shared
    # The references must be fp32: cuDNN convolutions default to TF32 on CUDA, which alone
    # is ~3e-4 relative (on the GPU that error showed in every fp32 kernel comparison).
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def _snake_ref(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    # SNAC's snake() on channels-first x (B, C, T) with alpha (C,).
    a = alpha[None, :, None]
    return x + (a + 1e-9).reciprocal() * torch.sin(a * x).pow(2)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, C, T) -> channels-last rows (B * T, C)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1]).contiguous()


def _snake_args(alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return alpha, (alpha + 1e-9).reciprocal()


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> None:
    assert got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), f"max abs error {err}"


# ---------------------------------------------------------------- building blocks


def test_noise_matches_positional_noise():
    """Same hash bits as the int64 torch emulation: seeds / positions taken mod 2^32,
    negative and > 32-bit values included."""
    seeds = torch.tensor([0, 1, -1, 2**33 + 5, 123456789], dtype=torch.int64, device=DEVICE)
    starts = torch.tensor([0, 7 * 2048, 5, 2**32 - 3, 10**6], dtype=torch.int64, device=DEVICE)
    for block in (0, 3):
        salts = torch.tensor(noise_salts(block), dtype=torch.int64, device=DEVICE)
        got = sk.positional_noise_rows(seeds, starts, salts, 40)
        want = positional_noise(seeds, block, starts, 40)[:, 0, :]
        assert torch.isfinite(got).all()
        # Identical uniforms; log / cos / sqrt of two libraries differ by at most an ulp or so.
        _close(got, want, 2e-6)
    assert got.std().item() > 0.5  # not degenerate


@pytest.mark.parametrize("stride", [2, 3, 4, 8])
def test_conv_transpose_matches_torch(stride):
    B, c_in, c_out, t_in = 2, 32, 16, 5
    x = torch.randn(B, c_in, t_in, device=DEVICE)
    w = torch.randn(c_in, c_out, 2 * stride, device=DEVICE) / math.sqrt(c_in)
    b = torch.randn(c_out, device=DEVICE)
    pad = math.ceil(stride / 2)
    want = F.conv_transpose1d(x, w, b, stride=stride, padding=pad, output_padding=stride % 2)
    assert want.shape[-1] == t_in * stride
    alpha = torch.rand(c_out, device=DEVICE) + 0.5
    yu = torch.empty(B * t_in * stride, c_out, device=DEVICE)
    tiles = SMALL if INTERPRET else TILES
    w2 = sk.conv_transpose_weight(w, stride)
    y = sk.conv_transpose(_rows(x), w2, b, t_in, stride, pad, tiles, "ieee", u_out=(yu, *_snake_args(alpha)))
    _close(y, _rows(want))
    _close(yu, _rows(_snake_ref(want, alpha)))


@pytest.mark.parametrize("dil", [1, 3, 9])
def test_residual_unit_kernel_matches_torch(dil):
    """Depthwise prologue (zero padding at every window's edges, also where a neighbouring
    window's rows sit in memory), pointwise matmul, residual + bias, Snake_next epilogue."""
    B, C, T = 3, 32, 20  # 20 < 6 * 9: the dilated taps reach across whole windows
    x = torch.randn(B, C, T, device=DEVICE)
    a1, a2, a3 = (torch.rand(C, device=DEVICE) * 2 + 0.3 for _ in range(3))
    dw_w, dw_b = torch.randn(C, 7, device=DEVICE) / 3, torch.randn(C, device=DEVICE)
    pw, pw_b = torch.randn(C, C, device=DEVICE) / math.sqrt(C), torch.randn(C, device=DEVICE)
    s = _snake_ref(F.conv1d(_snake_ref(x, a1), dw_w[:, None, :], dw_b, padding=3 * dil, dilation=dil, groups=C), a2)
    x_new = x + F.conv1d(s, pw[:, :, None], pw_b)
    u = _rows(_snake_ref(x, a1))
    xr = _rows(x)
    u_out = torch.empty_like(u)
    tiles = SMALL if INTERPRET else TILES
    sk.rows_gemm(u, pw.t().contiguous(), T, tiles, "ieee", dw=(dw_w, dw_b, dil), snake_a=_snake_args(a2), bias=pw_b,
                 res=xr, x_out=xr, u_out=(u_out, *_snake_args(a3)))  # fmt: skip
    _close(xr, _rows(x_new))
    _close(u_out, _rows(_snake_ref(x_new, a3)))


def test_noise_block_kernel_matches_torch():
    B, C, T, rate, block = 2, 16, 24, 32, 1
    y = torch.randn(B, C, T, device=DEVICE)
    wn = torch.randn(C, C, device=DEVICE) / math.sqrt(C)
    seeds = torch.tensor([3, -7], dtype=torch.int64, device=DEVICE)
    win = torch.tensor([0, 11], dtype=torch.int64, device=DEVICE)
    noise = positional_noise(seeds, block, win * rate, T)
    x1 = y + noise * F.conv1d(y, wn[:, :, None])
    alpha = torch.rand(C, device=DEVICE) + 0.5
    yr = _rows(y)
    x_out, u_out = torch.empty_like(yr), torch.empty_like(yr)
    salts = torch.tensor(noise_salts(block), dtype=torch.int64, device=DEVICE)
    sk.rows_gemm(yr, wn.t().contiguous(), T, SMALL if INTERPRET else TILES, "ieee", res=yr,
                 noise=(seeds, win, salts, rate), x_out=x_out, u_out=(u_out, *_snake_args(alpha)))  # fmt: skip
    _close(x_out, _rows(x1))
    _close(u_out, _rows(_snake_ref(x1, alpha)))


def test_final_conv_tanh_matches_torch():
    B, C, T = 2, 24, 50  # C not a power of two: masked channels
    u = torch.randn(B, C, T, device=DEVICE)
    w, b = torch.randn(1, C, 7, device=DEVICE) / 4, torch.randn(1, device=DEVICE)
    want = torch.tanh(F.conv1d(u, w, b, padding=3))[:, 0, :]
    _close(sk.final_conv_tanh(_rows(u), w[0].contiguous(), b, T, block_rows=32), want, 1e-5)


# ---------------------------------------------------------------- whole decoder


@pytest.fixture(scope="module")
def tiny(tiny_snac_dir: Path) -> SnacWindowDecoder:
    model = load_snac(CodecConfig(path=str(tiny_snac_dir), codebook_size=64), torch.device(DEVICE))
    return SnacWindowDecoder(model, 2048, kernels="triton", matmul_precision="tf32x3")


def _case(B: int, W: int, codebook: int):
    g = torch.Generator().manual_seed(B * 100 + W)
    codes = torch.randint(0, codebook, (B, W, 7), generator=g).to(DEVICE)
    starts = torch.tensor([0, 6, 1, 40, 3, 9, 2, 7][:B], dtype=torch.int64, device=DEVICE)
    seeds = torch.tensor([0, 5, 0, 2**40 + 1, 9, 1, 4, 3][:B], dtype=torch.int64, device=DEVICE)
    return codes, starts, seeds


def _lsb(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((float_to_s16(a).int() - float_to_s16(b).int()).abs().max())


def test_tiny_decoder_matches_torch_path(tiny):
    assert tiny.kernels == "triton"
    codes, starts, seeds = _case(2, 2, 64)
    got = tiny.decode(codes, starts, seeds)
    want = tiny.decode_torch(codes, starts, seeds)
    assert got.shape == want.shape == (2, 2 * 2048) and got.dtype == torch.float32
    _close(got, want, 1e-5)
    assert _lsb(got, want) <= 1
    assert want.abs().mean() > 0.1  # a busy signal, so the comparison means something


def test_precision_choice(tiny):
    salts = [noise_salts(i) for i in range(4)]
    for prec in sk.PRECISIONS:
        if _CUDA and prec not in sk.cuda_precisions():
            continue
        dec = sk.FusedSnacDecoder(tiny.model, tiny._block_rates, salts, ORPHEUS_LEVELS, prec)  # compiles nothing
        # The interpreter has no bf16x3 dots (every fp32 dot is a numpy fp32 matmul there).
        assert dec.precision == (prec if _CUDA or prec != "bf16x3" else "ieee")
    with pytest.raises(ValueError, match="precision must be one of"):
        sk.FusedSnacDecoder(tiny.model, tiny._block_rates, salts, ORPHEUS_LEVELS, "fp16")


def test_per_block_tiles(tiny):
    """Tiles.per_block gives a DecoderBlock other tiles (parsed from the bench's '+bI:' form);
    the decode stays the torch path's within the fp32 tolerance, and other blocks keep theirs."""
    t = sk.Tiles.parse("32,16,16,4,1+b1:64,32,32,4,1+b3:16,16,16,4,1")
    assert t.for_block(1) == sk.Tiles(64, 32, 32, 4, 1) and t.for_block(3) == sk.Tiles(16, 16, 16, 4, 1)
    assert t.for_block(0) is t and t.for_block(2) is t
    with pytest.raises(ValueError, match="per-block"):
        sk.Tiles.parse("32,16,16,4,1+x1:64,32,32,4,1")
    salts = [noise_salts(i) for i in range(4)]
    dec = sk.FusedSnacDecoder(tiny.model, tiny._block_rates, salts, ORPHEUS_LEVELS, "tf32x3", TILES if _CUDA else t)
    if _CUDA:
        dec.tiles = sk.Tiles(**{**TILES.__dict__, "per_block": ((1, sk.Tiles(64, 32, 32, 4, 2)),)})
    codes, starts, seeds = _case(2, 2, 64)
    got = dec.decode(codes, starts, seeds)
    want = tiny.decode_torch(codes, starts, seeds)
    _close(got, want, 1e-5)
    assert _lsb(got, want) <= 1


def test_warm_up_falls_back_to_safe_tiles(tiny, monkeypatch):
    """Construction on CUDA compiles by decoding one frame; tiles that fail there are replaced
    by SAFE_TILES, and if nothing runs "auto" keeps the torch path."""
    monkeypatch.setattr(sk, "SAFE_TILES", TILES)  # a shape this device runs quickly
    broken = sk.Tiles(bm=48)  # not a power of two: tl.arange refuses it
    dec = SnacWindowDecoder(tiny.model, 2048, kernels="triton")
    dec.fused.tiles = broken
    dec._warm_up(required=True, tiles_given=False)
    assert dec.fused.tiles == TILES and dec.kernels == "triton"
    dec.fused.tiles = broken
    with pytest.raises(Exception):
        dec._warm_up(required=True, tiles_given=True)
    dec._warm_up(required=False, tiles_given=True)
    assert dec.fused is None


def test_tiny_decoder_rows_do_not_depend_on_the_batch(tiny):
    """Tile shapes depend on the layer only, so a window decodes alone as in a batch (up to the
    matmul library's edge-tile rounding under the interpreter; on CUDA see the gpu test)."""
    codes, starts, seeds = _case(2, 2, 64)
    both = tiny.decode(codes, starts, seeds)
    one = tiny.decode(codes[1:], starts[1:], seeds[1:])
    assert (both[1:] - one).abs().max().item() <= 1e-6


def _tiny_variant(folder: Path, **changes) -> SnacWindowDecoder:
    """The tiny SNAC with config changes and fresh random weights, fused path, fp32."""
    d = write_random_snac(folder, {**TINY_SNAC_CONFIG, **changes}, seed=1, random_alphas=True)
    return load_snac(CodecConfig(path=str(d), codebook_size=64), torch.device(DEVICE))


def test_decoder_without_noise_blocks(tmp_path):
    """noise=False: the transposed conv's epilogue writes Snake(y) for the first unit."""
    dec = SnacWindowDecoder(_tiny_variant(tmp_path / "n", noise=False), 2048, kernels="triton")
    codes, starts, seeds = _case(2, 2, 64)
    want = dec.decode_torch(codes, starts, seeds)
    _close(dec.decode(codes, starts, seeds), want, 1e-5)


def test_bf16_decoder_close_to_fp32(tiny_snac_dir: Path):
    """bf16 model: bf16 activations and dots; as far from fp32 as SNAC's own bf16 path is."""
    cfg = CodecConfig(path=str(tiny_snac_dir), codebook_size=64)
    fp32 = SnacWindowDecoder(load_snac(cfg, torch.device(DEVICE)), 2048, kernels="torch")
    dec = SnacWindowDecoder(load_snac(cfg, torch.device(DEVICE), torch.bfloat16), 2048, kernels="triton")
    codes, starts, seeds = _case(2, 2, 64)
    want = fp32.decode(codes, starts, seeds)
    got = dec.decode(codes, starts, seeds)
    assert got.dtype == torch.float32
    assert _lsb(got, want) <= 2 * _lsb(dec.decode_torch(codes, starts, seeds), want)


def test_unsupported_model_keeps_torch_path(tmp_path):
    """A SNAC the kernels do not implement (non-depthwise) falls back under "auto" and is an
    error under "triton"."""
    from runner.codecs.config import CodecError

    model = _tiny_variant(tmp_path / "t", depthwise=False)
    assert SnacWindowDecoder(model, 2048, kernels="auto").kernels == "torch"
    with pytest.raises(CodecError, match="fused SNAC decoder cannot run this model"):
        SnacWindowDecoder(model, 2048, kernels="triton")


# ---------------------------------------------------------------- CUDA: the real shape


def _snac24(folder: Path) -> Path:
    """snac_24khz's architecture with random weights and random Snake alphas."""
    return write_random_snac(folder, seed=0, random_alphas=True)


@pytest.fixture(scope="module")
def snac24_dir(tmp_path_factory) -> Path:
    return _snac24(tmp_path_factory.mktemp("snac24") / "m")


def _reference_fp32(dec: SnacWindowDecoder, codes, starts, seeds) -> torch.Tensor:
    """The torch path in true fp32 (cuDNN would otherwise run the convs in TF32)."""
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return dec.decode_torch(codes, starts, seeds)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
# plain tf32: ~100 LSB on the GPU for B=8 W=12, above the CPU emulation's ~26
@pytest.mark.parametrize("precision,max_lsb", [("tf32x3", 2), ("bf16x3", 2), ("tf32", 128)])
def test_cuda_fused_matches_torch_on_24khz_shape(snac24_dir, precision, max_lsb):
    if precision not in sk.cuda_precisions():
        pytest.skip(f"Triton {triton.__version__} has no {precision} dots")
    model = load_snac(CodecConfig(path=str(snac24_dir)), torch.device("cuda"))
    dec = SnacWindowDecoder(model, 2048, kernels="triton", matmul_precision=precision)
    for B, W in [(8, 12), (3, 4), (1, 1)]:
        codes, starts, seeds = _case(B, W, 4096)
        got = dec.decode(codes, starts, seeds)
        want = _reference_fp32(dec, codes, starts, seeds)
        assert torch.isfinite(got).all() and want.abs().mean() > 0.05
        lsb = _lsb(got, want)
        assert lsb <= max_lsb, f"{precision} B={B} W={W}: {lsb} LSB"
        # Batch invariance: a row equals its own single-window decode (bitwise expected: tiles
        # depend on the layer only; tolerance so a compiler's choice cannot fail the suite).
        assert (dec.decode(codes[-1:], starts[-1:], seeds[-1:]) - got[-1:]).abs().max().item() <= 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
@pytest.mark.parametrize("fast_sin", [True, False])
def test_cuda_fused_bf16_close_to_fp32(snac24_dir, fast_sin):
    """bf16 weights/activations, with the SFU sine (the bf16 default) or libdevice's: within the
    bf16 torch path's own distance from fp32."""
    import dataclasses

    cfg = CodecConfig(path=str(snac24_dir))
    ref = SnacWindowDecoder(load_snac(cfg, torch.device("cuda")), 2048, kernels="torch")
    tiles = dataclasses.replace(sk.CUDA_TILES_BF16, fast_sin=fast_sin)
    dec = SnacWindowDecoder(load_snac(cfg, torch.device("cuda"), torch.bfloat16), 2048, kernels="triton", tiles=tiles)
    codes, starts, seeds = _case(4, 12, 4096)
    want = _reference_fp32(ref, codes, starts, seeds)
    got = dec.decode(codes, starts, seeds)
    torch_bf16 = dec.decode_torch(codes, starts, seeds)
    assert _lsb(got, want) <= max(64, 2 * _lsb(torch_bf16, want)), (_lsb(got, want), _lsb(torch_bf16, want))
