"""An independent decoder for the tests: FFmpeg through PyAV (the server encodes with the same
libraries, but decoding is FFmpeg's demuxer + decoder, not our code), plus each codec's
duration tolerance."""

from __future__ import annotations

import io

import av
import numpy as np

from streaming.encoders import AudioFormat

# Samples a streamed encode may add in front of and after the audio, at the output rate:
# codecs whose container cannot say "skip the encoder's delay" (MP3 without its Xing/LAME frame,
# AAC in ADTS) decode with the encoder delay and the last frame's padding. Ogg Opus carries its
# pre-skip and end trim; the rest are sample-exact.
_MP3_FRAME_HIGH, _MP3_FRAME_LOW = 1152, 576  # MPEG-1 (>= 32 kHz) / MPEG-2 frames
_LAME_DELAY = 576 + 529  # LAME's encoder delay + the decoder's
_AAC_FRAME = 1024  # and its priming, one frame


def streamed_slack(fmt: AudioFormat, rate: int) -> int:
    """Extra decoded samples a streamed encode may carry (delay + up to one frame of padding)."""
    if fmt.codec == "mp3":
        return _LAME_DELAY + (_MP3_FRAME_HIGH if rate >= 32000 else _MP3_FRAME_LOW)
    if fmt.codec == "aac":
        return 2 * _AAC_FRAME
    return 0


def leading_delay(fmt: AudioFormat) -> int:
    """Decoded samples before the first input sample in a streamed encode."""
    return {"mp3": _LAME_DELAY, "aac": _AAC_FRAME}.get(fmt.codec, 0)


def decode(data: bytes, fmt: AudioFormat, source_rate: int = 24000) -> tuple[np.ndarray, int]:
    """(int samples at the decoded rate, decoded rate); raw formats are read as they are."""
    rate = fmt.rate(source_rate)
    if fmt.codec == "pcm":
        return np.frombuffer(data, "<i2").astype(np.int32), rate
    kw = {}
    if fmt.codec in ("ulaw", "alaw"):
        kw = {"format": "mulaw" if fmt.codec == "ulaw" else "alaw", "options": {"sample_rate": str(rate)}}
    with av.open(io.BytesIO(data), **kw) as container:
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
        decoded_rate = container.streams.audio[0].rate
    x = np.concatenate(frames) if frames else np.zeros(0)
    if x.dtype.kind == "f":
        x = np.round(x * 32768)
    return x.astype(np.int32), decoded_rate
