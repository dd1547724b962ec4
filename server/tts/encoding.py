"""Encoding a response's audio without stalling the event loop.

A compressed format costs real CPU per stream (mp3 about 1% of a core per real-time stream,
opus and aac about 0.4%: `python -m deploy.bench.encoders`), which at hundreds of streams is
cores' worth of work; on the event loop it would delay every other stream's writes. PyAV and
soxr release the GIL while they encode, so those formats run on a small thread pool; PCM, WAV
and G.711 cost microseconds per chunk and stay inline (a thread hop would cost more). The
choice is made once per stream from the format (`AudioFormat.offload`).

Each stream awaits its own calls one at a time, so a stream's chunks are encoded in order
by one thread at a time (an encoder is not shared between streams).
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from streaming.encoders import AudioFormat, StreamEncoder

# One pool for every stream: as many threads as cores (encoding is CPU-bound).
_POOL = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="encode")


class EncodedStream:
    """One stream's encoder with async calls, run inline or on the pool (picked once)."""

    def __init__(self, fmt: AudioFormat, source_rate: int):
        self.format = fmt
        self.sample_rate = fmt.rate(source_rate)
        self._encoder: StreamEncoder = fmt.stream(source_rate)
        self._offload = fmt.offload
        self._started = False

    async def _run(self, fn, *args) -> bytes:
        if not self._offload:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(_POOL, fn, *args)

    async def encode(self, samples: np.ndarray) -> bytes:
        """Bytes for this chunk (the container header rides with the first)."""
        head = b""
        if not self._started:
            self._started = True
            head = self._encoder.start()
        return head + await self._run(self._encoder.encode, samples)

    async def finish(self) -> bytes:
        """What the encoder still holds (its look-ahead, the last partial frame, a trailer)."""
        head = b"" if self._started else self._encoder.start()
        self._started = True
        return head + await self._run(self._encoder.finish)


async def whole_file(fmt: AudioFormat, samples: np.ndarray, source_rate: int) -> bytes:
    if not fmt.offload:
        return fmt.whole_file(samples, source_rate)
    return await asyncio.get_running_loop().run_in_executor(_POOL, fmt.whole_file, samples, source_rate)
