"""A multi-codebook talker (a tiny random CSM with its Mimi codec) served by the real server:
the OpenAI client and a WebSocket session get Mimi PCM (whole 80 ms frames, 1920 samples each),
seeded requests repeat exactly; the ZeroMQ client and the generate WebSocket stream each step's
frames, greedy frames equal to transformers' generate on the same folder."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import numpy as np
import openai
import pytest
import websockets

from streaming.zmq_client import ZmqClient
from tests.models.test_csm import hf_generate
from tests.support.tiny_models import load_hf_csm

from tests.e2e.helpers import WAIT_S, speak_session
from tests.support.server_proc import ServerProc, start_server
from tests.support.tiny_models import make_served_csm

pytestmark = pytest.mark.e2e

MIMI_FRAME_BYTES = 1920 * 2
MAX_FRAMES = 40


@pytest.fixture(scope="module")
def csm_folder(tmp_path_factory):
    return make_served_csm(tmp_path_factory.mktemp("csm") / "csm", seed=1, max_frames=MAX_FRAMES)


@pytest.fixture(scope="module")
def csm_server(tmp_path_factory, csm_folder) -> ServerProc:
    srv = start_server(tmp_path_factory.mktemp("csm-server") / "srv", "--model", str(csm_folder))
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
        audio, done = await speak_session(ws, {"voice": "1", "seed": 5}, "Hello there. How are you today?")
    assert len(done) == 2  # one utterance per sentence
    assert audio and len(audio) % MIMI_FRAME_BYTES == 0


PROMPT = [500, 91, 48, 93, 72, 101, 108, 108, 111, 46, 506]  # BOS "[0]Hello." end-of-text (ids < 512)


async def test_zmq_and_generate_ws_stream_frames_equal_transformers(csm_server: ServerProc, csm_folder):
    ref = hf_generate(load_hf_csm(csm_folder), PROMPT, 10).numpy()
    with ZmqClient(csm_server.zmq_endpoint, timeout_s=WAIT_S) as c:
        steps = list(c.generate(prompt_token_ids=PROMPT, sampling={"temperature": 0.0, "max_tokens": 10}))
    assert all(s.frames is not None and s.frames.shape == (len(s.token_ids), 4) for s in steps if s.token_ids)
    np.testing.assert_array_equal(np.concatenate([s.frames for s in steps if s.token_ids]), ref)
    url = csm_server.base_url.replace("http", "ws") + "/v1/generate/stream"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "generate", "prompt_token_ids": PROMPT,
                                  "sampling": {"temperature": 0.0, "max_tokens": 10}}))
        frames = []
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
            assert event["type"] in ("step", "done"), event
            if event["type"] == "done":
                break
            frames += event["frames"]
    np.testing.assert_array_equal(np.array(frames), ref)


@pytest.fixture(scope="module")
def one_stream_server(tmp_path_factory) -> ServerProc:
    # Mimi state for one stream only (the profile's codec.max_streams), utterances running to the
    # model length (a few seconds here), long enough to overlap a second request
    folder = make_served_csm(tmp_path_factory.mktemp("csm1") / "csm", seed=1, max_frames=400, ignore_eos=True,
                             codec={"max_streams": 1})
    srv = start_server(tmp_path_factory.mktemp("csm1-server") / "srv", "--model", str(folder))
    try:
        yield srv
    finally:
        srv.stop()


def test_audio_past_the_codec_streams_is_overloaded_and_the_server_goes_on(one_stream_server: ServerProc):
    # the engine has no codec stream for a second audio request: the client gets 429 overloaded
    # with Retry-After (the engine used to die on it), the first stream is untouched, and the
    # stream is free again once the first ends
    client = openai.OpenAI(base_url=one_stream_server.base_url + "/v1", api_key="none", max_retries=0)
    with client.audio.speech.with_streaming_response.create(model="omnistream", voice="0", input="Hello there.",
                                                            response_format="pcm", extra_body={"seed": 1}) as first:
        assert first.status_code == 200
        chunks = first.iter_bytes()
        got = next(chunks)
        with pytest.raises(openai.RateLimitError) as busy:
            client.audio.speech.create(model="omnistream", voice="1", input="Me too.", response_format="pcm")
        assert busy.value.response.headers["Retry-After"]
        assert busy.value.body["code"] == "overloaded" and "codec" in busy.value.body["message"]
        got += b"".join(chunks)
    assert len(got) % MIMI_FRAME_BYTES == 0 and len(got) >= 100 * MIMI_FRAME_BYTES  # ran on to its end (length)
    after = client.audio.speech.create(model="omnistream", voice="1", input="Me too.", response_format="pcm",
                                       extra_body={"max_new_tokens": 5})
    assert len(after.content) == 5 * MIMI_FRAME_BYTES
    assert one_stream_server.health() == 200
    with urllib.request.urlopen(one_stream_server.base_url + "/metrics", timeout=WAIT_S) as r:
        metrics = r.read().decode()
    assert 'omnistream_engine_refused_requests_total{engine="0"} 1.0' in metrics
    assert 'omnistream_engine_codec_streams{engine="0"} 0.0' in metrics
