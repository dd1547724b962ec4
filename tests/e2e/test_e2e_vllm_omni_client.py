"""A client written for vllm-omni's /v1/audio/speech/stream (its documented messages: a
session.config with response_format pcm and stream_audio, input.text pieces, input.done; it reads
audio.start / binary PCM / audio.done by sentence_index until session.done with total_sentences)
against the real server, changing only the URL."""

from __future__ import annotations

import asyncio
import json

import websockets

from tests.e2e.helpers import FRAME_BYTES, WAIT_S, frames_of
from tests.support.server_proc import ServerProc


async def vllm_omni_client(url: str, pieces: list[str], config: dict) -> tuple[list[dict], dict[int, bytes], dict]:
    """What vllm-omni's streaming example does: (audio.start events, PCM per sentence, session.done)."""
    starts: list[dict] = []
    audio: dict[int, bytes] = {}
    dones: list[dict] = []
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.config", **config}))
        for piece in pieces:
            await ws.send(json.dumps({"type": "input.text", "text": piece}))
        await ws.send(json.dumps({"type": "input.done"}))
        current = None
        async with asyncio.timeout(WAIT_S):
            async for msg in ws:
                if isinstance(msg, bytes):
                    audio[current] += msg
                    continue
                event = json.loads(msg)
                assert event["type"] != "error", event
                if event["type"] == "audio.start":
                    current = event["sentence_index"]
                    audio[current] = b""
                    starts.append(event)
                elif event["type"] == "audio.done":
                    assert event["sentence_index"] == current
                    dones.append(event)
                elif event["type"] == "session.done":
                    return starts, audio, event | {"dones": dones}
    raise AssertionError("the session ended without session.done")


async def test_a_vllm_omni_client_switches_by_changing_its_url(server: ServerProc):
    config = {"voice": "tara", "response_format": "pcm", "stream_audio": True, "task_type": "CustomVoice",
              "language": "Auto", "max_new_tokens": 70, "seed": 3}
    starts, audio, done = await vllm_omni_client(
        server.ws_url + "/v1/audio/speech/stream", ["Hello there. How are", " you today? Fine"], config)
    assert [s["sentence_text"] for s in starts] == ["Hello there.", "How are you today?", "Fine"]
    assert [s["sentence_index"] for s in starts] == [0, 1, 2]
    assert done["total_sentences"] == 3
    for d in done["dones"]:
        n = frames_of(d["usage"]["output_tokens"], d["finish_reason"])
        assert len(audio[d["sentence_index"]]) == n * FRAME_BYTES
