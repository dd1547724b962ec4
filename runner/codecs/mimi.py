"""Mimi (Sesame CSM's codec) as a streaming decoder: frames of K codes -> float PCM, per-stream state.

transformers' `MimiModel` is the implementation and the reference: this module runs its decoder
modules (quantizer, upsampling conv, transformer, SEANet) on the new frames of many streams at
once, carrying each stream's state between calls, so that a stream decoded chunk by chunk gives
the samples `MimiModel.decode` gives for the whole code sequence, each sample once.

Why state and not windows (as SNAC, streaming/audio.py): Mimi's decoder is causal end to end
(with `use_causal_conv`, constant padding and `trim_right_ratio` 1, checked at load), so a sample
depends only on its own and earlier frames; but its transformer attends `sliding_window` latent
steps back (250 = 10 s for the real model), so a window would need seconds of left context to
match the offline decode. transformers' decoder has no streaming state (`decode` takes a KV cache,
but its convolutions and transposed convolutions pad as if every call started the utterance), so
the state is kept per stream, in slot pools (runner/codecs/streaming_state.py: conv context,
transposed-conv cut, a ring of the last `sliding_window` keys / values).

Equal to the offline decode up to float rounding (other matmul and conv shapes), not bit-exact:
measured on the tiny test codec, max |difference| ~1e-6 of a unit-scale signal (tests/codecs/test_mimi.py).
Loading the codec (a Mimi folder or CSM's checkpoint) and its streaming checks: runner/codecs/mimi_loader.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import MimiModel
from transformers.models.mimi.modeling_mimi import (
    MimiConv1d,
    MimiConvTranspose1d,
    MimiResnetBlock,
    MimiTransformerModel,
    apply_rotary_pos_emb,
    repeat_kv,
)

from runner.codecs.config import CodecError
from runner.codecs.mimi_loader import decoder_modules
from runner.codecs.streaming_state import StatefulConv, StreamingDecoderBase


class MimiStreamingDecoder(StreamingDecoderBase):
    """Decodes the next frames of many streams in one call; each stream holds a slot of state
    (runner/codecs/streaming_state.py: pools, decode / launch, stream ordering on CUDA)."""

    name = "Mimi"

    def __init__(self, model: MimiModel, num_codebooks: int | None = None, max_streams: int = 1024,
                 initial_streams: int = 8) -> None:
        cfg = model.config
        p = next(model.parameters())
        super().__init__(p.device, p.dtype, int(cfg.sliding_window), max_streams)
        self.model = model
        self.config = cfg
        self.num_codebooks = cfg.num_quantizers if num_codebooks is None else num_codebooks
        if not cfg.num_semantic_quantizers <= self.num_codebooks <= cfg.num_quantizers:
            raise CodecError(f"num_codebooks: the codec decodes {cfg.num_semantic_quantizers}..{cfg.num_quantizers} "
                             f"codebooks, got {self.num_codebooks}")
        self.codebook_size = int(cfg.codebook_size)
        self.sample_rate = int(cfg.sampling_rate)
        upsample, transformer, seanet = decoder_modules(model)
        self.upsample_stride = int(upsample.conv.stride[0]) if upsample is not None else 1
        self.samples_per_frame = self.upsample_stride * math.prod(cfg.upsampling_ratios)
        self._upsample = self._conv(upsample, transposed=True) if upsample is not None else None
        self._transformer: MimiTransformerModel = transformer
        tf = cfg
        self._kv_pools = []  # per layer: keys, values (S, window, kv_heads, head_dim)
        for _ in self._transformer.layers:
            self._kv_pools.append((self._add_pool((self._window, tf.num_key_value_heads, tf.head_dim)),
                                   self._add_pool((self._window, tf.num_key_value_heads, tf.head_dim))))
        self._seanet = [self._layer(m) for m in seanet]
        self._init_quantizer()
        self._start(initial_streams)

    # -- codes -> latents ------------------------------------------------------------------

    def _init_quantizer(self) -> None:
        """The codebooks as one table [K * C, D] (transformers' codebooks recompute
        embed_sum / usage at every decode, and decode codebook by codebook: ~5 launches per
        codebook per call), the semantic and acoustic groups' output projections beside it."""
        q = self.model.quantizer
        k, n_sem = self.num_codebooks, q.num_semantic_quantizers
        layers = [*q.semantic_residual_vector_quantizer.layers, *q.acoustic_residual_vector_quantizer.layers][:k]
        with torch.no_grad():
            self._codebooks = torch.cat([layer.codebook.embed for layer in layers]).to(self.dtype)  # [K * C, D]
        self._code_offsets = (torch.arange(k, device=self.device) * self.codebook_size)[None, :, None]  # (1, K, 1)
        self._n_semantic = n_sem
        self._semantic_proj = q.semantic_residual_vector_quantizer.output_proj
        self._acoustic_proj = q.acoustic_residual_vector_quantizer.output_proj

    def _latents(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, K, m) -> the quantizer's output (B, hidden, m), as quantizer.decode."""
        emb = F.embedding(codes + self._code_offsets, self._codebooks)  # (B, K, m, D)
        n = self._n_semantic
        x = emb[:, :n].sum(dim=1).transpose(1, 2)  # (B, D, m)
        x = self._semantic_proj(x) if self._semantic_proj is not None else x
        if codes.shape[1] > n:
            a = emb[:, n:].sum(dim=1).transpose(1, 2)
            x = x + (self._acoustic_proj(a) if self._acoustic_proj is not None else a)
        return x

    # -- state layout --------------------------------------------------------------------

    def _conv(self, module: MimiConv1d | MimiConvTranspose1d, transposed: bool) -> StatefulConv:
        return self._stateful_conv(module.conv, transposed)  # context (k - 1) * d = MimiConv1d.padding_total

    def _layer(self, module: torch.nn.Module):
        if isinstance(module, MimiConvTranspose1d):
            return self._conv(module, transposed=True)
        if isinstance(module, MimiConv1d):
            return self._conv(module, transposed=False)
        if isinstance(module, MimiResnetBlock):
            body = [self._layer(m) for m in module.block]
            short = module.shortcut
            return ("residual", body, self._conv(short, False) if isinstance(short, MimiConv1d) else short)
        return module  # stateless, pointwise in time (ELU)

    # -- decoding ------------------------------------------------------------------------

    def _decode_into(self, idx: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The decode of streams idx (B,) int64 on the device: the eager path and every graph's body."""
        states = [p.index_select(0, idx) for p in self._pools]  # this batch's state, written back below
        x = self._latents(codes)  # (B, hidden, m)
        if self._upsample is not None:
            x = self._run_conv(self._upsample, x, states)
        x = self._run_transformer(idx, x.transpose(1, 2), states).transpose(1, 2)
        x = self._run_layers(self._seanet, x, states)
        for p, s in zip(self._pools, states):
            p.index_copy_(0, idx, s)
        return x[:, 0, :]

    def _run_layers(self, layers: list, x: torch.Tensor, states: list[torch.Tensor]) -> torch.Tensor:
        for layer in layers:
            if isinstance(layer, StatefulConv):
                x = self._run_conv(layer, x, states)
            elif isinstance(layer, tuple):  # MimiResnetBlock: body + shortcut
                _, body, short = layer
                res = self._run_conv(short, x, states) if isinstance(short, StatefulConv) else short(x)
                x = res + self._run_layers(body, x, states)
            else:
                x = layer(x)
        return x

    def _run_transformer(self, idx: torch.Tensor, h: torch.Tensor, states: list[torch.Tensor]) -> torch.Tensor:
        """MimiTransformerModel.forward over the new latent steps h (B, n, hidden), each row
        continuing its stream: RoPE at absolute positions, attention over the ring + new keys."""
        n = h.shape[1]
        pos, mask, ring_pos = self._attention_window(idx, n)  # pos (B, n), mask (B, 1, n, window + n)
        cos, sin = self._transformer.rotary_emb(h, pos)
        keep = self._ring_keep(n)
        for layer, (kp, vp) in zip(self._transformer.layers, self._kv_pools):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            shape = (h.shape[0], n, -1, attn.head_dim)
            qs = attn.q_proj(x).view(shape).transpose(1, 2)
            ks = attn.k_proj(x).view(shape).transpose(1, 2)
            vs = attn.v_proj(x).view(shape).transpose(1, 2)
            qs, ks = apply_rotary_pos_emb(qs, ks, cos, sin)
            keys = torch.cat([states[kp].transpose(1, 2), ks], dim=2)
            vals = torch.cat([states[vp].transpose(1, 2), vs], dim=2)
            groups = attn.num_key_value_groups
            out = F.scaled_dot_product_attention(qs, repeat_kv(keys, groups), repeat_kv(vals, groups), attn_mask=mask,
                                                 scale=attn.scaling)
            out = attn.o_proj(out.transpose(1, 2).reshape(h.shape[0], n, -1))
            h = h + layer.self_attn_layer_scale(out)
            h = h + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(h)))
            self._ring_write(states[kp], ks[:, :, n - keep :], pos[:, n - keep :])
            self._ring_write(states[vp], vs[:, :, n - keep :], pos[:, n - keep :])
        self._advance_ring(idx, pos, ring_pos)
        return h

    # -- the reference ---------------------------------------------------------------------

    @torch.inference_mode()
    def offline(self, codes: torch.Tensor) -> torch.Tensor:
        """transformers' decode of whole code sequences (B, K, T) -> float PCM (B, T * spf)."""
        return self.model.decode(codes.to(self.device)).audio_values[:, 0, :]
