"""Encoder CPU cost per stream: how much of one core each output format takes to encode one
stream of real-time audio, and how many streams one core keeps up with.

    python -m deploy.bench.encoders [--seconds 10] [--chunk-ms 85] [--formats mp3,opus,...]

Feeds a speech-like 24 kHz int16 signal (a harmonic tone with a moving pitch and noise) in
chunks of the engine's steady size through one `StreamEncoder` per format (as the server
does for each response), timing encode + finish with the process CPU clock. Also times the
same work across 4 threads to show whether the encoder releases the GIL (PyAV's encode and
soxr do), which is what running encoders off the event loop relies on. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from streaming.encoders import resolve_format

SOURCE_RATE = 24000
DEFAULT_FORMATS = "pcm,wav,pcm_16000,pcm_44100,ulaw_8000,alaw_8000,flac,mp3,mp3_22050_32,mp3_44100_128,opus,opus_48000_64,aac"


def speech_like(seconds: float, rate: int = SOURCE_RATE, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t) ** 2
    x = 6000 * envelope * voiced + rng.normal(0, 400, t.size)
    return np.clip(x, -32768, 32767).astype(np.int16)


def encode_once(name: str, audio: np.ndarray, chunk: int) -> int:
    enc = resolve_format(name).stream(SOURCE_RATE)
    n = len(enc.start())
    for i in range(0, audio.size, chunk):
        n += len(enc.encode(audio[i : i + chunk]))
    return n + len(enc.finish())


def cpu_per_audio_second(name: str, audio: np.ndarray, chunk: int) -> tuple[float, int]:
    t0 = time.process_time()
    n = encode_once(name, audio, chunk)
    return (time.process_time() - t0) / (audio.size / SOURCE_RATE), n


def threaded_wall(name: str, audio: np.ndarray, chunk: int, threads: int) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: encode_once(name, audio, chunk), range(threads)))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="audio seconds per stream")
    ap.add_argument("--chunk-ms", type=float, default=85.0 * 8, help="chunk size (default: 8 SNAC frames)")
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    args = ap.parse_args(argv)
    audio = speech_like(args.seconds)
    chunk = max(1, int(args.chunk_ms * SOURCE_RATE / 1000))
    print(f"{args.seconds:g} s of 24 kHz audio per stream, chunks of {chunk} samples\n")
    print("| format | CPU ms per audio s | % of a core per stream | streams per core | kbit/s | 4 threads speed-up |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.formats.split(","):
        encode_once(name, audio[:SOURCE_RATE], chunk)  # warm up (codec tables, imports)
        cost, nbytes = cpu_per_audio_second(name, audio, chunk)
        one = threaded_wall(name, audio, chunk, 1)
        four = threaded_wall(name, audio, chunk, 4)
        per_core = 1 / cost if cost > 0 else float("inf")
        print(f"| {name} | {cost * 1000:.2f} | {cost * 100:.2f} | {per_core:.0f} | "
              f"{nbytes * 8 / args.seconds / 1000:.0f} | {4 * one / four:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
