"""A Qwen3-TTS Base (voice clone) folder served by the real server: the golden tiny Base talker
(tests/reference/qwen3_tts_golden.py, its speaker encoder included) with a tiny 12 Hz codec that
also encodes. It has no built-in voice: a request without one is refused naming `voice`; a clip
uploaded with its transcript is an ICL voice (x-vector + the clip's frames in the prompt, the
codec primed with them), one without a transcript the x-vector alone; both speak through the
OpenAI client and a WebSocket session, seeded requests repeat, and the upload's rules hold."""

from __future__ import annotations

import aiohttp
import numpy as np
import openai
import pytest
import websockets

from tests.e2e.helpers import speak_session
from tests.e2e.test_e2e_voices import upload, wav_clip
from tests.support.server_proc import ServerProc, start_server
from tests.support.tiny_qwen3_tts import make_served_qwen3_tts

pytestmark = pytest.mark.e2e

FRAME_BYTES = 1920 * 2
MAX_FRAMES = 10


@pytest.fixture(scope="module")
def clone_server(tmp_path_factory, qwen3_tts_golden) -> ServerProc:
    ckpt = qwen3_tts_golden("qwen3_tts_golden") / "base" / "checkpoint"
    root = tmp_path_factory.mktemp("qwen3-base")
    folder = make_served_qwen3_tts(root / "base", ckpt, max_frames=MAX_FRAMES, encoder=True)
    srv = start_server(root / "srv", "--model", str(folder), "--voices-dir", str(root / "voices"))
    try:
        yield srv
    finally:
        srv.stop()


def speak(srv: ServerProc, voice: str, text: str = "Hello there.", seed: int = 1) -> bytes:
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
    with client.audio.speech.with_streaming_response.create(model="omnistream", voice=voice, input=text,
                                                            response_format="pcm", extra_body={"seed": seed}) as r:
        assert r.status_code == 200, r.text
        return b"".join(r.iter_bytes())


async def test_clone_voices_upload_and_speak(clone_server: ServerProc):
    srv = clone_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:  # no built-in voice to fall back on
        client.audio.speech.create(model="omnistream", voice="", input="Hi.", response_format="pcm")
    assert e.value.body["param"] == "voice" and "uploaded voices only" in e.value.body["message"]
    async with aiohttp.ClientSession() as http:
        status, body = await upload(http, srv, "icl", wav_clip(1.0))
        assert status == 201, body
        assert (body["frames"], body["speaker"], body["speaker_embedding"]) == (13, "", True)
        status, body = await upload(http, srv, "xvec", wav_clip(0.6, rate=16000, channels=1), transcript=None)
        assert status == 201 and body["transcript"] == "" and body["speaker_embedding"], body
        status, body = await upload(http, srv, "spk", wav_clip(0.5), speaker="alice")
        assert status == 400 and body["error"]["param"] == "speaker", body
        async with http.get(srv.base_url + "/v1/audio/voices") as r:
            listed = [v["voice_id"] for v in (await r.json())["voices"]]
        assert listed == ["icl", "xvec"]
    icl, xvec = speak(srv, "icl"), speak(srv, "xvec")
    for pcm in (icl, xvec):
        assert 0 < len(pcm) <= MAX_FRAMES * FRAME_BYTES and len(pcm) % FRAME_BYTES == 0
        assert np.abs(np.frombuffer(pcm, np.int16)).max() > 100
    assert speak(srv, "icl") == icl  # seeded: the same frames, the same (primed) decode
    assert icl != xvec
    url = srv.base_url.replace("http", "ws") + "/v1/audio/speech/stream"
    async with websockets.connect(url) as ws:
        audio, done = await speak_session(ws, {"voice": "xvec", "seed": 1, "task_type": "Base"}, "Hello there.")
    assert len(done) == 1 and audio == xvec  # the session builds the same prompt
    async with aiohttp.ClientSession() as http:
        async with http.delete(srv.base_url + "/v1/audio/voices/xvec") as r:
            assert r.status == 204
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="omnistream", voice="xvec", input="Hi.", response_format="pcm")
    assert e.value.body["param"] == "voice"
