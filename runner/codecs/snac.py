"""Codec stage: Orpheus audio tokens -> SNAC codes -> 24 kHz PCM, streamed exactly once.

Per request the stage turns sampled token ids into SNAC frames (7 tokens per frame), asks
`streaming.audio.FrameCursor` which windows are ready, and decodes the ready windows of all
requests together, one batched SNAC call per distinct window length. The window rule
(documented in streaming/audio.py) makes the streamed PCM equal to `offline_decode` of the
complete code sequence under the same policy.

SNAC's decoder injects noise (`NoiseBlock`: x + randn * linear(x)). With fresh random noise
per call, a window decoded in a batch, alone, or offline would differ, so the stage runs
the decoder itself and draws that noise from a counter-based hash of (seed, block, absolute
sample position): every sample gets the same noise whichever window, batch or step
produces it, and the model still sees noise of the trained distribution.

On CUDA the decoder runs as fused Triton kernels (runner/kernels/snac.py, chosen once by
SnacWindowDecoder from CodecConfig.kernels): same results up to float rounding, ~7x less
memory traffic than SNAC's layers; codec_flops_and_bytes gives the per-stage numbers.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from snac import SNAC
from snac.layers import DecoderBlock, NoiseBlock

from runner.engine.host_staging import staging_for
from runner.layers.hashing import M32, hash32, hash32_int, uniform24
from streaming.audio import FrameCursor, WindowJob, WindowPolicy, plan_offline

_log = logging.getLogger(__name__)

# Orpheus interleaving of one frame's 7 tokens into SNAC's 3 levels (strides 4, 2, 1):
# level 0 gets token 0, level 1 tokens 1 and 4, level 2 tokens 2, 3, 5, 6 (time order).
ORPHEUS_LEVELS: tuple[tuple[int, ...], ...] = ((0,), (1, 4), (2, 3, 5, 6))


KERNEL_CHOICES = ("auto", "torch", "triton")
MATMUL_PRECISIONS = ("tf32x3", "bf16x3", "tf32", "ieee")  # = runner.kernels.snac.PRECISIONS (no triton import here)


class CodecError(ValueError):
    """The codec folder or configuration is unusable; the message names the field."""


@dataclass(frozen=True)
class CodecConfig:
    path: str  # local SNAC folder: config.json + pytorch_model.bin (or model.safetensors)
    audio_token_offset: int = 128266
    codebook_size: int = 4096
    end_token_id: int = 128258
    tokens_per_frame: int = 7
    sample_rate: int = 24000
    samples_per_frame: int = 2048
    policy: WindowPolicy = field(default_factory=WindowPolicy)
    noise_seed: int = 0  # default seed of the positional decoder noise (see module doc)
    max_batch_windows: int = 128  # windows per SNAC call; bounds activation memory
    # Launched windows whose PCM has not been collected yet. Collection does not wait for the
    # codec stream (the model keeps stepping meanwhile) unless more than this many are in
    # flight: a bound on the backlog and its pinned host buffers when the codec falls behind.
    max_inflight_windows: int = 2048
    # CUDA: each SNAC call costs ~1 ms of host time whatever its batch, and streams that started
    # at different times have windows of several lengths ready at every step (H200, 64-256
    # streams arriving over 2 s: 4.6 ms of codec host time per step). So a step launches at most
    # this many window lengths; the others wait (and grow into bigger batches) for at most
    # max_defer_steps steps. First chunks (time to first audio) never wait.
    max_launches_per_step: int = 2
    max_defer_steps: int = 2
    cuda_graphs: bool = True  # CUDA + fused kernels: replay captured decodes (runner/codecs/graphs.py)
    # Decoder implementation: "triton" (fused kernels, runner/kernels/snac.py), "torch" (SNAC's
    # layers), or "auto" = triton on CUDA when it is installed and the model fits, else torch.
    kernels: str = "auto"
    # tl.dot input precision of the fused kernels on float32 models: "tf32x3" (3 TF32 products,
    # fp32 accuracy: <= 1 int16 LSB from the fp32 torch path on a random 24 kHz SNAC, CPU
    # emulation), "bf16x3" (<= 1 LSB too, ~half the matmul time, Triton >= 3.5), "tf32"
    # (1 product, 1/3 of the matmul time, up to ~26 LSB in CPU emulation, 103 measured on an H200) or "ieee" (FMA, slow).
    matmul_precision: str = "tf32x3"

    def __post_init__(self) -> None:
        for name in ("codebook_size", "sample_rate", "samples_per_frame", "max_batch_windows", "max_inflight_windows",
                     "max_launches_per_step"):
            if getattr(self, name) < 1:
                raise CodecError(f"CodecConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_defer_steps < 0:
            raise CodecError(f"CodecConfig.max_defer_steps: must be >= 0, got {self.max_defer_steps}")
        if self.audio_token_offset < 0:
            raise CodecError(f"CodecConfig.audio_token_offset: must be >= 0, got {self.audio_token_offset}")
        if self.tokens_per_frame != sum(len(g) for g in ORPHEUS_LEVELS):
            raise CodecError(f"CodecConfig.tokens_per_frame: the Orpheus SNAC layout needs 7, got {self.tokens_per_frame}")
        lo, hi = self.audio_token_offset, self.audio_token_offset + self.tokens_per_frame * self.codebook_size
        if lo <= self.end_token_id < hi:
            raise CodecError(f"CodecConfig.end_token_id: {self.end_token_id} lies inside the audio token range [{lo}, {hi})")
        if not isinstance(self.policy, WindowPolicy):
            raise CodecError(f"CodecConfig.policy: expected WindowPolicy, got {type(self.policy).__name__}")
        if self.kernels not in KERNEL_CHOICES:
            raise CodecError(f"CodecConfig.kernels: must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise CodecError(f"CodecConfig.matmul_precision: must be one of {MATMUL_PRECISIONS}, got {self.matmul_precision!r}")


# ---------------------------------------------------------------- token <-> code mapping


def audio_token_range(cfg: CodecConfig, audio_index: int) -> tuple[int, int]:
    """[lo, hi) of valid ids for the audio token at `audio_index` (0-based among audio tokens)."""
    lo = cfg.audio_token_offset + (audio_index % cfg.tokens_per_frame) * cfg.codebook_size
    return lo, lo + cfg.codebook_size


def invalid_token_reason(cfg: CodecConfig, token: int, audio_index: int) -> str:
    lo, hi = audio_token_range(cfg, audio_index)
    return (
        f"invalid audio token {token} at audio index {audio_index} "
        f"(expected range [{lo}, {hi}) or end token {cfg.end_token_id})"
    )


def tokens_to_codes(cfg: CodecConfig, token_ids: list[int]) -> np.ndarray:
    """Audio token ids (no end token) -> codes (n_frames, 7) int64 in Orpheus token order.

    A trailing incomplete frame is dropped. Raises ValueError on an out-of-range token.
    """
    toks = np.asarray(token_ids, dtype=np.int64)
    pos = np.arange(toks.size) % cfg.tokens_per_frame
    codes = toks - cfg.audio_token_offset - pos * cfg.codebook_size
    bad = np.flatnonzero((codes < 0) | (codes >= cfg.codebook_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(invalid_token_reason(cfg, int(toks[i]), i))
    n = toks.size // cfg.tokens_per_frame
    return codes[: n * cfg.tokens_per_frame].reshape(n, cfg.tokens_per_frame)


def codes_to_tokens(cfg: CodecConfig, codes: np.ndarray) -> list[int]:
    """Inverse of tokens_to_codes: (n_frames, 7) codes -> flat Orpheus token ids."""
    codes = np.asarray(codes, dtype=np.int64)
    if codes.ndim != 2 or codes.shape[1] != cfg.tokens_per_frame:
        raise ValueError(f"codes must have shape (n, {cfg.tokens_per_frame}), got {codes.shape}")
    if codes.size and (codes.min() < 0 or codes.max() >= cfg.codebook_size):
        raise ValueError(f"codes must lie in [0, {cfg.codebook_size})")
    offs = cfg.audio_token_offset + np.arange(cfg.tokens_per_frame) * cfg.codebook_size
    return (codes + offs).reshape(-1).tolist()


def frames_to_levels(codes: torch.Tensor) -> list[torch.Tensor]:
    """(B, W, 7) frame codes -> SNAC levels [(B, W), (B, 2W), (B, 4W)] (long)."""
    b, w, _ = codes.shape
    return [codes[:, :, list(idx)].reshape(b, w * len(idx)) for idx in ORPHEUS_LEVELS]


def float_to_s16(audio: torch.Tensor) -> torch.Tensor:
    """Float PCM in [-1, 1] -> int16: clip, scale by 32767, round half to even."""
    return torch.round(audio.float().clamp(-1.0, 1.0) * 32767.0).to(torch.int16)


# ---------------------------------------------------------------- loading SNAC


def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    st = folder / "model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st), device="cpu")
    pt = folder / "pytorch_model.bin"
    if pt.is_file():
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise CodecError(f"CodecConfig.path: {folder} has neither model.safetensors nor pytorch_model.bin")


def load_snac(cfg: CodecConfig, device: torch.device, dtype: torch.dtype = torch.float32) -> SNAC:
    """Build SNAC from a local folder (never the hub), check it matches cfg, bake weight norm.

    The published checkpoints store weight norm as weight_g/weight_v; torch's parametrized
    weight_norm converts those on load, so both key layouts load with strict=True.
    """
    folder = Path(cfg.path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise CodecError(f"CodecConfig.path: {cfg_file} not found")
    snac_cfg = json.loads(cfg_file.read_text())
    model = SNAC(**snac_cfg)
    model.load_state_dict(_read_state_dict(folder), strict=True)

    hop = int(model.hop_length)
    strides = list(model.vq_strides)
    checks = {
        "sample_rate": (cfg.sample_rate, model.sampling_rate),
        "codebook_size": (cfg.codebook_size, model.codebook_size),
        "samples_per_frame": (cfg.samples_per_frame, hop * strides[0]),
    }
    for name, (want, got) in checks.items():
        if want != got:
            raise CodecError(f"CodecConfig.{name}: {want} does not match the SNAC model in {folder} ({got})")
    if len(strides) != len(ORPHEUS_LEVELS) or any(strides[0] // s != len(g) for s, g in zip(strides, ORPHEUS_LEVELS)):
        raise CodecError(f"CodecConfig.path: SNAC vq_strides {strides} do not fit the Orpheus 1/2/4 layout")
    if model.attn_window_size is not None:
        # LocalMHA attends in fixed blocks of the latent sequence, which windowed decoding
        # would misalign; the 24 kHz model has none.
        raise CodecError(f"CodecConfig.path: SNAC with local attention (attn_window_size={model.attn_window_size}) is not supported")

    # Only the quantizer's from_codes and the decoder are used: drop the encoder, and bake
    # weight norm into plain weights (recomputing it every forward is pure overhead).
    model.encoder = torch.nn.Identity()
    for m in model.modules():
        if torch.nn.utils.parametrize.is_parametrized(m):
            for name in list(m.parametrizations.keys()):
                torch.nn.utils.parametrize.remove_parametrizations(m, name, leave_parametrized=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


# The published snac_24khz architecture (what Orpheus decodes with); benchmarks and GPU tests
# build it with random weights, since nothing is downloaded.
SNAC_24KHZ_CONFIG = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "latent_dim": None,
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}


# make_tiny_snac's widths: the 24 kHz topology, tiny channels and codebook
TINY_SNAC_CONFIG = {**SNAC_24KHZ_CONFIG, "encoder_dim": 4, "latent_dim": 32, "decoder_dim": 32, "codebook_size": 64}


def random_snac(config: dict, seed: int, random_alphas: bool) -> SNAC:
    """SNAC(**config) with random weights drawn from `seed` (the global RNG state is restored).
    random_alphas: Snake alphas uniform in [0.5, 3] instead of SNAC's initial 1, so the output
    is a busy signal (|x| ~ 0.4 on average, rarely clipped): a near-silent random decoder would
    make PCM comparisons vacuous."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = SNAC(**config)
        if random_alphas:
            with torch.no_grad():
                for m in model.decoder.modules():
                    if hasattr(m, "alpha") and isinstance(m.alpha, torch.nn.Parameter):
                        m.alpha.uniform_(0.5, 3.0)
    finally:
        torch.random.set_rng_state(gen_state)
    return model


