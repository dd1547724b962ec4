"""A Qwen3-TTS Base (voice clone) folder served by the real server: the golden tiny Base talker
(tests/reference/qwen3_tts_golden.py, its speaker encoder included) with a tiny 12 Hz codec that
also encodes. It has no built-in voice: a request without one is refused naming `voice`; a clip
uploaded with its transcript is an ICL voice (x-vector + the clip's frames in the prompt, the
codec primed with them), one without a transcript the x-vector alone; both speak through the
OpenAI client and a WebSocket session, seeded requests repeat, and the upload's rules hold."""

from __future__ import annotations

import base64

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


async def test_vllm_omni_per_request_clip(clone_server: ServerProc):
    """vllm-omni's Base request: the clip inline in every request (ref_audio, base64 or a data:
    URL) with its transcript (ref_text) speaks as the same clip uploaded as a voice (same seed,
    same PCM); x_vector_only_mode as an upload without transcript; the clip is encoded once
    and cached. Refusals name the field."""
    srv = clone_server
    clip = wav_clip(0.8, rate=22050, channels=1)
    async with aiohttp.ClientSession() as http:
        assert (await upload(http, srv, "same", clip, transcript="Hi there."))[0] == 201
        assert (await upload(http, srv, "same-x", clip, transcript=None))[0] == 201

        async def speech(**body) -> tuple[int, bytes | dict]:
            body = {"input": "Hello there.", "response_format": "pcm", "seed": 3} | body
            async with http.post(srv.base_url + "/v1/audio/speech", json=body) as r:
                return r.status, (await r.read() if r.status == 200 else await r.json())

        b64 = base64.b64encode(clip).decode()
        status, icl = await speech(ref_audio=b64, ref_text="Hi there.", task_type="Base")
        assert status == 200 and icl == (await speech(voice="same"))[1]
        assert (await speech(ref_audio="data:audio/wav;base64," + b64, ref_text="Hi there."))[1] == icl  # cached
        status, xvec = await speech(ref_audio=b64, ref_text="Hi there.", x_vector_only_mode=True, voice="any")
        assert status == 200 and xvec == (await speech(voice="same-x"))[1] and xvec != icl
        for body, param in ((dict(ref_audio="https://example.com/a.wav"), "ref_audio"),
                            (dict(ref_audio="not base64!"), "ref_audio"),
                            (dict(ref_audio=base64.b64encode(b"not audio" * 50).decode()), "ref_audio"),
                            (dict(voice="same", ref_text="Hi."), "ref_text"),
                            (dict(voice="same", task_type="CustomVoice"), "task_type")):
            status, err = await speech(**body)
            assert status == 400 and err["error"]["param"] == param, (body, err)
