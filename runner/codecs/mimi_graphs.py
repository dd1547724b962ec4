"""Mimi's streaming decode as CUDA graph replays, one per (row bucket, chunk length).

Why: a decode call is hundreds of small launches (state gathers, the decoder transformer's
layers, SEANet's convolutions, state write-back) and costs about the same host time for one
stream as for hundreds; at hundreds of streams the engine loop spent most of its time launching
them. A replay is one launch.

A graph decodes m frames of up to `rows` streams: persistent inputs (the streams' slots, their
codes) are filled by two copies from the decoder's pinned staging ring, padding rows decode stale (valid)
codes into a scratch slot that no stream owns (their state and PCM are discarded), and the output
PCM, float and int16, is a persistent buffer. Replays run on the decoder's stream, so a launch's
input copies land after the previous replay has read them. The
decoder's state pools must not move, so they are allocated for every stream up front
(`MimiStreamingDecoder.reserve_all`). The codec stage launches only captured lengths
(runner/codecs/mimi_stage.py `chunk_lengths`: a shorter last chunk goes as several) and at most
the largest row bucket; a direct decode of another shape runs eagerly. Both paths run the same
code (`MimiStreamingDecoder._decode_into`), so a replay equals the eager decode.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from runner.codecs.decoder import float_to_s16
from runner.codecs.mimi import MimiStreamingDecoder
from runner.utils.capture import capture_stream, no_gc_while_capturing
from runner.utils.host_staging import PinnedStaging

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
        # (rows, m) -> (float PCM, its int16 rounding): (rows, m * samples_per_frame)
        self.out: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        self.capture_stream: torch.cuda.Stream | None = None  # capture(): the graphs' own (capture_stream)

    def _forward(self, b: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        pcm = self.decoder._decode_into(self.slots[:b], self.codes[m][:b])
        return pcm, float_to_s16(pcm)

    @torch.inference_mode()
    def capture(self) -> None:
        keys = [(b, m) for b in self.rows for m in self.lengths]
        with no_gc_while_capturing():
            stream = self.capture_stream = capture_stream(self.decoder.device)
            stream.wait_stream(self.decoder.stream)  # the pools were allocated and zeroed there
            with torch.cuda.stream(stream):
                for b, m in keys:  # kernels load and workspaces grow outside any capture
                    self._forward(b, m)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize(self.decoder.device)
            for key in sorted(keys, key=lambda km: km[0] * km[1], reverse=True):  # the pool sized by the largest
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
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

    def _fill_slots(self, b: int, slots: list[int], staging: PinnedStaging) -> None:
        idx = np.full(b, self.decoder.scratch_slot, dtype=np.int64)
        idx[: len(slots)] = slots
        staging.copy_into(self.slots, idx)

    def run(self, b: int, slots: list[int], codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay (b, m) on the current stream for n <= b streams: codes (n, K, m) on the device
        -> PCM (n, m * samples_per_frame), float and int16, views of the graph's outputs valid
        until its next replay."""
        n, m = codes.shape[0], codes.shape[2]
        self._fill_slots(b, slots, self.decoder.staging)
        self.codes[m][:n].copy_(codes, non_blocking=True)
        self.graphs[(b, m)].replay()
        pcm, pcm16 = self.out[(b, m)]
        return pcm[:n], pcm16[:n]

    def launch(self, b: int, slots: list[int], codes: np.ndarray, staging: PinnedStaging) -> torch.Tensor:
        """run() from host codes (n, K, m) int64: both inputs go through the pinned ring, nothing
        waits. Returns the int16 PCM (n, m * samples_per_frame), a view valid until the graph's
        next replay (copy it out on the same stream)."""
        n, m = codes.shape[0], codes.shape[2]
        self._fill_slots(b, slots, staging)
        staging.copy_into(self.codes[m].view(-1), codes)  # rows [0, n): the buffer is (rows, K, m)
        self.graphs[(b, m)].replay()
        return self.out[(b, m)][1][:n]
