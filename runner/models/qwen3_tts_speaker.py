"""Qwen3-TTS Base's speaker encoder: a 24 kHz clip -> its x-vector, the vector a voice-clone
prompt adds over its speaker position (docs/qwen3_tts.md §1, server/tts/qwen3_tts_prompt.py).

ECAPA-TDNN (Desplanques et al., 2020) as qwen-tts builds it (M:95-393): a TDNN, SE-Res2Net
blocks, multi-layer feature aggregation, attentive statistics pooling and a 1x1 projection to
the talker's width; every conv 'same'-padded by reflection. Its input is a log-mel spectrogram
(M:399-465): reflect padding of (n_fft - hop) / 2, a Hann STFT without centring, magnitudes,
slaney mel filters (transformers.audio_utils.mel_filter_bank, librosa's filters) and a log
clamped at 1e-5. Module names follow the checkpoint's `speaker_encoder.*` tensors, so the
folder's state dict loads as is.

Runs once per voice upload (never per request), in float32 whatever the talker's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers.audio_utils import mel_filter_bank

from runner.config import ConfigError
from runner.models.loader import LoadError, find_safetensors

PREFIX = "speaker_encoder."


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """config.json's `speaker_encoder_config` (the reference's defaults where a key is absent)."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000
    # the mel front end (fixed in the reference's extract_speaker_embedding)
    n_fft: int = 1024
    hop: int = 256
    fmax: float = 12000.0

    @staticmethod
    def from_dict(raw: dict) -> SpeakerEncoderConfig:
        known = {"mel_dim", "enc_dim", "enc_channels", "enc_kernel_sizes", "enc_dilations", "enc_attention_channels",
                 "enc_res2net_scale", "enc_se_channels", "sample_rate"}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in known}
        cfg = SpeakerEncoderConfig(**kw)
        n = len(cfg.enc_channels)
        if n < 3 or len(cfg.enc_kernel_sizes) != n or len(cfg.enc_dilations) != n:
            raise ConfigError("model config: speaker_encoder_config.enc_channels, enc_kernel_sizes and enc_dilations "
                              f"must have one length of at least 3 (got {n}, {len(cfg.enc_kernel_sizes)}, "
                              f"{len(cfg.enc_dilations)})")
        if any(c % cfg.enc_res2net_scale for c in cfg.enc_channels[1:-1]):
            raise ConfigError(f"model config: speaker_encoder_config.enc_channels {list(cfg.enc_channels)} are not "
                              f"multiples of enc_res2net_scale {cfg.enc_res2net_scale}")
        return cfg


