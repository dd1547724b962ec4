"""Reference clips: decoding an upload to the codec's rate, and vllm-omni's per-request clips.

vllm-omni's Qwen3-TTS Base API takes the reference clip in every speech request (`ref_audio`,
`ref_text`, `x_vector_only_mode`). Here a clip is encoded once (its codes and x-vector, by the
engine: ipc.EncodeAudio) and kept in a bounded cache under the hash of its bytes and transcript,
so a client sending the same clip with each request pays for its encoding once, as an uploaded
voice does (server/tts/voice_store.py). Only inline clips (base64, or a data: URL): the server
fetches no URLs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections import OrderedDict

import av
import numpy as np

from server.tts.voice_store import ReferenceVoice

CLIP_CACHE_SIZE = 64  # per-request clips kept encoded (each: codes + an x-vector, a few hundred KB)


def decode_clip(data: bytes, sample_rate: int, max_seconds: float) -> np.ndarray:
    """Any container / codec FFmpeg reads -> int16 mono at `sample_rate`. ValueError naming
    `file` when it holds no decodable audio or runs past max_seconds."""
    try:
        with av.open(io.BytesIO(data), "r") as container:
            if not container.streams.audio:
                raise ValueError("file: holds no audio stream")
            resampler = av.AudioResampler(format="s16", layout="mono", rate=sample_rate)
            chunks, n, limit = [], 0, int(max_seconds * sample_rate)
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    n += chunks[-1].size
                if n > limit:
                    raise ValueError(f"file: the clip is longer than {max_seconds:g} s")
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except av.FFmpegError as e:
        raise ValueError(f"file: not a readable audio file ({e.strerror or e})") from None  # no errno, no "<none>"
    pcm = np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
    if pcm.size == 0:
        raise ValueError("file: the clip holds no samples")
    if pcm.size > int(max_seconds * sample_rate):
        raise ValueError(f"file: the clip is longer than {max_seconds:g} s")
    return pcm.astype(np.int16, copy=False)


def inline_clip(value: str, max_bytes: int) -> bytes:
    """`ref_audio`'s bytes: base64, bare or as a data: URL. ValueError (the message without a
    field name) for a URL to fetch, bad base64 or a clip over max_bytes."""
    if value.startswith("data:"):
        header, sep, value = value.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValueError("a data: URL must be base64 (data:audio/wav;base64,...)")
    elif "://" in value[:16]:
        raise ValueError("this server fetches no URLs: send the clip inline (base64 or a data: URL), or upload it "
                         "once as a voice (POST /v1/audio/voices)")
    if len(value) > 4 * (max_bytes // 3 + 1):
        raise ValueError(f"the clip is larger than {max_bytes} bytes")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not valid base64") from None


def clip_key(data: bytes, transcript: str) -> str:
    """The cache key (and the voice's name) of a clip and the transcript it is used with."""
    h = hashlib.sha256(data)
    h.update(b"\0" + transcript.encode("utf-8", "surrogatepass"))
    return "clip-" + h.hexdigest()[:24]


class ClipCache:
    """Per-request clips encoded once: ReferenceVoices by clip_key, least recently used dropped."""

    def __init__(self, size: int = CLIP_CACHE_SIZE):
        self.size = size
        self._voices: OrderedDict[str, ReferenceVoice] = OrderedDict()

    def get(self, key: str) -> ReferenceVoice | None:
        voice = self._voices.get(key)
        if voice is not None:
            self._voices.move_to_end(key)
        return voice

    def put(self, voice: ReferenceVoice) -> None:
        self._voices[voice.name] = voice
        self._voices.move_to_end(voice.name)
        while len(self._voices) > self.size:
            self._voices.popitem(last=False)

    def __len__(self) -> int:
        return len(self._voices)
