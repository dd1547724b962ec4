"""Mimi's streaming decode as CUDA graph replays, one per (row bucket, chunk length).

Why: a decode call is hundreds of small launches (state gathers, the decoder transformer's
layers, SEANet's convolutions, state write-back) and costs about the same host time for one
stream as for hundreds; at hundreds of streams the engine loop spent most of its time launching
them. A replay is one launch.

A graph decodes m frames of up to `rows` streams: persistent inputs (the streams' slots, their
codes) are filled by two copies, padding rows decode zeros into a scratch slot that no stream
owns (their state and PCM are discarded), and the output PCM is a persistent buffer. The
decoder's state pools must not move, so they are allocated for every stream up front
(`MimiStreamingDecoder.reserve_all`). Chunk lengths without a graph (the last, shorter chunk of
an utterance) and row counts past the largest bucket decode eagerly; both paths run the same
code (`MimiStreamingDecoder._decode_into`), so a replay equals the eager decode.
"""

from __future__ import annotations

import logging

import torch

from runner.codecs.mimi import MimiStreamingDecoder
from runner.utils.capture import no_gc_while_capturing

log = logging.getLogger(__name__)


class MimiGraphs:
    def __init__(self, decoder: MimiStreamingDecoder, row_buckets: list[int], chunk_lengths: list[int]):
        self.decoder = decoder
        self.rows = sorted(row_buckets)
        self.lengths = sorted(set(chunk_lengths))
        dev, k, top = decoder.device, decoder.num_codebooks, self.rows[-1]
        self.slots = torch.full((top,), decoder.scratch_slot, dtype=torch.int64, device=dev)
        self.codes = {m: torch.zeros(top, k, m, dtype=torch.int64, device=dev) for m in self.lengths}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.out: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

    def _forward(self, b: int, m: int) -> torch.Tensor:
        return self.decoder._decode_into(self.slots[:b], self.codes[m][:b])

    @torch.inference_mode()
    def capture(self) -> None:
        keys = [(b, m) for b in self.rows for m in self.lengths]
        with no_gc_while_capturing():
            stream = torch.cuda.Stream(self.decoder.device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for b, m in keys:  # kernels load and workspaces grow outside any capture
                    self._forward(b, m)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize(self.decoder.device)
            for key in sorted(keys, key=lambda km: km[0] * km[1], reverse=True):  # the pool sized by the largest
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self.out[key] = self._forward(*key)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[key] = g
            torch.cuda.synchronize(self.decoder.device)
        self.decoder.reset_scratch()
        log.info("captured Mimi decode CUDA graphs: rows %s x chunk lengths %s", self.rows, self.lengths)

    def bucket_for(self, n: int, m: int) -> int | None:
        if m not in self.codes:
            return None
        for b in self.rows:
            if b >= n:
                return b
        return None

    def run(self, b: int, slots: list[int], codes: torch.Tensor) -> torch.Tensor:
        """Replay (b, m) for n <= b streams: codes (n, K, m) -> PCM (n, m * samples_per_frame),
        a view of the graph's output valid until its next replay."""
        n, m = codes.shape[0], codes.shape[2]
        idx = torch.full((b,), self.decoder.scratch_slot, dtype=torch.int64)
        idx[:n] = torch.as_tensor(slots, dtype=torch.int64)
        self.slots[:b].copy_(idx, non_blocking=False)
        buf = self.codes[m]
        buf[:n].copy_(codes)
        if n < b:
            buf[n:b].zero_()
        self.graphs[(b, m)].replay()
        return self.out[(b, m)][:n]
