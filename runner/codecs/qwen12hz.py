"""Qwen3-TTS's 12 Hz codec (tokenizer v2) decoder as a streaming decoder: frames of 16 codes ->
float PCM at 24 kHz, 1920 samples a frame, per-stream state.

The reference is qwen-tts's Qwen3TTSTokenizerV2Decoder (docs/qwen3_tts.md §3), which needs
transformers 4.57; this module runs the same arithmetic from the folder's tensors
(runner/codecs/qwen12hz_loader.py), frame-rate first, then audio-rate:

  codes (B, K, m) -> one gather-sum over the pre-projected codebooks -> (B, codebook_dim, m)
  -> causal conv k3 -> transformer (input Linear, layers of RMSNorm / RoPE attention over a
  window / SwiGLU with layer scales, RMSNorm, output Linear) -> (B, latent, m)
  -> per upsampling ratio r: transposed conv (k = s = r), ConvNeXt (causal depthwise k7,
  LayerNorm, MLP, gamma) -> causal conv k7 -> per upsample rate r: SnakeBeta, transposed conv
  (2r, r), 3 residual units (Snake, causal conv k7 dilation 1/3/9, Snake, conv k1)
  -> SnakeBeta, causal conv k7 -> clamp(-1, 1) -> (B, 1, m * 1920).

Every conv pads left only and every transposed conv trims right, the transformer is causal with
a window: a stream decoded chunk by chunk equals the decode of the whole sequence, with the state
of runner/codecs/streaming_state.py (conv context, transposed-conv cut, ring KV). The reference
`decode` itself cuts sequences longer than 300 frames into chunks with 25 frames of left
context; there it differs from this (un-chunked) decode, so parity is tested up to 300 frames.
Equal to the reference up to float rounding (the codebooks are summed after their projection,
other matmul / conv shapes): tests/codecs/test_qwen12hz.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from runner.codecs.config import CodecError
from runner.codecs.qwen12hz_loader import Qwen12HzConfig, load_decoder_tensors, read_config
from runner.codecs.streaming_state import StatefulConv, StreamingDecoderBase

_CODEBOOK_EPS = 1e-5  # EuclideanCodebook: embedding_sum / cluster_usage.clamp(min=eps)
_SNAKE_EPS = 1e-9  # SnakeBeta.no_div_by_zero
_CONVNEXT_EPS = 1e-6  # its LayerNorm's


class _Snake:
    """SnakeBeta: x + 1 / (exp(beta) + eps) * sin(x * exp(alpha))^2, per channel of x (B, C, n);
    the exponentials precomputed (the same float32 values the reference computes per call)."""

    def __init__(self, alpha: torch.Tensor, beta: torch.Tensor) -> None:
        self.alpha = alpha.exp()[None, :, None]  # (1, C, 1)
        self.inv_beta = 1.0 / (beta.exp()[None, :, None] + _SNAKE_EPS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inv_beta * torch.pow(torch.sin(x * self.alpha), 2)


@dataclass
class _ConvNeXt:
    dwconv: StatefulConv  # causal depthwise k7
    norm: tuple[torch.Tensor, torch.Tensor]  # LayerNorm weight, bias
    pw1: tuple[torch.Tensor, torch.Tensor]  # Linear (4C, C)
    pw2: tuple[torch.Tensor, torch.Tensor]  # Linear (C, 4C)
    gamma: torch.Tensor  # (C,)


@dataclass
class _ResidualUnit:
    act1: _Snake
    conv1: StatefulConv  # causal k7, dilation 1 / 3 / 9
    act2: _Snake
    conv2: StatefulConv  # k1: no state


@dataclass
class _Layer:
    """A decoder transformer layer's tensors (Linear weights (out, in), no biases)."""

    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    attn_scale: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    mlp_scale: torch.Tensor
    keys: int  # the state pools of its ring: (S, window, kv_heads, head_dim)
    values: int


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Qwen12HzStreamingDecoder(StreamingDecoderBase):
    """Decodes the next frames of many streams in one call; each stream holds a slot of state
    (runner/codecs/streaming_state.py: new_stream / free, decode / launch, CUDA stream order)."""

    name = "Qwen3-TTS 12 Hz"

    def __init__(self, cfg: Qwen12HzConfig, tensors: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype = torch.float32, max_streams: int = 1024, initial_streams: int = 8) -> None:
        super().__init__(device, dtype, cfg.sliding_window, max_streams)
        self.config = cfg
        self.num_codebooks = cfg.num_quantizers
        self.codebook_size = cfg.codebook_size
        self.sample_rate = cfg.sample_rate
        self.samples_per_frame = cfg.samples_per_frame
        t = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        self._init_quantizer(tensors)
        self._pre_conv = self._causal(t, "pre_conv")
        self._init_transformer(t)
        self._upsample = [(self._transposed(t, f"upsample.{i}.0", r), self._convnext(t, f"upsample.{i}.1"))
                          for i, r in enumerate(cfg.upsampling_ratios)]
        self._first = self._causal(t, "decoder.0")
        self._blocks = []  # per upsample rate: Snake, transposed conv (2r, r), 3 residual units
        for i, r in enumerate(cfg.upsample_rates):
            p = f"decoder.{i + 1}.block."
            units = [_ResidualUnit(self._snake(t, f"{p}{j + 2}.act1"), self._causal(t, f"{p}{j + 2}.conv1", dilation=d),
                                   self._snake(t, f"{p}{j + 2}.act2"), self._causal(t, f"{p}{j + 2}.conv2"))
                     for j, d in enumerate((1, 3, 9))]
            self._blocks.append((self._snake(t, f"{p}0"), self._transposed(t, f"{p}1", r), units))
        n = len(cfg.upsample_rates)
        self._last_act = self._snake(t, f"decoder.{n + 1}")
        self._last = self._causal(t, f"decoder.{n + 2}")
        self._start(initial_streams)

    # -- building ------------------------------------------------------------------------

    def _init_quantizer(self, tensors: dict[str, torch.Tensor]) -> None:
        """One table [K * C, codebook_dim]: codebook g's rows (embedding_sum / usage) through its
        group's 1x1 output conv (rvq_first for g = 0, rvq_rest for the others). The reference
        sums the acoustic codebooks first and projects the sum: the same value by linearity.
        Built in float64, then rounded once."""
        cfg, rows = self.config, []
        for g in range(cfg.num_quantizers):
            group, i = ("rvq_first", 0) if g == 0 else ("rvq_rest", g - 1)
            p = f"quantizer.{group}."
            emb = tensors[p + f"vq.layers.{i}._codebook.embedding_sum"].double()  # (C, D/2)
            usage = tensors[p + f"vq.layers.{i}._codebook.cluster_usage"].double()  # (C,)
            proj = tensors[p + "output_proj.weight"].double()[:, :, 0]  # (D, D/2)
            rows.append((emb / usage.clamp(min=_CODEBOOK_EPS)[:, None]) @ proj.T)  # (C, D)
        self._codebooks = torch.cat(rows).to(device=self.device, dtype=self.dtype)  # (K * C, D)
        self._code_offsets = (torch.arange(cfg.num_quantizers, device=self.device) * cfg.codebook_size)[None, :, None]

    def _causal(self, t: dict[str, torch.Tensor], name: str, dilation: int = 1, groups: int = 1) -> StatefulConv:
        w, b = t[f"{name}.conv.weight"], t[f"{name}.conv.bias"]  # (out, in / groups, k)
        conv = nn.Conv1d(w.shape[1] * groups, w.shape[0], w.shape[2], dilation=dilation, groups=groups,
                         device="meta")
        conv.weight, conv.bias = nn.Parameter(w, requires_grad=False), nn.Parameter(b, requires_grad=False)
        return self._stateful_conv(conv, transposed=False)

    def _transposed(self, t: dict[str, torch.Tensor], name: str, stride: int) -> StatefulConv:
        w, b = t[f"{name}.conv.weight"], t[f"{name}.conv.bias"]  # (in, out, k)
        conv = nn.ConvTranspose1d(w.shape[0], w.shape[1], w.shape[2], stride=stride, device="meta")
        conv.weight, conv.bias = nn.Parameter(w, requires_grad=False), nn.Parameter(b, requires_grad=False)
        return self._stateful_conv(conv, transposed=True)

    @staticmethod
    def _snake(t: dict[str, torch.Tensor], name: str) -> _Snake:
        return _Snake(t[f"{name}.alpha"], t[f"{name}.beta"])

    def _convnext(self, t: dict[str, torch.Tensor], p: str) -> _ConvNeXt:
        dim = t[f"{p}.gamma"].shape[0]
        return _ConvNeXt(self._causal(t, f"{p}.dwconv", groups=dim), (t[f"{p}.norm.weight"], t[f"{p}.norm.bias"]),
                         (t[f"{p}.pwconv1.weight"], t[f"{p}.pwconv1.bias"]),
                         (t[f"{p}.pwconv2.weight"], t[f"{p}.pwconv2.bias"]), t[f"{p}.gamma"])

    def _init_transformer(self, t: dict[str, torch.Tensor]) -> None:
        cfg, p = self.config, "pre_transformer."
        self._in_proj = (t[p + "input_proj.weight"], t[p + "input_proj.bias"])
        self._out_proj = (t[p + "output_proj.weight"], t[p + "output_proj.bias"])
        self._final_norm = t[p + "norm.weight"]
        ring = (cfg.sliding_window, cfg.num_key_value_heads, cfg.head_dim)
        self._layers = []
        for i in range(cfg.num_hidden_layers):
            q = f"{p}layers.{i}."
            self._layers.append(_Layer(
                t[q + "input_layernorm.weight"], t[q + "self_attn.q_proj.weight"], t[q + "self_attn.k_proj.weight"],
                t[q + "self_attn.v_proj.weight"], t[q + "self_attn.o_proj.weight"], t[q + "self_attn_layer_scale.scale"],
                t[q + "post_attention_layernorm.weight"], t[q + "mlp.gate_proj.weight"], t[q + "mlp.up_proj.weight"],
                t[q + "mlp.down_proj.weight"], t[q + "mlp_layer_scale.scale"], self._add_pool(ring),
                self._add_pool(ring)))
        # RoPE as the reference's default rope init: float32 inverse frequencies
        hd = cfg.head_dim
        self._inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=self.device)
                                                   .float() / hd))  # (hd / 2,)

    # -- decoding ------------------------------------------------------------------------

    def _decode_into(self, idx: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The decode of streams idx (B,) int64, codes (B, K, m) -> float PCM (B, m * 1920)."""
        if codes.shape[1] != self.num_codebooks:
            raise CodecError(f"codes: the codec decodes {self.num_codebooks} codebooks a frame, got {codes.shape[1]}")
        states = [p.index_select(0, idx) for p in self._pools]  # this batch's state, written back below
        x = F.embedding(codes + self._code_offsets, self._codebooks).sum(dim=1).transpose(1, 2)  # (B, D, m)
        x = self._run_conv(self._pre_conv, x, states)  # (B, latent, m)
        x = self._run_transformer(idx, x.transpose(1, 2), states).transpose(1, 2)
        for up, block in self._upsample:  # (B, latent, m * prod(ratios))
            x = self._run_convnext(block, self._run_conv(up, x, states), states)
        x = self._run_conv(self._first, x, states)  # (B, decoder_dim, ...)
        for act, up, units in self._blocks:
            x = self._run_conv(up, act(x), states)
            for u in units:
                x = x + self._run_conv(u.conv2, u.act2(self._run_conv(u.conv1, u.act1(x), states)), states)
        x = self._run_conv(self._last, self._last_act(x), states).clamp(min=-1, max=1)  # (B, 1, m * spf)
        for p, s in zip(self._pools, states):
            p.index_copy_(0, idx, s)
        return x[:, 0, :]

    def _run_convnext(self, c: _ConvNeXt, x: torch.Tensor, states: list[torch.Tensor]) -> torch.Tensor:
        h = self._run_conv(c.dwconv, x, states).transpose(1, 2)  # (B, n, C)
        h = F.layer_norm(h, h.shape[-1:], *c.norm, eps=_CONVNEXT_EPS)
        h = F.linear(F.gelu(F.linear(h, *c.pw1)), *c.pw2)
        return x + (c.gamma * h).transpose(1, 2)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # as the reference: the statistics in float32, the weight in x's dtype
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _run_transformer(self, idx: torch.Tensor, x: torch.Tensor, states: list[torch.Tensor]) -> torch.Tensor:
        """The pre-transformer over the new frames x (B, n, latent), each row continuing its stream:
        RoPE at absolute positions, attention over the ring + new keys -> (B, n, latent)."""
        cfg = self.config
        b, n = x.shape[:2]
        pos, mask, ring_pos = self._attention_window(idx, n)  # pos (B, n), mask (B, 1, n, window + n)
        freqs = pos.float()[:, :, None] * self._inv_freq  # (B, n, hd / 2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, n, hd)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        keep = self._ring_keep(n)
        h = F.linear(x, *self._in_proj)  # (B, n, hidden)
        for layer in self._layers:
            a = self._rms_norm(h, layer.input_norm)
            qs = F.linear(a, layer.q).view(b, n, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
            ks = F.linear(a, layer.k).view(b, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
            vs = F.linear(a, layer.v).view(b, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
            qs, ks = qs * cos + _rotate_half(qs) * sin, ks * cos + _rotate_half(ks) * sin
            keys = torch.cat([states[layer.keys].transpose(1, 2), ks], dim=2)  # (B, kv_heads, window + n, hd)
            vals = torch.cat([states[layer.values].transpose(1, 2), vs], dim=2)
            out = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=cfg.head_dim**-0.5,
                                                 enable_gqa=True)  # (B, heads, n, hd)
            h = h + layer.attn_scale * F.linear(out.transpose(1, 2).reshape(b, n, -1), layer.o)
            m = self._rms_norm(h, layer.post_norm)
            h = h + layer.mlp_scale * F.linear(F.silu(F.linear(m, layer.gate)) * F.linear(m, layer.up), layer.down)
            self._ring_write(states[layer.keys], ks[:, :, n - keep :], pos[:, n - keep :])
            self._ring_write(states[layer.values], vs[:, :, n - keep :], pos[:, n - keep :])
        self._advance_ring(idx, pos, ring_pos)
        return F.linear(self._rms_norm(h, self._final_norm), *self._out_proj)


def load_qwen12hz_decoder(path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32,
                          max_streams: int = 1024, initial_streams: int = 8) -> Qwen12HzStreamingDecoder:
    """The streaming decoder of the 12 Hz tokenizer at `path` (its folder, or a model folder holding
    speech_tokenizer/)."""
    cfg = read_config(path)
    return Qwen12HzStreamingDecoder(cfg, load_decoder_tensors(path, cfg), device, dtype, max_streams, initial_streams)
