"""CUDA graphs for the batched SNAC window decode.

Why: one call of the fused decoder is ~22 Triton launches and ~25 torch ops, ~1 ms of host time
whatever the batch; streams that started at different times have windows ready at nearly every
step, so without graphs the codec's launches take several ms of host time per engine step at
64-400 streams arriving over 2 s. A replay with its input and output copies costs a few
launches.

One graph per (rows, window frames): rows are powers of two up to `max_rows`, window lengths are
those the window policy produces for an unbounded stream (a stream's last window may have any
length; those run eagerly). Graphs read their inputs from, and write int16 PCM to, persistent
device buffers; all share one memory pool (they only ever run one at a time, on the codec
stream). A batch of n windows runs as few pieces as possible: whole buckets while n is large,
the last piece padded to the next bucket when that wastes at most a quarter of it (padded rows
decode stale, valid codes and are never copied out). A row's result does not depend on the other
rows (the fused kernels' tiles depend on the layer only), so graph and eager decode give the
same bits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runner.utils.capture import no_gc_while_capturing

log = logging.getLogger(__name__)

# (codes (B, W, frame) int64, window start frames (B,) int64, seeds (B,) int64) -> (B, W * spf) int16
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    codes: torch.Tensor  # (rows, W, frame) int64
    meta: torch.Tensor  # (2, rows) int64: window start frames, seeds
    pcm: torch.Tensor  # (rows, W * spf) int16, written by the replay


def row_buckets(max_rows: int) -> list[int]:
    sizes = [1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows]
    return sizes + [max_rows]


def split_rows(n: int, buckets: list[int]) -> list[tuple[int, int]]:
    """n rows -> [(rows taken, bucket)]: whole largest buckets first, then the smallest bucket that
    holds the rest if it wastes at most a quarter of it, else the largest bucket below the rest."""
    out = []
    while n > 0:
        fit = next((b for b in buckets if b >= n), buckets[-1])
        if fit <= n:  # n >= the largest bucket
            out.append((fit, fit))
            n -= fit
        elif 4 * (fit - n) <= fit:
            out.append((n, fit))
            n = 0
        else:
            below = max(b for b in buckets if b < n)
            out.append((below, below))
            n -= below
    return out


class CodecGraphs:
    def __init__(self, decode: DecodeFn, device: torch.device, window_lengths: list[int], max_rows: int,
                 frame_width: int, samples_per_frame: int) -> None:
        """Capture every (bucket, window length) now (start-up): capture must not happen while
        the engine serves, and Triton has compiled the kernels already (the decoder's warm-up)."""
        self.buckets = row_buckets(max_rows)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        pool = None
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        # largest first, so the shared pool is sized by the largest graph at once
        with no_gc_while_capturing():
            for w in sorted(set(window_lengths), reverse=True):
                for rows in reversed(self.buckets):
                    codes = torch.zeros(rows, w, frame_width, dtype=torch.int64, device=device)
                    meta = torch.zeros(2, rows, dtype=torch.int64, device=device)
                    with torch.cuda.stream(side):
                        decode(codes, meta[0], meta[1])  # allocator and lazy-init work outside the capture
                    side.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=side):
                        pcm = decode(codes, meta[0], meta[1])
                    assert pcm.shape == (rows, w * samples_per_frame)
                    pool = pool or g.pool()
                    self.graphs[(rows, w)] = _Graph(g, codes, meta, pcm)
        torch.cuda.synchronize(device)
        self.window_lengths = frozenset(window_lengths)
        log.info("captured codec CUDA graphs: windows of %s frames, %s rows", sorted(self.window_lengths), self.buckets)

    def run(self, codes: torch.Tensor, meta: torch.Tensor, out: torch.Tensor) -> None:
        """Decode on the current stream. codes (n, W, frame) and meta (2, >= n) on the device,
        out (n, W * spf) int16 in pinned host memory: filled when the stream gets there. W must
        be one of window_lengths."""
        n, w = codes.shape[0], codes.shape[1]
        i = 0
        for take, rows in split_rows(n, self.buckets):
            g = self.graphs[(rows, w)]
            g.codes[:take].copy_(codes[i : i + take], non_blocking=True)
            g.meta[:, :take].copy_(meta[:, i : i + take], non_blocking=True)
            g.graph.replay()
            out[i : i + take].copy_(g.pcm[:take], non_blocking=True)
            i += take