def write_random_snac(path: str | Path, config: dict = SNAC_24KHZ_CONFIG, seed: int = 0, random_alphas: bool = False) -> Path:
    """A loadable SNAC folder (config.json + pytorch_model.bin) from random_snac."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    torch.save(random_snac(config, seed, random_alphas).state_dict(), path / "pytorch_model.bin")
    return path


def make_tiny_snac(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny random SNAC (24 kHz layout: hop 512, strides [4, 2, 1]) to `path`.

    Same topology as snac_24khz (depthwise, noise, no attention, rates 8/8/4/2) so frames are
    2048 samples and the receptive field is the real one; only the widths are tiny
    (decoder 32 -> 2 channels, codebook 64) so a 12-frame window decodes in ~20 ms on one
    CPU core. Random Snake alphas (random_snac). Saved as config.json + pytorch_model.bin
    with legacy weight_g/weight_v keys (what torch.nn.utils.weight_norm checkpoints such as
    the published one hold), so tests exercise the legacy-key conversion; parametrized keys
    load too.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = TINY_SNAC_CONFIG
    model = random_snac(config, seed, random_alphas=True)
    sd = {}
    for k, v in model.state_dict().items():
        k = k.replace("parametrizations.weight.original0", "weight_g").replace("parametrizations.weight.original1", "weight_v")
        sd[k] = v.contiguous()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    torch.save(sd, path / "pytorch_model.bin")
    return path


# ---------------------------------------------------------------- cost model


def codec_flops_and_bytes(model_or_config, frames: int = 1, dtype_bytes: int = 4) -> list[dict]:
    """Per-stage cost of decoding `frames` codec frames (one window row; scale by the batch).

    model_or_config: a SNAC model, its config.json dict or a CodecConfig. Rows: stage, macs,
    torch_bytes (the torch path, counting every eager elementwise kernel: Snake as SNAC writes
    it is 5 kernels = 11 tensor passes, unfused), fused_bytes (runner/kernels/snac.py: each
    layer one kernel, halo re-reads assumed to hit cache). Activation bytes only: weights are
    read once per call and are small at batch >= 64. Both paths use the same matmul work.

    snac_24khz (latent 768, decoder 1024, rates 8/8/4/2, noise), fp32, per frame:

        stage      MMAC  torch MB  fused MB   channels x samples per frame
        latent      3.2      0.18      0.13   768 x 4 -> 1024 x 4
        block0     67.5      6.44      1.00   1024 x 4 -> 512 x 32
        block1    135.6     25.85      4.00   512 x 32 -> 256 x 256
        block2    137.0     53.61      8.13   256 x 256 -> 128 x 1024
        block3     69.9     57.41      8.39   128 x 1024 -> 64 x 2048
        final       0.9      6.32      0.53   64 x 2048 -> 1 x 2048
        total     414.0    149.81     22.17

    The torch column at ~3.6 TB/s is ~42 us/frame, what an H200 measured (128 ms for 256
    12-frame windows): the torch path is bound by activation traffic, not by its 0.83 GFLOP.
    The fused path moves 6.8x fewer bytes (~6 us/frame) and runs the same matmuls as 3xTF32 on
    tensor cores (~2.5 GFLOP of TF32 work, ~5 us/frame at ~500 TFLOP/s; 1/3 of that as
    matmul_precision="tf32"), in the same kernels, so the two overlap in part.
    """
    if hasattr(model_or_config, "decoder_rates"):
        m = model_or_config
        conf = {"latent_dim": m.latent_dim, "decoder_dim": m.decoder_dim, "decoder_rates": list(m.decoder_rates),
                "vq_strides": list(m.vq_strides), "noise": any(isinstance(x, NoiseBlock) for x in m.decoder.modules())}
    elif isinstance(model_or_config, CodecConfig):
        conf = json.loads((Path(model_or_config.path) / "config.json").read_text())
    else:
        conf = dict(model_or_config)
    latent = conf.get("latent_dim") or conf["encoder_dim"] * 2 ** len(conf["encoder_rates"])
    noise = conf.get("noise", True)
    t = frames * int(conf["vq_strides"][0])
    c = int(conf["decoder_dim"])
    snake = 11  # passes of one eager Snake: alpha*x, sin, pow, mul (2 each), add (3)
    b = dtype_bytes
    rows = []
    # latent: from_codes (3 out_proj convs, repeat_interleave, 2 adds ~ 10 passes of the latent)
    # then depthwise k7 and 1x1 convs. Fused: table gathers + adds, one kernel writing Snake(x).
    rows.append({"stage": "latent", "macs": t * latent * (7 + c),
                 "torch_bytes": b * (10 * latent * t + 2 * latent * t + latent * t + c * t),
                 "fused_bytes": b * (8 * latent * t + latent * t + c * t)})
    for i, s in enumerate(conf["decoder_rates"]):
        c_in, c_out, t_out = c, c // 2, t * s
        n_in, n_out = c_in * t, c_out * t_out
        macs = t_out * c_in * c_out * 2  # transposed conv: kernel 2s, stride s -> 2 taps
        tb = snake * n_in + n_in + n_out
        fb = n_in + n_out
        if noise:
            macs += t_out * c_out * c_out
            # linear (2), noise * h (2), x + (3); ~40 int64 hash kernels over (B, T), 16 B each
            tb += 7 * n_out + 40 * 4 * t_out
            fb += 3 * n_out  # read y, write x1 and Snake(x1)
        else:
            fb += n_out  # the transposed conv also writes Snake(y)
        macs += 3 * t_out * c_out * (c_out + 7)
        tb += 3 * (2 * snake + 2 + 2 + 3) * n_out  # Snake, dw conv, Snake, 1x1 conv, residual add
        fb += (4 + 4 + 3) * n_out  # read u, x; write x (not after the last unit), Snake(x)
        rows.append({"stage": f"block{i}", "macs": macs, "torch_bytes": b * tb, "fused_bytes": b * fb})
        c, t = c_out, t_out
    rows.append({"stage": "final", "macs": 7 * c * t,
                 "torch_bytes": b * (snake * c * t + c * t + t + 2 * t), "fused_bytes": b * (c * t + t)})
    return rows


# ---------------------------------------------------------------- positional noise

def noise_salts(block: int) -> tuple[int, int]:
    """The two 32-bit salts of DecoderBlock `block`'s positional noise (see positional_noise)."""
    return hash32_int(2 * block + 0x9E37), hash32_int(2 * block + 1 + 0x9E37)


