"""The codec stage's configuration (CodecConfig) and its error type, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.codecs.orpheus_tokens import FRAME_WIDTH
from runner.kernels.tuning.tiles import MATMUL_PRECISIONS
from streaming.audio import WindowPolicy
from streaming.profile import (
    ORPHEUS_AUDIO_TOKEN_OFFSET,
    ORPHEUS_CODEBOOK_SIZE,
    ORPHEUS_END_OF_SPEECH,
    ORPHEUS_SAMPLE_RATE,
)

KERNEL_CHOICES = ("auto", "torch", "triton")


class CodecError(ValueError):
    """The codec folder or configuration is unusable; the message names the field."""


@dataclass(frozen=True)
class CodecConfig:
    path: str  # local SNAC folder: config.json + pytorch_model.bin (or model.safetensors)
    # the Orpheus layout's defaults are the profile's (streaming/profile.py), stated there once
    audio_token_offset: int = ORPHEUS_AUDIO_TOKEN_OFFSET
    codebook_size: int = ORPHEUS_CODEBOOK_SIZE
    end_token_id: int = ORPHEUS_END_OF_SPEECH
    tokens_per_frame: int = FRAME_WIDTH
    sample_rate: int = ORPHEUS_SAMPLE_RATE
    samples_per_frame: int = 2048
    policy: WindowPolicy = field(default_factory=WindowPolicy)
    noise_seed: int = 0  # default seed of the positional decoder noise (runner/codecs/noise.py)
    max_batch_windows: int = 128  # windows per SNAC call; bounds activation memory
    # Launched windows whose PCM has not been collected yet. Collection does not wait for the
    # codec stream (the model keeps stepping meanwhile) unless more than this many are in
    # flight: a bound on the backlog and its pinned host buffers when the codec falls behind.
    max_inflight_windows: int = 2048
    # CUDA: each SNAC call costs ~1 ms of host time whatever its batch, and streams that started
    # at different times have windows of several lengths ready at every step (64-256 streams
    # arriving over 2 s: several ms of codec host time per step). So a step launches at most
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
    # (1 product, 1/3 of the matmul time, up to ~26 LSB in CPU emulation, ~100 on the GPU) or "ieee" (FMA, slow).
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
        if self.tokens_per_frame != FRAME_WIDTH:
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
