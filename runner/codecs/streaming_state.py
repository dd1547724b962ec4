"""The per-stream state machinery of a causal streaming codec decoder, shared by Mimi
(runner/codecs/mimi.py) and Qwen3-TTS's 12 Hz codec (runner/codecs/qwen12hz.py).

A subclass walks its decoder's modules over the new frames of many streams at once; this base
keeps each stream's state between calls in slot pools that batch by index, so a stream decoded
chunk by chunk gives the samples of the offline decode of the whole sequence, each sample once:

* causal conv (stride 1): the last (k - 1) * d input steps, which replace the zero left padding
  (zeros initially: the offline decode's padding);
* transposed conv (kernel k, stride s): the last ceil(k/s) - 1 inputs; their outputs, which
  lacked those inputs' contributions, are cut; causal trimming drops the right tail offline too;
* transformer: a ring of the last `window` keys / values (RoPE already applied at their absolute
  positions) and those positions; a new step attends to the keys with position in
  (p - window, p], as transformers' sliding-window mask does.

On CUDA every use of the state pools (decodes, a new stream's reset, growth) is queued on the
decoder's own stream, so they take effect in the order they were issued whatever the host does
meanwhile: a stream's chunks decode in order, and a slot freed while a launch that writes it is
still in flight is reset for its next stream only after that launch (see new_stream).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from runner.codecs.config import CodecError
from runner.codecs.decoder import PendingPCM, float_to_s16
from runner.utils.host_staging import PinnedStaging


@dataclass
class StatefulConv:
    """A causal conv (transposed=False, stride 1) or transposed conv of a decoder, and its state."""

    conv: nn.Conv1d | nn.ConvTranspose1d
    transposed: bool
    context: int  # input steps kept per stream
    state: int  # index into the decoder's state pools (-1: no context, no state)


class StreamingDecoderBase:
    """Decodes the next frames of many streams in one call; each stream holds a slot of state.

    decode(slots, codes): codes (B, K, m) long, the next m frames of the streams in `slots`
    (distinct) -> float PCM (B, m * samples_per_frame), and the streams' state advanced;
    launch(slots, codes) the same as int16 PCM on its way to the host (what a codec stage runs).
    The pools grow by doubling up to `max_streams` slots.

    A subclass declares its state with _add_pool / _stateful_conv (and a ring window), calls
    _start(), and implements _decode_into (the eager path and every CUDA graph's body); the
    attributes num_codebooks, samples_per_frame and sample_rate are its to set.
    """

    name = "codec"  # in errors
    num_codebooks: int
    samples_per_frame: int
    sample_rate: int

    def __init__(self, device: torch.device, dtype: torch.dtype, window: int, max_streams: int) -> None:
        self.device, self.dtype = device, dtype
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # a pinned ring of its own: its copies queue behind the codec stream's backlog, and a
        # ring shared with the engine would make the engine's next step wait for them
        self.staging = PinnedStaging(self.device) if self.stream is not None else None
        self.max_streams = max_streams
        self._window = window  # attention window, in the transformer's steps
        self._pool_shapes: list[tuple[int, ...]] = []  # per-stream state shapes
        self._capacity = 0
        self._pools: list[torch.Tensor] = []
        self._ring_pos = torch.empty(0, window, dtype=torch.int64, device=self.device)  # -1: empty
        self._latent_pos = torch.empty(0, dtype=torch.int64, device=self.device)  # transformer steps decoded
        self._free: list[int] = []
        self.scratch_slot = -1  # reserve_all(): the slot padding rows of a graph decode into
        self.graphs = None  # a CUDA graph set (runner/codecs/mimi_graphs.py), attached by the codec stage

    def _start(self, initial_streams: int) -> None:
        """The first pools, once every state is declared."""
        self._grow(min(initial_streams, self.max_streams))
        if self.stream is not None:  # the weights and tables were written on the caller's stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def _on_stream(self):
        """The decoder's stream as the current one (CUDA), else nothing to switch."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    # -- state layout --------------------------------------------------------------------

    def _add_pool(self, shape: tuple[int, ...]) -> int:
        self._pool_shapes.append(shape)
        return len(self._pool_shapes) - 1

    def _stateful_conv(self, conv: nn.Conv1d | nn.ConvTranspose1d, transposed: bool) -> StatefulConv:
        k, s, d = conv.kernel_size[0], conv.stride[0], conv.dilation[0]
        if transposed:
            context = math.ceil(k / s) - 1
        else:
            if s != 1:
                raise CodecError(f"{self.name} decoder conv with stride {s}: streaming decode supports stride 1 only")
            context = (k - 1) * d  # the causal left padding
        state = self._add_pool((conv.in_channels, context)) if context else -1
        return StatefulConv(conv, transposed, context, state)

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
                raise CodecError(f"max_streams: all {self.max_streams} {self.name} codec streams are in use")
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
        """The decode of streams idx (B,) int64 on the device, codes (B, K, m) -> float PCM
        (B, m * samples_per_frame): the eager path and every graph's body. It gathers the
        batch's state (self._pools[i].index_select(0, idx)) and writes it back."""
        raise NotImplementedError

    # -- the pieces a decode is made of ----------------------------------------------------

    def _run_conv(self, c: StatefulConv, x: torch.Tensor, states: list[torch.Tensor]) -> torch.Tensor:
        """x (B, C_in, n) continuing each row's stream -> the offline conv's outputs for those steps
        (n steps; n * stride for a transposed conv); states[c.state] (B, C_in, context) advanced."""
        if c.state < 0:
            return c.conv(x)  # a kernel of one step (or k == s): no padding offline either
        xx = torch.cat([states[c.state], x], dim=-1)
        states[c.state] = xx[..., -c.context :]
        y = c.conv(xx)
        if not c.transposed:
            return y  # (k - 1) * d steps of context in, as many fewer out: x's length
        s = c.conv.stride[0]
        # the context's outputs lacked earlier inputs; the right tail is trimmed offline too
        return y[..., c.context * s : (c.context + x.shape[-1]) * s]

    def _attention_window(self, idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For n new transformer steps of streams idx (B,): their absolute positions pos (B, n),
        and the attention mask over [ring keys, new keys] (B, 1, n, window + n): a key is seen
        iff it exists, is not in the future, and is within the window. Also the streams' ring
        positions (B, window), for _advance_ring."""
        w = self._window
        start = self._latent_pos.index_select(0, idx)
        pos = start[:, None] + torch.arange(n, device=self.device)  # (B, n)
        ring_pos = self._ring_pos.index_select(0, idx)
        kpos = torch.cat([ring_pos, pos], dim=1)[:, None, :]  # (B, 1, w + n)
        q = pos[:, :, None]
        mask = ((kpos >= 0) & (kpos <= q) & (kpos > q - w))[:, None]  # (B, 1, n, w + n)
        return pos, mask, ring_pos

    def _ring_keep(self, n: int) -> int:
        """How many of n new steps the ring keeps: the last min(n, window)."""
        return min(n, self._window)

    def _ring_write(self, ring: torch.Tensor, new: torch.Tensor, pos: torch.Tensor) -> None:
        """ring (B, w, heads, d) <- new (B, heads, n, d) at slots pos % w (n <= w, distinct)."""
        slots = (pos % self._window)[:, :, None, None].expand(-1, -1, new.shape[1], new.shape[3])
        ring.scatter_(1, slots, new.transpose(1, 2).to(ring.dtype))

    def _advance_ring(self, idx: torch.Tensor, pos: torch.Tensor, ring_pos: torch.Tensor) -> None:
        """After every layer wrote its ring: the streams' ring positions and step counts advanced
        past the n new steps pos (B, n)."""
        n = pos.shape[1]
        kept = pos[:, n - self._ring_keep(n) :]
        ring_pos.scatter_(1, kept % self._window, kept)
        self._ring_pos.index_copy_(0, idx, ring_pos)
        self._latent_pos.index_copy_(0, idx, pos[:, -1] + 1)
