"""Output encoders: audio formats keyed by the client's name for them, plus the base64 and
raw-array helpers SSE and WebSocket framing need.

Audio arrives from the engine as int16 PCM numpy chunks at the model's rate. A format is a
codec, an output rate and a bit rate; its stream encoder is built once per response (or per
WebSocket context) and keeps all state across chunks (the resampler's filter memory, the
codec's frame buffer and look-ahead), so the concatenated output is one continuous stream
with no seam at chunk boundaries. `finish()` drains that state. `whole_file` writes a complete
file whose headers carry exact sizes (WAV's lengths, FLAC's sample count, MP3's Xing/LAME
gapless header).

Codecs come from FFmpeg through PyAV (mp3 = LAME, opus = libopus in Ogg, aac = FFmpeg's AAC
in ADTS, flac, mu-law, A-law) and resampling from soxr; raw PCM and WAV are plain numpy.

Names: OpenAI's `response_format` values (mp3, opus, aac, flac, wav, pcm at the model's rate)
and `codec_rate[_kbps]` names (ElevenLabs' `output_format`: mp3_44100_128, pcm_16000,
ulaw_8000, opus_48000_64, ...; plus wav_/flac_/aac_<rate>). `resolve_format` turns a name
into an `AudioFormat`; an unknown or unsupported one raises `UnsupportedFormat` naming what is
supported.
"""

from __future__ import annotations

import base64
import io
import re
import struct
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

import av
import numpy as np
import soxr

PCM_SAMPLE_BYTES = 2  # s16le mono
_UNKNOWN_SIZE = 0xFFFFFFFF  # RIFF convention for "length not known yet" (streaming)
# Every rate a PCM-like output may take (ElevenLabs' set plus 32 kHz).
PCM_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # what libopus takes
MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
MP3_KBPS = (32, 48, 64, 96, 128, 160, 192, 256, 320)
OPUS_KBPS = (16, 24, 32, 48, 64, 96, 128, 192)
AAC_KBPS = (32, 48, 64, 96, 128, 192)
RESAMPLE_QUALITY = "HQ"  # soxr's high quality: inaudible error, low cost at speech rates
# Ogg pages are flushed every this many microseconds: the muxer's default (1 s) would hold
# audio back for a second; 40 ms is two Opus packets per page.
OGG_PAGE_US = 40_000


class UnsupportedFormat(KeyError):
    def __init__(self, name: str, why: str = ""):
        super().__init__(name)
        self.name = name
        self.why = why

    def __str__(self) -> str:
        return self.why or f"unsupported format {self.name!r}"


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
    """One response's (or one context's) encoder: start, encode chunk after chunk, finish."""

    def start(self) -> bytes: ...
    def encode(self, samples: np.ndarray) -> bytes: ...
    def finish(self) -> bytes: ...


