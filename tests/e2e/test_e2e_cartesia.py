"""The official `cartesia` SDK (4.2) against the real server, changing only its WebSocket base
URL: one context pushed in pieces, word timestamps and audio received through the SDK's own
context API. Skipped, saying so, when the SDK is not installed (not in the test extras)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.e2e


def test_cartesia_sdk_context_streams_audio_and_word_timestamps(server):
    cartesia = pytest.importorskip("cartesia", reason="the cartesia SDK is not installed")
    ws_base = server.base_url.replace("http://", "ws://")
    client = cartesia.Cartesia(api_key="unused", base_url=server.base_url, websocket_base_url=ws_base)
    fmt = {"container": "raw", "encoding": "pcm_f32le", "sample_rate": 44100}  # the SDK's own default
    with client.tts.websocket_connect() as conn:
        ctx = conn.context(model_id="sonic-2", voice={"mode": "id", "id": "tara"}, output_format=fmt,
                           add_timestamps=True)
        for piece in ("Hello there, ", "how are ", "you today? "):
            ctx.push(piece)
        ctx.no_more_inputs()
        audio, words, starts = [], [], []
        for event in ctx.receive():
            if event.type == "chunk" and event.audio:
                audio.append(np.frombuffer(event.audio, "<f4"))
            elif event.type == "timestamps" and event.word_timestamps:
                words += event.word_timestamps.words
                starts += event.word_timestamps.start
    pcm = np.concatenate(audio)
    assert pcm.size > 0 and np.abs(pcm).max() <= 1.0
    assert words == ["Hello", "there,", "how", "are", "you", "today?"]
    # a word of a segment that yielded no audio starts where the audio ends; the stated times are
    # rounded to the ms and the resampled length to a sample, so allow 1 ms
    assert starts == sorted(starts) and starts[-1] <= pcm.size / 44100 + 1e-3