def positional_noise(seeds: torch.Tensor, block: int, start: torch.Tensor, length: int) -> torch.Tensor:
    """Standard normal noise (B, 1, length) keyed on (seed, block, absolute position).

    seeds, start: (B,) int64 on the target device; start is the absolute index (at this
    block's sample rate) of the window's first position. Same key -> same value, bitwise,
    on one device, so overlapping windows agree wherever they cover the same sample.
    """
    pos = (start[:, None] + torch.arange(length, device=start.device)) & M32  # (B, T)
    salt_a, salt_b = noise_salts(block)
    base = hash32(pos ^ hash32(seeds[:, None] & M32))
    h1 = hash32(base ^ salt_a)
    h2 = hash32(base ^ salt_b)
    # Top 24 bits -> uniforms in (0, 1) that float32 represents exactly; Box-Muller.
    u1, u2 = uniform24(h1), uniform24(h2)
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return z[:, None, :]


# ---------------------------------------------------------------- windowed decoder


class SnacWindowDecoder:
    """Decodes batches of equal-length frame windows with positional decoder noise.

    Two implementations with one contract, chosen once here: the torch path runs SNAC's own
    layers ((B, C, T) tensors, any device); the fused path (runner/kernels/snac.py) runs each
    decoder layer as one Triton kernel on channels-last rows, about 5x less memory traffic
    (see codec_flops_and_bytes). Both give the same PCM up to float rounding.
    """

    def __init__(
        self,
        model: SNAC,
        samples_per_frame: int,
        kernels: str = "torch",
        matmul_precision: str = "tf32x3",
        tiles=None,  # runner.kernels.snac.Tiles override (tests, tuning)
        graph_windows: tuple[int, ...] = (),  # CUDA + fused: capture graphs for these window lengths
        graph_max_rows: int = 128,
    ) -> None:
        self.model = model
        self.samples_per_frame = samples_per_frame
        self.latent_per_frame = int(model.vq_strides[0])
        # Samples per frame at each DecoderBlock's output rate (frame = 4 latent steps).
        self._block_rates: list[int] = []
        r = self.latent_per_frame
        for layer in model.decoder.model:
            if isinstance(layer, DecoderBlock):
                r *= int(layer.block[1].stride[0])  # block = [Snake, ConvTranspose, ...]
                self._block_rates.append(r)
        if not self._block_rates or self._block_rates[-1] != samples_per_frame:
            raise CodecError(f"SNAC decoder rates give {r} samples per frame, expected {samples_per_frame}")
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # CUDA: decode on a stream of its own, overlapping the model's steps (see launch_jobs)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if kernels not in KERNEL_CHOICES:
            raise CodecError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
        self.fused = None
        if kernels == "triton" or (kernels == "auto" and self.device.type == "cuda"):
            self.fused = self._build_fused(matmul_precision, tiles, required=kernels == "triton")
        if self.fused is not None and self.device.type == "cuda":
            self._warm_up(required=kernels == "triton", tiles_given=tiles is not None)
        self.kernels = "triton" if self.fused is not None else "torch"
        self._decode = self._decode_fused if self.fused is not None else self.decode_torch
        self.graphs = None  # runner.codecs.graphs.CodecGraphs: launches of these window lengths replay
        if graph_windows and self.fused is not None and self.device.type == "cuda":
            from runner.codecs.graphs import CodecGraphs

            self.graphs = CodecGraphs(lambda c, s, n: float_to_s16(self._decode_fused(c, s, n)), self.device,
                                      list(graph_windows), graph_max_rows, sum(map(len, ORPHEUS_LEVELS)), samples_per_frame)

    def _build_fused(self, precision: str, tiles, required: bool):
        try:
            from runner.kernels.snac import FusedSnacDecoder
        except ImportError as e:  # CPU torch wheels do not bring triton
            if required:
                raise CodecError(f"CodecConfig.kernels: 'triton' needs the triton package ({e})") from e
            _log.warning("triton is not installed; SNAC decodes with the torch path")
            return None
        salts = [noise_salts(i) for i in range(len(self._block_rates))]
        try:
            return FusedSnacDecoder(self.model, self._block_rates, salts, ORPHEUS_LEVELS, precision, tiles)
        except ValueError as e:
            if required:
                raise CodecError(f"CodecConfig.kernels: the fused SNAC decoder cannot run this model: {e}") from e
            _log.warning("fused SNAC decoder unavailable (%s); using the torch path", e)
            return None

    def _warm_up(self, required: bool, tiles_given: bool) -> None:
        """Compile the ~10 kernels now (a 1-frame window: one binary serves every window length
        and batch), not in the first request's step. If the default tiles do not compile on
        this GPU (shared memory), retry with small ones; if nothing runs, "auto" keeps the
        torch path instead of failing the stage."""
        from runner.kernels.snac import SAFE_TILES

        candidates = [self.fused.tiles] + ([] if tiles_given or self.fused.tiles == SAFE_TILES else [SAFE_TILES])
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        codes = torch.zeros(1, 1, 7, dtype=torch.int64, device=self.device)
        for tiles in candidates:
            self.fused.tiles = tiles
            try:
                self._decode_fused(codes, zero, zero)
                return
            except Exception as e:  # triton's OutOfResources, compiler errors, ...
                err = e
                _log.error("fused SNAC decoder with %s failed on %s: %s: %s", tiles, self.device, type(e).__name__, e)
        if required:
            raise err
        _log.error("fused SNAC decoder unusable; using the torch path")
        self.fused = None

    def decode(self, codes: torch.Tensor, window_start: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """codes (B, W, 7) long; window_start, seeds (B,) long -> float audio (B, W * spf).

        Output sample i of row b is absolute sample window_start[b] * spf + i (all SNAC
        decoder layers are length-preserving 'same' convs or exact x-stride upsamplers).
        The decoder ends in tanh, so values lie in [-1, 1].
        """
        return self._decode(codes, window_start, seeds)

    @torch.inference_mode()
    def _decode_fused(self, codes: torch.Tensor, window_start: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        return self.fused.decode(codes, window_start, seeds)

    @torch.inference_mode()
    def decode_torch(self, codes: torch.Tensor, window_start: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """The torch path (the reference the fused kernels are tested against)."""
        z = self.model.quantizer.from_codes(frames_to_levels(codes))  # (B, latent, 4W)
        x = z.to(self.dtype)
        block = 0
        for layer in self.model.decoder.model:
            if not isinstance(layer, DecoderBlock):
                x = layer(x)
                continue
            rate = self._block_rates[block]
            for sub in layer.block:
                if isinstance(sub, NoiseBlock):
                    noise = positional_noise(seeds, block, window_start * rate, x.shape[-1]).to(x.dtype)
                    x = x + noise * sub.linear(x)  # NoiseBlock.forward with positional noise
                else:
                    x = sub(x)
            block += 1
        return x[:, 0, :]  # (B, W * spf)

    def decode_jobs(self, windows: list[np.ndarray], jobs: list[WindowJob], seeds: list[int]) -> list[np.ndarray]:
        """Decode equal-length windows in one call; return each job's emitted int16 PCM.

        windows[i]: (W, 7) codes of jobs[i]'s window. Float results of a row do not depend
        on the other rows except through kernel choice/blocking for a different batch size,
        i.e. float rounding: after int16 rounding that is at most 1 LSB, and sample counts
        are always exact.
        """
        return self.launch_jobs(windows, jobs, seeds).get()

    def launch_jobs(self, windows: list[np.ndarray], jobs: list[WindowJob], seeds: list[int]) -> "PendingPCM":
        """Start decoding; on CUDA the work runs on the codec's own stream and lands in pinned
        host memory, so neither the model's stream nor the host waits for it here. The whole
        (B, W * spf) int16 block is copied and each job's emitted part is cut on the host: one
        copy instead of a device slice per window (host time grows with the batch otherwise)."""
        cuts = [j.emit_slice(self.samples_per_frame) for j in jobs]
        if self.stream is None:
            codes = torch.from_numpy(np.stack(windows)).to(self.device)
            starts = torch.tensor([j.window_start for j in jobs], dtype=torch.int64, device=self.device)
            seed_t = torch.tensor(seeds, dtype=torch.int64, device=self.device)
            pcm = float_to_s16(self.decode(codes, starts, seed_t)).cpu()  # (B, W * spf) int16
            return PendingPCM(pcm, cuts, None)
        with torch.cuda.stream(self.stream):
            # inputs come from the host only: no dependency on the model's stream
            # rows padded to an even length: meta[1] then starts 16-byte aligned for any batch
            # size, so Triton keeps one pointer specialisation (an odd batch compiled a second)
            n, w = len(jobs), windows[0].shape[0]
            pad = [0] * (n % 2)
            staging = staging_for(self.device)  # the runner's pinned ring: no pinned block per copy
            meta = staging.to_device(np.array([[j.window_start for j in jobs] + pad, list(seeds) + pad], dtype=np.int64))
            codes = staging.to_device(np.stack(windows))
            # the PCM stays here until the stage collects it (steps later): a block of its own
            host = torch.empty((n, w * self.samples_per_frame), dtype=torch.int16, pin_memory=True)
            if self.graphs is not None and w in self.graphs.window_lengths:
                self.graphs.run(codes, meta, host)
            else:
                host.copy_(float_to_s16(self.decode(codes, meta[0, :n], meta[1, :n])), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return PendingPCM(host, cuts, event)


@dataclass
class PendingPCM:
    """PCM of one batched decode, possibly still being computed and copied to the host."""

    host: torch.Tensor  # (B, W * spf) int16 on the host
    cuts: list[tuple[int, int]]  # emitted samples [lo, hi) of each row
    event: "torch.cuda.Event | None"

    @property
    def ready(self) -> bool:
        """The copy has landed (get() will not wait)."""
        return self.event is None or self.event.query()

    def get(self) -> list[np.ndarray]:
        if self.event is not None:
            self.event.synchronize()
        pcm = self.host.numpy()
        return [pcm[i, lo:hi] for i, (lo, hi) in enumerate(self.cuts)]


def offline_decode(decoder: SnacWindowDecoder, codes: np.ndarray, policy: WindowPolicy, seed: int = 0) -> np.ndarray:
    """The reference: the window rule over the complete (n, 7) code sequence, one window at a time."""
    codes = np.asarray(codes, dtype=np.int64)
    out = [np.zeros(0, dtype=np.int16)]
    for job in plan_offline(policy, codes.shape[0]):
        out += decoder.decode_jobs([codes[job.window_start : job.window_end]], [job], [seed])
    return np.concatenate(out)


# ---------------------------------------------------------------- the stage


@dataclass
class StageResult:
    pcm: np.ndarray  # int16 mono samples emitted this step, in order (may be empty)
    done: bool  # the stage has finished with this key and forgotten it
    error: str | None = None  # why the request's audio failed (done is then True)


@dataclass
class _Request:
    cursor: FrameCursor
    seed: int
    codes: np.ndarray  # (capacity, 7) int64; rows [0, n_frames) are complete frames
    n_frames: int = 0
    partial: list[int] = field(default_factory=list)  # codes of the incomplete frame
    audio_index: int = 0  # audio tokens accepted so far
    ended: bool = False  # end token seen or close() called: no more frames
    error: str | None = None


class CodecStage:
    """Streams PCM for many requests, decoding ready windows in batched SNAC calls."""

    def __init__(self, cfg: CodecConfig, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.cfg = cfg
        # graphs for the window lengths of an unbounded stream (a stream's last window is eager)
        lengths = tuple(sorted({j.window_frames for j in plan_offline(cfg.policy, 64 * cfg.policy.max_window_frames)[:-1]}))
        self.decoder = SnacWindowDecoder(load_snac(cfg, device, dtype), cfg.samples_per_frame, cfg.kernels,
                                         cfg.matmul_precision, graph_windows=lengths if cfg.cuda_graphs else (),
                                         graph_max_rows=cfg.max_batch_windows)
        self._reqs: dict[object, _Request] = {}
        # launched batches in launch order: (key, job) per window, the windows' _Request
        # objects, and the PCM on its way
        self._pending: list[tuple[list[tuple[object, WindowJob]], list[_Request], PendingPCM]] = []
        self._inflight: Counter = Counter()  # queued or launched, not yet collected, windows per key
        self._num_inflight = 0  # windows launched and not collected (sum over _pending)
        # ready windows not launched yet, by window length: (key, job, request, step queued);
        # _inflight counts them too, so a request is not done while one waits here
        self._queued: dict[int, list[tuple[object, WindowJob, _Request, int]]] = defaultdict(list)
        self._step_no = 0
        # CUDA: launches run on the decoder's stream and are collected by later step() calls;
        # CPU: a launch has finished when it returns (chosen once, here)
        self.asynchronous = self.decoder.stream is not None
        # keys whose frame count, end or error changed since the last step(): only they can
        # have new windows or be done (most requests complete a frame every 7th token)
        self._dirty: set = set()

    # -- request lifecycle -------------------------------------------------------------

    def open(self, key: object, seed: int | None = None) -> None:
        """A request that wants audio starts; `seed` overrides cfg.noise_seed for it."""
        if key in self._reqs:
            raise KeyError(f"codec request {key!r} is already open")
        self._reqs[key] = _Request(
            cursor=FrameCursor(self.cfg.policy),
            seed=self.cfg.noise_seed if seed is None else seed,
            codes=np.zeros((64, self.cfg.tokens_per_frame), dtype=np.int64),
        )

    def push(self, key: object, token_ids: list[int]) -> None:
        """Newly sampled tokens of a request. The end token finishes its stream and later
        tokens are ignored; so are tokens for unknown keys (a late output after abort)."""
        self.push_many([(key, tok) for tok in token_ids])

    def push_many(self, items: list[tuple[object, int]]) -> None:
        """push() for many requests in one call: (key, token) pairs, in order within a key (the
        engine hands over each step's tokens of all its audio requests at once)."""
        cfg, reqs, dirty = self.cfg, self._reqs, self._dirty
        end, per_frame = cfg.end_token_id, cfg.tokens_per_frame
        for key, tok in items:
            req = reqs.get(key)
            if req is None or req.ended or req.error is not None:
                continue
            tok = int(tok)
            if tok == end:
                req.ended = True
                dirty.add(key)
                continue
            lo, hi = audio_token_range(cfg, req.audio_index)
            if not lo <= tok < hi:
                req.error = invalid_token_reason(cfg, tok, req.audio_index)
                dirty.add(key)
                continue
            partial = req.partial
            partial.append(tok - lo)
            req.audio_index += 1
            if len(partial) == per_frame:
                if req.n_frames == req.codes.shape[0]:
                    req.codes = np.concatenate([req.codes, np.zeros_like(req.codes)])  # amortised growth
                req.codes[req.n_frames] = partial
                req.n_frames += 1
                req.partial = []
                dirty.add(key)

    def close(self, key: object) -> None:
        """The request finished (stop/length): remaining frames become ready with truncated
        right context; an incomplete trailing frame is dropped. Unknown keys are ignored."""
        req = self._reqs.get(key)
        if req is not None:
            req.ended = True
            self._dirty.add(key)

    def abort(self, key: object) -> None:
        """Drop all state of the request; nothing more is emitted for it (its windows in flight
        are dropped when they land)."""
        self._reqs.pop(key, None)
        self._inflight.pop(key, None)

    def allowed_token_range(self, num_audio_tokens: int) -> tuple[int, int]:
        """[lo, hi) of valid ids for the next audio token after `num_audio_tokens` audio
        tokens; the end token (cfg.end_token_id) is also valid and lies outside it."""
        return audio_token_range(self.cfg, num_audio_tokens)

    def __contains__(self, key: object) -> bool:
        return key in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    # -- decoding ----------------------------------------------------------------------

    def step(self, wait: bool = False) -> dict[object, StageResult]:
        """Queue the windows that became ready, launch queued windows batched by window length
        (first chunks first, for time to first audio), and collect the PCM of launched windows
        that have finished. Returns results for keys with news (PCM, completion or error); keys
        reported done are forgotten.

        On the CPU everything ready is launched and, the launch being synchronous, returned by
        the same call. On CUDA the decode runs on the codec's stream, overlapping the model's
        steps; a step launches at most cfg.max_launches_per_step lengths (see CodecConfig) and a
        window's PCM is returned by the first call after it has landed: the host never waits for
        the codec unless `wait` (the caller has nothing else to do: everything is launched and
        collected) or more than cfg.max_inflight_windows are in flight."""
        results: dict[object, StageResult] = {}
        pieces: dict[object, list[tuple[int, np.ndarray]]] = defaultdict(list)
        self._step_no += 1
        dirty, self._dirty = self._dirty, set()
        for key in dirty:
            req = self._reqs.get(key)
            if req is not None and req.error is None:
                for job in req.cursor.ready(req.n_frames, req.ended):
                    self._queued[job.window_frames].append((key, job, req, self._step_no))
                    self._inflight[key] += 1
        step_max = self.cfg.max_batch_windows
        for length in self._lengths_to_launch(wait or not self.asynchronous):
            # by identity: a request aborted (or failed) since its window was queued is skipped
            items = [it for it in self._queued.pop(length) if self._reqs.get(it[0]) is it[2] and it[2].error is None]
            for i in range(0, len(items), step_max):
                part = items[i : i + step_max]
                batch = [(key, job) for key, job, _, _ in part]
                reqs = [req for _, _, req, _ in part]
                windows = [r.codes[j.window_start : j.window_end] for r, (_, j) in zip(reqs, batch)]
                pending = self.decoder.launch_jobs(windows, [j for _, j in batch], [r.seed for r in reqs])
                self._pending.append((batch, reqs, pending))
                self._num_inflight += len(batch)
        # after the launches: the in-flight bound then holds when step() returns
        touched = self._collect(pieces, wait or not self.asynchronous)

        for key, parts in pieces.items():
            if len(parts) == 1:  # the common case: a copy (the PCM must not pin its launch's block)
                pcm = parts[0][1].copy()
            else:
                parts.sort(key=lambda t: t[0])  # chunk order; groups were decoded in any order
                pcm = np.concatenate([p for _, p in parts])
            results[key] = StageResult(pcm, done=False)
        for key in dirty | touched:  # only these can have become done or failed
            req = self._reqs.get(key)
            if req is None:
                continue
            if req.error is not None:
                results[key] = StageResult(np.zeros(0, dtype=np.int16), done=True, error=req.error)
            elif not (req.cursor.finished and self._inflight.get(key, 0) == 0):
                continue
            res = results.setdefault(key, StageResult(np.zeros(0, dtype=np.int16), done=True))
            res.done = True
            del self._reqs[key]
            self._inflight.pop(key, None)
        return results

    def _lengths_to_launch(self, everything: bool) -> list[int]:
        """Window lengths whose queued windows launch now, first chunks first: every length when
        `everything`; else those holding a first chunk or a window queued max_defer_steps ago,
        topped up with the fullest others to max_launches_per_step."""
        if everything:
            return sorted(self._queued, key=lambda n: min(j.chunk_index for _, j, _, _ in self._queued[n]))
        oldest = self._step_no - self.cfg.max_defer_steps
        urgent, rest = [], []
        for n, items in self._queued.items():
            first = min(j.chunk_index for _, j, _, _ in items)
            (urgent if first == 0 or items[0][3] <= oldest else rest).append((first, n))
        urgent.sort()
        rest.sort(key=lambda fn: -len(self._queued[fn[1]]))
        room = max(0, self.cfg.max_launches_per_step - len(urgent))
        return [n for _, n in urgent] + [n for _, n in rest[:room]]

    @property
    def num_inflight(self) -> int:
        """Windows launched and not yet collected."""
        return self._num_inflight

    def _collect(self, pieces: dict[object, list[tuple[int, np.ndarray]]], wait: bool) -> set:
        """PCM of finished launches into `pieces` (of all launches if `wait`, and of the oldest
        ones while too many windows are in flight); returns the keys collected. Launches run in
        order on one stream, so the finished ones are a prefix of the list."""
        done = 0
        inflight = self._num_inflight
        for batch, _, p in self._pending:
            if not (wait or inflight > self.cfg.max_inflight_windows or p.ready):
                break
            inflight -= len(batch)
            done += 1
        collect, self._pending = self._pending[:done], self._pending[done:]
        self._num_inflight = inflight
        keys = set()
        for batch, reqs, p in collect:
            for (key, job), req, pcm in zip(batch, reqs, p.get()):
                # by identity: an aborted request's key may belong to a newer request by now
                if self._reqs.get(key) is req:
                    self._inflight[key] -= 1
                    keys.add(key)
                    if req.error is None:
                        pieces[key].append((job.chunk_index, pcm))
        return keys
