import base64
import io
import struct
import wave

import numpy as np
import pytest

from streaming.encoders import (
    AudioFormat,
    UnsupportedFormat,
    array_bytes,
    array_header,
    b64,
    get_format,
    pcm16_bytes,
    resolve_format,
    supported_formats,
    wav_header,
)
from tests.streaming.decode import decode, leading_delay, streamed_slack


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
    data = get_format("wav").whole_file(samples, 24000)
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
    assert get_format("pcm").whole_file(np.array([513], np.int16), 24000) == b"\x01\x02"


def test_wav_header_rejects_impossible_sizes():
    with pytest.raises(ValueError):
        wav_header(24000, 2**32)


def test_names_resolve_to_codec_rate_and_bit_rate():
    assert resolve_format("mp3") == AudioFormat("mp3", "mp3", None, 64_000)
    assert resolve_format("mp3_44100_128") == AudioFormat("mp3_44100_128", "mp3", 44100, 128_000)
    assert resolve_format("mp3_44100").bit_rate == 128_000  # ElevenLabs' name without a bit rate
    assert resolve_format("pcm_16000") == AudioFormat("pcm_16000", "pcm", 16000)
    assert resolve_format("ulaw_8000").content_type == "audio/basic"
    assert resolve_format("opus_48000_64").content_type == "audio/ogg"
    assert {"mp3", "opus", "aac", "flac", "wav", "pcm"} == set(supported_formats())
    # every ElevenLabs output_format the SDK and the LiveKit plugin name
    for name in ("mp3_22050_32", "mp3_24000_48", "mp3_44100_32", "mp3_44100_64", "mp3_44100_96", "mp3_44100_192",
                 "opus_48000_32", "opus_48000_192", "pcm_8000", "pcm_22050", "pcm_24000", "pcm_32000", "pcm_44100",
                 "pcm_48000", "ulaw_8000", "alaw_8000"):
        assert resolve_format(name).name == name


@pytest.mark.parametrize("name,says", [
    ("ogg", "not a format"), ("mp3_44100_999", "bit rates"), ("pcm_12345", "rates"), ("ulaw_16000", "rates"),
    ("pcm_16000_64", "no bit rate"), ("", "not a format"), ("MP3", "not a format"),
])
def test_bad_names_say_what_is_supported(name, says):
    with pytest.raises(UnsupportedFormat) as e:
        get_format(name)
    assert e.value.name == name and says in str(e.value)


def speechy(seconds: float = 1.5, rate: int = 24000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(0)
    x = 7000 * np.sin(2 * np.pi * (180 + 60 * t) * t) + rng.normal(0, 300, t.size)
    return x.astype(np.int16)


def streamed(fmt: AudioFormat, samples: np.ndarray, sizes=(2048, 2048, 4096, 8192, 16384)) -> tuple[bytes, int]:
    """The stream encoding in the engine's growing chunk sizes; also how many chunks it took
    before the first bytes came out."""
    enc = fmt.stream(24000)
    parts = [enc.start()]
    i = k = 0
    while i < samples.size:
        n = sizes[min(k, len(sizes) - 1)]
        parts.append(enc.encode(samples[i:i + n]))
        i, k = i + n, k + 1
    parts.append(enc.finish())
    first = next((j for j, p in enumerate(parts) if p), len(parts))
    return b"".join(parts), first


ALL = ["pcm", "wav", "mp3", "opus", "aac", "flac", "pcm_8000", "pcm_16000", "pcm_22050", "pcm_44100", "pcm_48000",
       "ulaw_8000", "alaw_8000", "mp3_44100_128", "mp3_22050_32", "opus_48000_64", "wav_16000"]


@pytest.mark.parametrize("name", ALL)
def test_streamed_encoding_decodes_like_the_one_shot_file(name):
    """No seam at chunk boundaries: the streamed encode decodes to the same audio as a one-shot
    encode of the whole utterance (bit-exact for PCM / WAV / FLAC, within the codec's noise for
    the lossy ones), with the same duration (a streamed MP3 / AAC carries its encoder delay and
    last frame's padding, which only a whole file's header can tell a decoder to trim)."""
    fmt = resolve_format(name)
    x = speechy()
    data, first = streamed(fmt, x)
    assert first <= 2, "audio must leave the encoder while the stream goes on"
    ys, rate = decode(data, fmt)
    yw, rate_w = decode(fmt.whole_file(x, 24000), fmt)
    assert rate == rate_w
    expect = round(x.size * rate / 24000)
    assert expect <= len(ys) <= expect + streamed_slack(fmt, rate)
    if fmt.codec == "aac":  # ADTS has no way to say "skip the priming", a whole file neither
        assert len(yw) == len(ys)
        lag = 0
    else:
        assert len(yw) == expect, "a whole file decodes to exactly the input's duration"
        lag = leading_delay(fmt)
    a, b = ys[lag:lag + len(yw)].astype(np.float64), yw.astype(np.float64)
    if fmt.codec in ("pcm", "wav", "flac") and fmt.sample_rate in (None, 24000):
        assert np.array_equal(a, b)
    else:
        # resampling in chunks vs at once differs by rounding; lossy codecs amplify that a little
        err = np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2))
        assert err < 0.05, err


def test_lossy_stream_keeps_the_signal():
    """Against the input itself (not our own one-shot encode): the streamed MP3 tracks it."""
    fmt = resolve_format("mp3_44100_128")
    x = speechy()
    y, rate = decode(streamed(fmt, x)[0], fmt)
    ref = resolve_format("pcm_44100").whole_file(x, 24000)
    r = np.frombuffer(ref, "<i2").astype(np.float64)
    seg = y[leading_delay(fmt):leading_delay(fmt) + r.size].astype(np.float64)
    snr = 10 * np.log10(np.sum(r ** 2) / np.sum((seg - r) ** 2))
    assert snr > 20, snr


def test_whole_wav_has_exact_lengths_at_any_rate():
    data = resolve_format("wav_16000").whole_file(speechy(1.0), 24000)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnframes()) == (16000, 16000)
    assert struct.unpack("<I", data[40:44])[0] == 32000


def test_an_empty_stream_ends_cleanly():
    """A request that produced no audio: finishing the encoder neither fails nor invents audio
    (the FLAC header alone; the others: nothing at all)."""
    for name in ("mp3", "aac", "opus", "flac", "pcm_16000"):
        fmt = resolve_format(name)
        enc = fmt.stream(24000)
        data = enc.start() + enc.finish()
        assert data == b"" if name != "flac" else len(decode(data, fmt)[0]) == 0


def test_b64_and_array_helpers():
    assert base64.b64decode(b64(b"\x00\xffabc")) == b"\x00\xffabc"
    rows = np.arange(6, dtype=">f4").reshape(1, 2, 3)
    raw = array_bytes(rows)
    assert np.array_equal(np.frombuffer(raw, dtype="<f4").reshape(1, 2, 3), rows)
    assert array_header(rows) == {"dtype": "float32", "shape": [1, 2, 3]}
    bf16 = np.zeros((2, 1, 4), dtype=np.uint16)
    assert array_header(bf16, "bfloat16")["dtype"] == "bfloat16"
    assert array_header(bf16, "float16")["dtype"] == "uint16"
