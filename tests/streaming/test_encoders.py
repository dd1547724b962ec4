import base64
import io
import struct
import wave

import numpy as np
import pytest

from streaming import encoders
from streaming.encoders import (
    AudioFormat,
    UnsupportedFormat,
    array_bytes,
    array_header,
    b64,
    get_format,
    pcm16_bytes,
    register_format,
    supported_formats,
    wav_header,
)


def test_pcm16_bytes_is_little_endian_passthrough():
    samples = np.array([0, 1, -1, 32767, -32768], dtype=np.int16)
    data = pcm16_bytes(samples)
    assert data == struct.pack("<5h", 0, 1, -1, 32767, -32768)
    assert pcm16_bytes(samples.astype(">i2")) == data  # big-endian input is converted


def test_pcm16_bytes_rejects_non_int16():
    with pytest.raises(TypeError):
        pcm16_bytes(np.zeros(4, dtype=np.float32))


def test_whole_wav_file_parses_with_exact_sizes():
    samples = (np.arange(2400) % 100).astype(np.int16)
    data = get_format("wav").whole_file(pcm16_bytes(samples), 24000)
    assert len(data) == 44 + 2 * len(samples)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 24000, 2400)
        assert np.array_equal(np.frombuffer(w.readframes(2400), dtype="<i2"), samples)


def test_streaming_wav_header_says_unknown_length():
    enc = get_format("wav").stream(24000)
    head = enc.start()
    assert len(head) == 44
    assert head[:4] == b"RIFF" and head[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", head[4:8])[0] == 0xFFFFFFFF
    assert head[36:40] == b"data" and struct.unpack("<I", head[40:44])[0] == 0xFFFFFFFF
    channels, rate, byte_rate, align, bits = struct.unpack("<HIIHH", head[22:36])
    assert (channels, rate, byte_rate, align, bits) == (1, 24000, 48000, 2, 16)
    chunk = np.array([5, -5], dtype=np.int16)
    assert enc.encode(chunk) == pcm16_bytes(chunk)
    assert enc.finish() == b""


def test_pcm_stream_has_no_header():
    enc = get_format("pcm").stream(24000)
    assert enc.start() == b"" and enc.finish() == b""
    assert get_format("pcm").content_type == "audio/pcm"
    assert get_format("pcm").whole_file(b"\x01\x02", 24000) == b"\x01\x02"


def test_wav_header_rejects_impossible_sizes():
    with pytest.raises(ValueError):
        wav_header(24000, 2**32)


def test_registry_lists_and_rejects():
    assert {"pcm", "wav"} <= set(supported_formats())
    with pytest.raises(UnsupportedFormat) as e:
        get_format("mp3")
    assert e.value.name == "mp3"


def test_registry_takes_new_formats():
    fmt = AudioFormat("raw8", "audio/x-raw8", stream=lambda sr: encoders._PcmStream(), whole_file=lambda p, sr: p)
    register_format(fmt)
    try:
        assert get_format("raw8") is fmt
        assert "raw8" in supported_formats()
    finally:
        encoders._FORMATS.pop("raw8")


def test_b64_and_array_helpers():
    assert base64.b64decode(b64(b"\x00\xffabc")) == b"\x00\xffabc"
    rows = np.arange(6, dtype=">f4").reshape(1, 2, 3)
    raw = array_bytes(rows)
    assert np.array_equal(np.frombuffer(raw, dtype="<f4").reshape(1, 2, 3), rows)
    assert array_header(rows) == {"dtype": "float32", "shape": [1, 2, 3]}
    bf16 = np.zeros((2, 1, 4), dtype=np.uint16)
    assert array_header(bf16, "bfloat16")["dtype"] == "bfloat16"
    assert array_header(bf16, "float16")["dtype"] == "uint16"
