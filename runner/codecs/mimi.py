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
the state is kept here, per stream, in slot pools that batch by index:

* causal conv (stride 1): the last `padding_total` input samples, which replace the zero left
  padding (zeros initially: the offline decode's padding);
* transposed conv (kernel k, stride s): the last ceil(k/s) - 1 inputs; their outputs, which
  lacked those inputs' contributions, are cut; causal trimming drops the right tail offline too;
* transformer: a ring of the last `sliding_window` keys / values (RoPE already applied at their
  absolute positions) and those positions; a new step attends to the keys with position in
  (p - sliding_window, p], as transformers' sliding-window mask does.

Equal to the offline decode up to float rounding (other matmul and conv shapes), not bit-exact:
measured on the tiny test codec, max |difference| ~1e-6 of a unit-scale signal (tests/codecs/test_mimi.py).
Loading the codec (a Mimi folder or CSM's checkpoint) and its streaming checks: runner/codecs/mimi_loader.py.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
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
from runner.codecs.decoder import PendingPCM, float_to_s16
from runner.codecs.mimi_loader import decoder_modules
from runner.utils.host_staging import PinnedStaging


@dataclass
class _Conv:
    """A stateful causal conv (transposed=False) or transposed conv of the decoder."""

    module: MimiConv1d | MimiConvTranspose1d
    transposed: bool
    context: int  # input steps kept per stream
    state: int  # index into the decoder's state pools (-1: no context, no state)


class MimiStreamingDecoder:
    """Decodes the next frames of many streams in one call; each stream holds a slot of state.

    decode(slots, codes): codes (B, K, m) long, the next m frames of the streams in `slots`
    (distinct) -> float PCM (B, m * samples_per_frame), and the streams' state advanced;
    launch(slots, codes) the same as int16 PCM on its way to the host (what the codec stage
    runs). The pools grow by doubling up to `max_streams` slots.

    On CUDA every use of the state pools (decodes, a new stream's reset, growth) is queued on the
    decoder's own stream, so they take effect in the order they were issued whatever the host
    does meanwhile: a stream's chunks decode in order, and a slot freed while a launch that
    writes it is still in flight is reset for its next stream only after that launch (see
    new_stream).
    """

    def __init__(self, model: MimiModel, num_codebooks: int | None = None, max_streams: int = 1024,
                 initial_streams: int = 8) -> None:
        cfg = model.config
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
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # a pinned ring of its own: its copies queue behind the codec stream's backlog, and a
        # ring shared with the engine would make the engine's next step wait for them
        self.staging = PinnedStaging(self.device) if self.stream is not None else None
        self.max_streams = max_streams
        self._window = int(cfg.sliding_window)
        self._pool_shapes: list[tuple[int, ...]] = []  # per-stream state shapes
        self._upsample = self._conv(upsample, transposed=True) if upsample is not None else None
        self._transformer: MimiTransformerModel = transformer
        tf = cfg
        self._kv_pools = []  # per layer: keys, values (S, window, kv_heads, head_dim)
        for _ in self._transformer.layers:
            self._kv_pools.append((self._add_pool((self._window, tf.num_key_value_heads, tf.head_dim)),
                                   self._add_pool((self._window, tf.num_key_value_heads, tf.head_dim))))
        self._seanet = [self._layer(m) for m in seanet]
        self._init_quantizer()
        self._capacity = 0
        self._pools: list[torch.Tensor] = []
        self._ring_pos = torch.empty(0, self._window, dtype=torch.int64, device=self.device)  # -1: empty
        self._latent_pos = torch.empty(0, dtype=torch.int64, device=self.device)  # latent steps decoded
        self._free: list[int] = []
        self.scratch_slot = -1  # reserve_all(): the slot padding rows of a graph decode into
        self.graphs = None  # runner/codecs/mimi_graphs.py MimiGraphs, attached by the codec stage on CUDA
        self._grow(min(initial_streams, max_streams))
        if self.stream is not None:  # the weights and tables above were written on the caller's stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def _on_stream(self):
        """The decoder's stream as the current one (CUDA), else nothing to switch."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

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

    def _add_pool(self, shape: tuple[int, ...]) -> int:
        self._pool_shapes.append(shape)
        return len(self._pool_shapes) - 1

    def _conv(self, module: MimiConv1d | MimiConvTranspose1d, transposed: bool) -> _Conv:
        conv = module.conv
        k, s, d = conv.kernel_size[0], conv.stride[0], conv.dilation[0]
        if transposed:
            context = math.ceil(k / s) - 1
        else:
            if s != 1:
                raise CodecError(f"Mimi decoder conv with stride {s}: streaming decode supports stride 1 only")
            context = (k - 1) * d  # MimiConv1d.padding_total
        state = self._add_pool((conv.in_channels, context)) if context else -1
        return _Conv(module, transposed, context, state)

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

    def _grow(self, capacity: int) -> None:
        old = self._capacity
        extra = capacity - old
        if extra <= 0:
            return
        kw = dict(device=self.device, dtype=self.dtype)
        # on the decoder's stream: the old pools are read after the launches in flight wrote
        # them, and their memory (the stream's) is not reused before the copies have run
        with self._on_stream():
            if old == 0:
                self._pools = [torch.zeros((capacity, *shape), **kw) for shape in self._pool_shapes]
            else:
                self._pools = [torch.cat([p, torch.zeros((extra, *p.shape[1:]), **kw)]) for p in self._pools]
            self._ring_pos = torch.cat([self._ring_pos, torch.full((extra, self._window), -1, dtype=torch.int64,
                                                                   device=self.device)])
            self._latent_pos = torch.cat([self._latent_pos,
                                          torch.zeros(extra, dtype=torch.int64, device=self.device)])
        self._free.extend(range(capacity - 1, old - 1, -1))  # pop() hands out the lowest slot first
        self._capacity = capacity

    # -- streams -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Slots a new stream can still take (growing the pools if needed)."""
        return len(self._free) + max(0, self.max_streams - self._capacity)

    def reserve_all(self) -> None:
        """Every stream's state and one scratch slot allocated now, so the pools never move
        (CUDA graphs hold their addresses)."""
        self._grow(self.max_streams + 1)
        self.scratch_slot = self.max_streams
        self._free.remove(self.scratch_slot)

    def reset_scratch(self) -> None:
        self._reset(self.scratch_slot)

    def _reset(self, slot: int) -> None:
        with self._on_stream():
            for p in self._pools:
                p[slot].zero_()
            self._ring_pos[slot] = -1
            self._latent_pos[slot] = 0

    def new_stream(self) -> int:
        """A fresh slot, its state zero (the start of an utterance)."""
        if not self._free:
            if self._capacity >= self.max_streams:
                raise CodecError(f"max_streams: all {self.max_streams} Mimi codec streams are in use")
            self._grow(min(self.max_streams, max(1, 2 * self._capacity)))
        slot = self._free.pop()
        # Queued on the decoder's stream, behind every launch issued before: a launch of the
        # slot's previous stream (aborted or ended while in flight) writes its state first, the
        # reset then, and this stream's first decode after it.
        self._reset(slot)
        return slot

    def free(self, slot: int) -> None:
        """The slot may go to a new stream at once, launches of its old one still in flight (see
        new_stream); their PCM is the caller's to drop."""
        self._free.append(slot)

    # -- decoding ------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, slots: list[int], codes: torch.Tensor) -> torch.Tensor:
        """codes (B, K, m) long of the streams in `slots` -> float PCM (B, m * samples_per_frame)
        (a graph replay where one is captured for the shape: valid until the next decode). On
        CUDA the decode runs on the decoder's stream and the caller's stream waits for it."""
        if self.stream is None:
            return self._decode_into(torch.tensor(slots, dtype=torch.int64), codes)
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)  # the codes may come from the caller's stream
        with torch.cuda.stream(self.stream):
            codes = codes.to(self.device)
            bucket = self.graphs.bucket_for(len(slots), codes.shape[2]) if self.graphs is not None else None
            if bucket is not None:
                out = self.graphs.run(bucket, slots, codes)[0]
            else:
                out = self._decode_into(self.staging.to_device(np.asarray(slots, dtype=np.int64)), codes)
                out.record_stream(caller)  # the decoder stream's memory, read on the caller's
        caller.wait_stream(self.stream)
        return out

    @torch.inference_mode()
    def launch(self, slots: list[int], codes: np.ndarray) -> PendingPCM:
        """Start decoding codes (B, K, m) int64, the next m frames of the streams in `slots`
        (distinct): their int16 PCM (B, m * samples_per_frame) on its way to the host. On the
        CPU it has landed on return. On CUDA all of it is queued on the decoder's stream: the
        inputs staged through the pinned ring, the decode (a graph replay where one is captured
        for the shape), the int16 PCM copied into pinned host memory right behind it (stream
        order: before a later replay of the same graph overwrites its output), then an event;
        neither the host nor the model's stream waits here."""
        n, m = len(slots), codes.shape[2]
        cuts = [(0, m * self.samples_per_frame)] * n
        if self.stream is None:
            return PendingPCM(float_to_s16(self.decode(slots, torch.from_numpy(codes))), cuts, None)
        staging = self.staging
        with torch.cuda.stream(self.stream):
            bucket = self.graphs.bucket_for(n, m) if self.graphs is not None else None
            if bucket is not None:
                pcm = self.graphs.launch(bucket, slots, codes, staging)
            else:
                idx = staging.to_device(np.asarray(slots, dtype=np.int64))
                pcm = float_to_s16(self._decode_into(idx, staging.to_device(codes)))
            # the PCM stays here until the stage collects it (steps later): a block of its own
            host = torch.empty((n, m * self.samples_per_frame), dtype=torch.int16, pin_memory=True)
            host.copy_(pcm, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return PendingPCM(host, cuts, event)

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

    def _run_conv(self, c: _Conv, x: torch.Tensor, states: list[torch.Tensor]) -> torch.Tensor:
        if c.state < 0:
            return c.module.conv(x)  # a kernel of one step: no padding offline either
        xx = torch.cat([states[c.state], x], dim=-1)
        states[c.state] = xx[..., -c.context :]
        y = c.module.conv(xx)
        if not c.transposed:
            return y  # (k - 1) * d steps of context in, as many fewer out: x's length
        s = c.module.conv.stride[0]
        # the context's outputs lacked earlier inputs; the right tail is trimmed offline too
        return y[..., c.context * s : (c.context + x.shape[-1]) * s]

    def _run_layers(self, layers: list, x: torch.Tensor, states: list[torch.Tensor]) -> torch.Tensor:
        for layer in layers:
            if isinstance(layer, _Conv):
                x = self._run_conv(layer, x, states)
            elif isinstance(layer, tuple):  # MimiResnetBlock: body + shortcut
                _, body, short = layer
                res = self._run_conv(short, x, states) if isinstance(short, _Conv) else short(x)
                x = res + self._run_layers(body, x, states)
            else:
                x = layer(x)
        return x

    def _run_transformer(self, idx: torch.Tensor, h: torch.Tensor, states: list[torch.Tensor]) -> torch.Tensor:
        """MimiTransformerModel.forward over the new latent steps h (B, n, hidden), each row
        continuing its stream: RoPE at absolute positions, attention over the ring + new keys."""
        n, w = h.shape[1], self._window
        start = self._latent_pos.index_select(0, idx)
        pos = start[:, None] + torch.arange(n, device=self.device)  # (B, n)
        ring_pos = self._ring_pos.index_select(0, idx)
        kpos = torch.cat([ring_pos, pos], dim=1)[:, None, :]  # (B, 1, w + n)
        q = pos[:, :, None]
        mask = ((kpos >= 0) & (kpos <= q) & (kpos > q - w))[:, None]  # (B, 1, n, w + n)
        cos, sin = self._transformer.rotary_emb(h, pos)
        keep = min(n, w)  # the new steps the ring keeps
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
        ring = pos[:, n - keep :] % w
        ring_pos.scatter_(1, ring, pos[:, n - keep :])
        self._ring_pos.index_copy_(0, idx, ring_pos)
        self._latent_pos.index_copy_(0, idx, start + n)
        return h

    def _ring_write(self, ring: torch.Tensor, new: torch.Tensor, pos: torch.Tensor) -> None:
        """ring (B, w, heads, d) <- new (B, heads, n, d) at slots pos % w (n <= w, distinct)."""
        slots = (pos % self._window)[:, :, None, None].expand(-1, -1, new.shape[1], new.shape[3])
        ring.scatter_(1, slots, new.transpose(1, 2).to(ring.dtype))

    # -- the reference ---------------------------------------------------------------------

    @torch.inference_mode()
    def offline(self, codes: torch.Tensor) -> torch.Tensor:
        """transformers' decode of whole code sequences (B, K, T) -> float PCM (B, T * spf)."""
        return self.model.decode(codes.to(self.device)).audio_values[:, 0, :]