class _Resampler:
    """soxr's streaming resampler (filter state kept across chunks); identity when the rates
    match."""

    def __init__(self, source_rate: int, rate: int):
        self._stream = None if source_rate == rate else soxr.ResampleStream(
            source_rate, rate, 1, dtype="int16", quality=RESAMPLE_QUALITY
        )

    def __call__(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(np.ascontiguousarray(samples, dtype=np.int16), last=last)

    def drain(self) -> np.ndarray:
        return self(np.zeros(0, np.int16), last=True) if self._stream is not None else np.zeros(0, np.int16)


class _PcmStream:
    """Raw s16le at the format's rate."""

    def __init__(self, source_rate: int, rate: int):
        self._resample = _Resampler(source_rate, rate)

    def start(self) -> bytes:
        return b""

    def encode(self, samples: np.ndarray) -> bytes:
        return pcm16_bytes(self._resample(samples))

    def finish(self) -> bytes:
        return pcm16_bytes(self._resample.drain())


class _F32Stream(_PcmStream):
    """Raw float32 little-endian in [-1, 1) (Cartesia's pcm_f32le)."""

    def encode(self, samples: np.ndarray) -> bytes:
        return _f32(self._resample(samples))

    def finish(self) -> bytes:
        return _f32(self._resample.drain())


def _f32(samples: np.ndarray) -> bytes:
    return (samples.astype("<f4") / 32768.0).astype("<f4").tobytes()


class _WavStream(_PcmStream):
    """A WAV header with unknown sizes (the length is not known while streaming), then PCM."""

    def __init__(self, source_rate: int, rate: int):
        super().__init__(source_rate, rate)
        self._rate = rate

    def start(self) -> bytes:
        return wav_header(self._rate, None)


class _Chunks:
    """A write-only file for FFmpeg's muxer: no seek, so the muxer streams (never goes back to
    patch a header) and every packet's bytes can be taken at once."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


@dataclass(frozen=True)
class _Codec:
    """An FFmpeg codec in a container (`muxer`); `stream_options` are the muxer's options
    when the output is streamed."""

    codec: str
    muxer: str
    content_type: str
    stream_options: tuple[tuple[str, str], ...] = ()


class _AvStream:
    """A PyAV (FFmpeg) encoder + muxer. The codec context chunks the incoming samples into its
    own frame size and keeps its look-ahead; `flush_packets` makes the muxer hand over each
    packet as soon as it is written."""

    def __init__(self, codec: _Codec, source_rate: int, rate: int, bit_rate: int | None, whole: bool = False):
        self._resample = _Resampler(source_rate, rate)
        self._rate = rate
        self._sink: _Chunks | io.BytesIO = io.BytesIO() if whole else _Chunks()
        options = {} if whole else {"flush_packets": "1", **dict(codec.stream_options)}
        self._container = av.open(self._sink, "w", format=codec.muxer, options=options)
        self._stream = self._container.add_stream(codec.codec, rate=rate, layout="mono")
        if bit_rate is not None:
            self._stream.bit_rate = bit_rate
        self._time_base = Fraction(1, rate)
        self._pts = 0

    def _take(self) -> bytes:
        return self._sink.take() if isinstance(self._sink, _Chunks) else b""

    def _mux(self, samples: np.ndarray) -> None:
        if not samples.size:
            return
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self._rate
        frame.pts = self._pts
        frame.time_base = self._time_base
        self._pts += samples.size
        self._container.mux(self._stream.encode(frame))

    def start(self) -> bytes:
        return b""  # the muxer writes its header with the first packet

    def encode(self, samples: np.ndarray) -> bytes:
        self._mux(self._resample(samples))
        return self._take()

    def finish(self) -> bytes:
        self._mux(self._resample.drain())
        self._container.mux(self._stream.encode(None))
        self._container.close()
        if isinstance(self._sink, io.BytesIO):
            return self._sink.getvalue()
        return self._take()


_CODECS: dict[str, _Codec] = {
    # No ID3 tag and no Xing frame in a stream: a player would take the empty Xing frame's
    # "0 frames" at its word. A whole file gets both (exact length, gapless trim).
    "mp3": _Codec("libmp3lame", "mp3", "audio/mpeg", (("id3v2_version", "0"), ("write_xing", "0"))),
    "opus": _Codec("libopus", "ogg", "audio/ogg", (("page_duration", str(OGG_PAGE_US)),)),
    "aac": _Codec("aac", "adts", "audio/aac"),
    "flac": _Codec("flac", "flac", "audio/flac"),
    "ulaw": _Codec("pcm_mulaw", "mulaw", "audio/basic"),
    "alaw": _Codec("pcm_alaw", "alaw", "audio/x-alaw-basic"),
}
_RAW = {"pcm": "audio/pcm", "f32": "audio/pcm", "wav": "audio/wav"}
# Codecs whose cost per chunk is worth a thread (measured: python -m deploy.bench.encoders).
_HEAVY = frozenset({"mp3", "opus", "aac", "flac"})


@dataclass(frozen=True)
class AudioFormat:
    """One output format: codec, output rate (None: the model's own), bit rate (bits/s)."""

    name: str
    codec: str  # pcm, f32, wav, mp3, opus, aac, flac, ulaw, alaw
    sample_rate: int | None = None
    bit_rate: int | None = None

    @property
    def content_type(self) -> str:
        return _RAW[self.codec] if self.codec in _RAW else _CODECS[self.codec].content_type

    @property
    def offload(self) -> bool:
        """Whether encoding a chunk costs enough to run off the event loop (compressed codecs;
        PCM, WAV and G.711 are a copy or a table lookup, resampled or not)."""
        return self.codec in _HEAVY

    def rate(self, source_rate: int) -> int:
        return self.sample_rate or source_rate

    def stream(self, source_rate: int) -> StreamEncoder:
        rate = self.rate(source_rate)
        if self.codec == "pcm":
            return _PcmStream(source_rate, rate)
        if self.codec == "f32":
            return _F32Stream(source_rate, rate)
        if self.codec == "wav":
            return _WavStream(source_rate, rate)
        return _AvStream(_CODECS[self.codec], source_rate, rate, self.bit_rate)

    def whole_file(self, samples: np.ndarray, source_rate: int) -> bytes:
        """A complete file of these int16 samples, with exact sizes in its headers."""
        rate = self.rate(source_rate)
        if self.codec in _RAW:
            pcm = _F32Stream(source_rate, rate) if self.codec == "f32" else _PcmStream(source_rate, rate)
            data = pcm.encode(samples) + pcm.finish()
            return wav_header(rate, len(data)) + data if self.codec == "wav" else data
        enc = _AvStream(_CODECS[self.codec], source_rate, rate, self.bit_rate, whole=True)
        enc.encode(samples)
        return enc.finish()


# OpenAI's response_format names: the model's rate, bit rates fit for speech.
_OPENAI: dict[str, AudioFormat] = {
    "pcm": AudioFormat("pcm", "pcm"),
    "wav": AudioFormat("wav", "wav"),
    "mp3": AudioFormat("mp3", "mp3", bit_rate=64_000),
    "opus": AudioFormat("opus", "opus", bit_rate=32_000),
    "aac": AudioFormat("aac", "aac", bit_rate=64_000),
    "flac": AudioFormat("flac", "flac"),
}
_NAME = re.compile(r"(pcm|f32|wav|flac|ulaw|alaw|mp3|opus|aac)_(\d+)(?:_(\d+))?")
# codec -> (rates, kbps choices or None when the codec takes no bit rate, default kbps)
_RULES: dict[str, tuple[tuple[int, ...], tuple[int, ...] | None, int | None]] = {
    "pcm": (PCM_RATES, None, None),
    "f32": (PCM_RATES, None, None),
    "wav": (PCM_RATES, None, None),
    "flac": (PCM_RATES, None, None),
    "ulaw": ((8000,), None, None),
    "alaw": ((8000,), None, None),
    "mp3": (MP3_RATES, MP3_KBPS, 128),  # ElevenLabs' "mp3_44100" is 128 kbps
    "opus": (OPUS_RATES, OPUS_KBPS, 64),
    "aac": ((16000, 22050, 24000, 32000, 44100, 48000), AAC_KBPS, 64),
}


def resolve_format(name: str) -> AudioFormat:
    """A format by name (OpenAI's or codec_rate[_kbps]); UnsupportedFormat says what is."""
    if name in _OPENAI:
        return _OPENAI[name]
    m = _NAME.fullmatch(name)
    if m is None:
        raise UnsupportedFormat(name, f"{name!r} is not a format; {format_help()}")
    codec, rate, kbps = m.group(1), int(m.group(2)), m.group(3)
    rates, kbps_choices, default_kbps = _RULES[codec]
    if rate not in rates:
        raise UnsupportedFormat(name, f"{name!r}: {codec} rates are {', '.join(map(str, rates))}")
    if kbps is not None and kbps_choices is None:
        raise UnsupportedFormat(name, f"{name!r}: {codec} takes no bit rate ({codec}_<rate>)")
    if kbps_choices is not None:
        k = int(kbps) if kbps is not None else default_kbps
        if k not in kbps_choices:
            raise UnsupportedFormat(name, f"{name!r}: {codec} bit rates are {', '.join(map(str, kbps_choices))} kbps")
        return AudioFormat(name, codec, rate, k * 1000)
    return AudioFormat(name, codec, rate)


def format_help() -> str:
    return (
        "supported: " + ", ".join(_OPENAI) + " (the model's rate), pcm_/wav_/flac_<rate> (rate in "
        + "/".join(map(str, PCM_RATES)) + "), f32_<rate> (float32), ulaw_8000, alaw_8000, mp3_<rate>_<kbps> (e.g. mp3_44100_128), "
        "opus_<rate>_<kbps> (e.g. opus_48000_64), aac_<rate>_<kbps>"
    )


def get_format(name: str) -> AudioFormat:
    return resolve_format(name)


def supported_formats() -> tuple[str, ...]:
    """The OpenAI names (the codec_rate[_kbps] family is described by format_help)."""
    return tuple(_OPENAI)


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