def _conv(cin: int, cout: int, k: int = 1, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(cin, cout, k, dilation=dilation, padding="same", padding_mode="reflect")


class TimeDelayNetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, dilation: int):
        super().__init__()
        self.conv = _conv(cin, cout, k, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Channels in `scale` groups; group i > 0 runs a TDNN over itself plus group i - 1's output."""

    def __init__(self, channels: int, scale: int, k: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(TimeDelayNetBlock(channels // scale, channels // scale, k, dilation)
                                    for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0]]
        for i, block in enumerate(self.blocks, start=1):
            out.append(block(parts[i] if i == 1 else parts[i] + out[-1]))
        return torch.cat(out, dim=1)


class SqueezeExcitationBlock(nn.Module):
    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = _conv(channels, se_channels)
        self.conv2 = _conv(se_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))


class SqueezeExcitationRes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se_channels: int, k: int, dilation: int):
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(cin, cout, 1, 1)
        self.res2net_block = Res2NetBlock(cout, scale, k, dilation)
        self.tdnn2 = TimeDelayNetBlock(cout, cout, 1, 1)
        self.se_block = SqueezeExcitationBlock(cout, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _mean_std(x: torch.Tensor, weights: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean and std over time: x [B, C, T], weights [B, C or 1, T] summing to 1 over T."""
    mean = (weights * x).sum(2)
    std = torch.sqrt((weights * (x - mean[..., None]).pow(2)).sum(2).clamp(eps))
    return mean, std


class AttentiveStatisticsPooling(nn.Module):
    """[B, C, T] -> [B, 2C, 1]: mean and std over time under a per-channel softmax attention
    that sees each frame beside the clip's global mean and std (every frame is valid: one clip)."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        mean, std = _mean_std(x, x.new_full((1, 1, t), 1.0 / t))
        context = torch.cat([x, mean[..., None].expand_as(x), std[..., None].expand_as(x)], dim=1)
        attention = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _mean_std(x, attention)
        return torch.cat([mean, std], dim=1)[..., None]


class SpeakerEncoder(nn.Module):
    def __init__(self, cfg: SpeakerEncoderConfig):
        super().__init__()
        self.cfg = cfg
        ch, ks, dil = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        self.blocks = nn.ModuleList([TimeDelayNetBlock(cfg.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(SqueezeExcitationRes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale,
                                                             cfg.enc_se_channels, ks[i], dil[i]))
        self.mfa = TimeDelayNetBlock(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatisticsPooling(ch[-1], cfg.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, cfg.enc_dim)
        mel = mel_filter_bank(num_frequency_bins=cfg.n_fft // 2 + 1, num_mel_filters=cfg.mel_dim, min_frequency=0.0,
                              max_frequency=cfg.fmax, sampling_rate=cfg.sample_rate, norm="slaney", mel_scale="slaney")
        self.register_buffer("mel_filters", torch.from_numpy(mel.T.astype(np.float32)), persistent=False)
        self.register_buffer("window", torch.hann_window(cfg.n_fft), persistent=False)

    def log_mel(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [N] float in [-1, 1] at cfg.sample_rate -> [frames, mel_dim] log-mel."""
        n_fft, hop = self.cfg.n_fft, self.cfg.hop
        pad = (n_fft - hop) // 2
        if wav.shape[-1] <= pad:
            raise ValueError(f"audio: {wav.shape[-1]} samples is too short for a speaker embedding (more than {pad} "
                             "needed)")
        wav = F.pad(wav[None, None], (pad, pad), mode="reflect")[0]
        spec = torch.stft(wav, n_fft, hop_length=hop, win_length=n_fft, window=self.window, center=False,
                          normalized=False, onesided=True, return_complex=True)
        mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)  # [1, bins, frames]
        return torch.log(torch.clamp(self.mel_filters @ mag, min=1e-5))[0].T

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [B, frames, mel_dim] -> x-vectors [B, enc_dim]."""
        x = mel.transpose(1, 2)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(x))[..., 0]

    @torch.inference_mode()
    def embed(self, pcm: np.ndarray) -> np.ndarray:
        """A clip (int16 or float mono at cfg.sample_rate) -> its x-vector [enc_dim] float32."""
        wav = torch.as_tensor(pcm, device=self.mel_filters.device)
        wav = wav.float() / 32768.0 if wav.dtype == torch.int16 else wav.float()
        return self(self.log_mel(wav)[None])[0].cpu().numpy()


def load_speaker_encoder(path: str | Path, raw_config: dict, device: torch.device | str = "cpu") -> SpeakerEncoder:
    """The folder's speaker encoder (`speaker_encoder_config` of its config.json, the
    `speaker_encoder.*` tensors of its safetensors), float32 on `device`. LoadError names the
    tensors that are missing or unexpected."""
    if "speaker_encoder_config" not in raw_config:
        raise ConfigError(f"model config: {str(path)!r} has no speaker_encoder_config (not a Base folder)")
    model = SpeakerEncoder(SpeakerEncoderConfig.from_dict(raw_config["speaker_encoder_config"]))
    state = {}
    for file in find_safetensors(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(PREFIX):
                    state[name[len(PREFIX):]] = f.get_tensor(name).float()
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise LoadError(f"speaker encoder of {str(path)!r}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise LoadError(f"speaker encoder of {str(path)!r}: {PREFIX}{name} is {tuple(t.shape)}, expected "
                            f"{tuple(expected[name].shape)}")
    model.load_state_dict(state)
    return model.eval().to(device)
