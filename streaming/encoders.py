"""Output encoders: audio containers keyed by `response_format`, plus the base64 and raw-array
helpers SSE and WebSocket framing need.

Audio arrives from the engine as int16 PCM numpy chunks. A format knows how to stream
(header first, then chunks, then a trailer) and how to write a whole file with exact sizes.
New formats register themselves in `_FORMATS`; handlers look them up by name only.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

PCM_SAMPLE_BYTES = 2  # s16le mono
_UNKNOWN_SIZE = 0xFFFFFFFF  # RIFF convention for "length not known yet" (streaming)


class UnsupportedFormat(KeyError):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def pcm16_bytes(samples: np.ndarray) -> bytes:
    """int16 samples -> little-endian bytes. Anything else is a bug upstream, not something to
    silently rescale."""
    if samples.dtype.kind != "i" or samples.dtype.itemsize != 2:
        raise TypeError(f"expected int16 PCM samples, got {samples.dtype}")
    return np.ascontiguousarray(samples, dtype="<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None, channels: int = 1, bits: int = 16) -> bytes:
    """44-byte canonical PCM WAV header. `data_bytes=None` writes the streaming form whose
    RIFF and data sizes say "unknown" (players read until the connection ends)."""
    block_align = channels * bits // 8
    if data_bytes is None:
        riff_size = data_size = _UNKNOWN_SIZE
    else:
        if data_bytes < 0 or data_bytes > _UNKNOWN_SIZE - 36:
            raise ValueError(f"data_bytes out of range for WAV: {data_bytes}")
        riff_size, data_size = 36 + data_bytes, data_bytes
    return b"".join(
        [
            b"RIFF",
            struct.pack("<I", riff_size),
            b"WAVE",
            b"fmt ",
            struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block_align, block_align, bits),
            b"data",
            struct.pack("<I", data_size),
        ]
    )


class StreamEncoder(Protocol):
    def start(self) -> bytes: ...
    def encode(self, samples: np.ndarray) -> bytes: ...
    def finish(self) -> bytes: ...


class _PcmStream:
    def start(self) -> bytes:
        return b""

    def encode(self, samples: np.ndarray) -> bytes:
        return pcm16_bytes(samples)

    def finish(self) -> bytes:
        return b""


class _WavStream(_PcmStream):
    def __init__(self, sample_rate: int):
        self._sample_rate = sample_rate

    def start(self) -> bytes:
        return wav_header(self._sample_rate, None)


@dataclass(frozen=True)
class AudioFormat:
    name: str
    content_type: str
    stream: Callable[[int], StreamEncoder]  # sample_rate -> encoder for one response
    whole_file: Callable[[bytes, int], bytes]  # (pcm s16le bytes, sample_rate) -> file bytes


_FORMATS: dict[str, AudioFormat] = {}


def register_format(fmt: AudioFormat) -> None:
    _FORMATS[fmt.name] = fmt


def get_format(name: str) -> AudioFormat:
    try:
        return _FORMATS[name]
    except KeyError:
        raise UnsupportedFormat(name) from None


def supported_formats() -> tuple[str, ...]:
    return tuple(_FORMATS)


register_format(
    AudioFormat(
        name="pcm",
        content_type="audio/pcm",
        stream=lambda sr: _PcmStream(),
        whole_file=lambda pcm, sr: pcm,
    )
)
register_format(
    AudioFormat(
        name="wav",
        content_type="audio/wav",
        stream=_WavStream,
        whole_file=lambda pcm, sr: wav_header(sr, len(pcm)) + pcm,
    )
)


# ---- base64 and raw arrays (SSE events, WebSocket headers + binary frames) ------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def array_bytes(arr: np.ndarray) -> bytes:
    """Raw little-endian, C-order bytes of an array (what a binary frame or base64 carries)."""
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr).tobytes()


def array_header(arr: np.ndarray, model_dtype: str = "") -> dict:
    """{"dtype", "shape"} for an array sent as raw bytes. bf16 travels from the engine as raw
    uint16; we name it "bfloat16" (when the model runs in bf16) so a client can view it right."""
    name = arr.dtype.name
    if name == "uint16" and "bfloat16" in model_dtype:
        name = "bfloat16"
    return {"dtype": name, "shape": list(arr.shape)}
