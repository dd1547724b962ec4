"""Constants and helpers of the end-to-end tests.

The tiny default speaks noise, but every path is real. Facts about it the tests rely on:
- one codec frame = 7 audio tokens = 2048 samples = 4096 bytes of s16le PCM, and the Orpheus
  constraint lets end-of-speech (token 505) come only at a frame boundary, so an utterance
  of n audio tokens is exactly n // 7 frames of audio;
- sampling is seeded and per request, so a seeded request gives the same tokens whether it
  runs alone or in a batch (PCM may differ by float noise: we allow 1 LSB).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import openai

from tests.support.server_proc import ServerProc

SAMPLE_RATE = 24000
TOKENS_PER_FRAME = 7
FRAME_BYTES = 2048 * 2
END_OF_SPEECH = 505  # runner.models.default_model SPECIALS["<|end_of_speech|>"]
LONG_SEED = 1  # "Hello there." with seed 1 runs to max_new_tokens=700 without end-of-speech
WAIT_S = 60.0  # generous: the CPU is shared with other jobs


def frames_of(output_tokens: int, finish_reason: str) -> int:
    """Codec frames an utterance yields: its audio tokens (all output tokens but the
    end-of-speech token when it stopped on one) // 7."""
    audio_tokens = output_tokens - (1 if finish_reason == "stop" else 0)
    return audio_tokens // TOKENS_PER_FRAME


def max_lsb_diff(a: bytes, b: bytes) -> int:
    x = np.frombuffer(a, "<i2").astype(np.int32)
    y = np.frombuffer(b, "<i2").astype(np.int32)
    return int(np.abs(x - y).max()) if len(x) else 0


def speak_openai(client: openai.OpenAI, fmt: str, seed: int, max_new_tokens: int, text: str = "Hello there.") -> tuple[dict, list[bytes]]:
    with client.audio.speech.with_streaming_response.create(
        model="omnistream", voice="tara", input=text, response_format=fmt,
        extra_body={"max_new_tokens": max_new_tokens, "seed": seed},
    ) as r:
        assert r.status_code == 200, r.text
        return dict(r.headers), list(r.iter_bytes())


async def stats(http: aiohttp.ClientSession, server: ServerProc) -> dict:
    async with http.get(server.base_url + "/v1/engine/stats") as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def speak_http(http: aiohttp.ClientSession, server: ServerProc, seed: int, max_new_tokens: int,
                     text: str = "Hello there.") -> bytes:
    body = {"input": text, "voice": "tara", "response_format": "pcm", "seed": seed, "max_new_tokens": max_new_tokens}
    async with http.post(server.base_url + "/v1/audio/speech", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.read()


async def recv_event(ws, timeout: float = WAIT_S) -> dict:
    msg = await asyncio.wait_for(ws.recv(), timeout)
    assert isinstance(msg, str), f"expected a JSON event, got {len(msg)} binary bytes"
    return json.loads(msg)


async def speak_session(ws, config: dict, text: str) -> tuple[bytes, list[dict]]:
    """One WebSocket TTS session on an open `websockets` connection: session.config, the text,
    session.close; -> (the audio bytes, the audio.done events) once session.done arrives. An
    error event fails the test."""
    await ws.send(json.dumps({"type": "session.config", **config}))
    await ws.send(json.dumps({"type": "input.text", "text": text}))
    await ws.send(json.dumps({"type": "session.close"}))
    return await session_audio(ws)


async def session_audio(ws) -> tuple[bytes, list[dict]]:
    """Read a session to its session.done: (the audio bytes, the audio.done events). An error
    event fails the test."""
    audio, done = b"", []
    while True:
        msg = await asyncio.wait_for(ws.recv(), WAIT_S)
        if isinstance(msg, bytes):
            audio += msg
            continue
        event = json.loads(msg)
        assert event["type"] != "error", event
        if event["type"] == "audio.done":
            done.append(event)
        if event["type"] == "session.done":
            return audio, done
