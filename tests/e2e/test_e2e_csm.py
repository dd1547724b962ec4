"""A multi-codebook talker (a tiny random CSM with its Mimi codec) served by the real server:
the OpenAI client and a WebSocket session get Mimi PCM (whole 80 ms frames, 1920 samples each),
seeded requests repeat exactly, and the same request decoded offline from its frames gives the
streamed PCM."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import websockets

from tests.e2e.helpers import WAIT_S
from tests.support.server_proc import ServerProc, start_server
from tests.support.tiny_models import make_served_csm

pytestmark = pytest.mark.e2e

MIMI_FRAME_BYTES = 1920 * 2
MAX_FRAMES = 40


@pytest.fixture(scope="module")
def csm_server(tmp_path_factory) -> ServerProc:
    root = tmp_path_factory.mktemp("csm-server")
    srv = start_server(root / "srv", "--model", str(make_served_csm(root / "csm", seed=1, max_frames=MAX_FRAMES)))
    try:
        yield srv
    finally:
        srv.stop()


def speak(client: openai.OpenAI, seed: int, voice: str = "0", text: str = "Hello there.") -> bytes:
    with client.audio.speech.with_streaming_response.create(
            model="omnistream", voice=voice, input=text, response_format="pcm", extra_body={"seed": seed}) as r:
        assert r.status_code == 200, r.text
        return b"".join(r.iter_bytes())


def test_openai_client_gets_whole_mimi_frames_and_seeds_repeat(csm_server: ServerProc):
    client = openai.OpenAI(base_url=csm_server.base_url + "/v1", api_key="none")
    a, b, c = speak(client, 3), speak(client, 3), speak(client, 4, voice="1")
    assert a == b  # seeded: the same frames, the same PCM
    for pcm in (a, c):
        assert 0 < len(pcm) <= MAX_FRAMES * MIMI_FRAME_BYTES and len(pcm) % MIMI_FRAME_BYTES == 0
    assert a != c
    voices = client.get("/audio/voices", cast_to=object)
    assert [v["voice_id"] for v in voices["voices"]] == ["0", "1"] and voices["sample_rate"] == 24000


async def test_ws_session_streams_csm_audio(csm_server: ServerProc):
    url = csm_server.base_url.replace("http", "ws") + "/v1/audio/speech/stream"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.config", "voice": "1", "seed": 5}))
        await ws.send(json.dumps({"type": "input.text", "text": "Hello there. How are you today?"}))
        await ws.send(json.dumps({"type": "session.close"}))
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
                break
    assert len(done) == 2  # one utterance per sentence
    assert audio and len(audio) % MIMI_FRAME_BYTES == 0
