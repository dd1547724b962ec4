"""A Qwen3-TTS CustomVoice folder served by the real server (`serve --model FOLDER`): the golden
tiny talker (tests/reference/qwen3_tts_golden.py) with a character tokenizer and a tiny 12 Hz
codec as its speech_tokenizer/. The OpenAI client and a WebSocket session get whole 12 Hz frames
of PCM (1920 samples each) in the folder's speakers, seeded requests repeat (ZeroMQ speech = HTTP), the voice list is
the speakers, and an unknown speaker is refused naming `voice`."""

from __future__ import annotations

import asyncio
import json

from pathlib import Path

import numpy as np
import openai
import pytest
import websockets

from streaming.zmq_client import ZmqClient
from streaming.zmq_protocol import ErrorReply, ZmqRequest, decode_reply, encode
from tests.e2e.helpers import WAIT_S, session_audio, speak_session
from tests.support.server_proc import ServerProc, start_server
from tests.support.tiny_qwen3_tts import make_served_qwen3_tts, text_of_ids

pytestmark = pytest.mark.e2e

FRAME_BYTES = 1920 * 2  # int16 PCM of one 12.5 Hz frame
MAX_FRAMES = 12
MAX_CHARS = 200


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory, qwen3_tts_golden) -> ServerProc:
    ckpt = qwen3_tts_golden("qwen3_tts_golden") / "custom_voice" / "checkpoint"
    folder = make_served_qwen3_tts(tmp_path_factory.mktemp("qwen3") / "cv", ckpt, max_frames=MAX_FRAMES,
                                   greedy_groups=True)
    srv = start_server(tmp_path_factory.mktemp("qwen3-server") / "srv", "--model", str(folder),
                       "--max-input-chars", str(MAX_CHARS))
    try:
        yield srv
    finally:
        srv.stop()


def speak(client: openai.OpenAI, seed: int, voice: str, text: str = "Hello there.") -> bytes:
    with client.audio.speech.with_streaming_response.create(
            model="omnistream", voice=voice, input=text, response_format="pcm", extra_body={"seed": seed}) as r:
        assert r.status_code == 200, r.text
        return b"".join(r.iter_bytes())


def test_openai_client_speaks_in_the_folders_speakers(qwen3_server: ServerProc):
    client = openai.OpenAI(base_url=qwen3_server.base_url + "/v1", api_key="none", max_retries=0)
    a, b, c = speak(client, 3, "alice"), speak(client, 3, "alice"), speak(client, 3, "bob")
    assert a == b  # seeded: the same frames, the same PCM
    for pcm in (a, c):
        assert 0 < len(pcm) <= MAX_FRAMES * FRAME_BYTES and len(pcm) % FRAME_BYTES == 0
    assert a != c  # another speaker's codec id in the prompt
    assert np.abs(np.frombuffer(a, dtype=np.int16)).max() > 100  # the codec's decode, not silence
    voices = client.get("/audio/voices", cast_to=object)
    assert [v["voice_id"] for v in voices["voices"]] == ["alice", "bob"] and voices["sample_rate"] == 24000
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="omnistream", voice="carol", input="Hi.", response_format="pcm")
    assert e.value.body["param"] == "voice" and "alice, bob" in e.value.body["message"]
    # OpenAI's instructions: the instruct turn in the prompt, so other frames than without
    with client.audio.speech.with_streaming_response.create(
            model="omnistream", voice="alice", input="Hello there.", response_format="pcm",
            instructions="Speak slowly.", extra_body={"seed": 3}) as r:
        assert r.status_code == 200, r.text
        d = b"".join(r.iter_bytes())
    assert d and len(d) % FRAME_BYTES == 0 and d != a
    # vllm-omni's language in the body: a codec language id in the prompt, so other frames
    e = speak_with(client, language="English")
    assert e and len(e) % FRAME_BYTES == 0 and e != a
    assert speak_with(client, language="Auto") == a
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.speech.create(model="omnistream", voice="alice", input="Hi.", response_format="pcm",
                                   extra_body={"language": "Klingon"})
    assert bad.value.body["param"] == "language" and "english" in bad.value.body["message"]


def speak_with(client: openai.OpenAI, **extra) -> bytes:
    with client.audio.speech.with_streaming_response.create(
            model="omnistream", voice="alice", input="Hello there.", response_format="pcm",
            extra_body={"seed": 3, **extra}) as r:
        assert r.status_code == 200, r.text
        return b"".join(r.iter_bytes())


async def test_ws_session_streams_qwen3_audio(qwen3_server: ServerProc):
    """vllm-omni's session.config language (one of the folder's, or Auto) and instructions are
    taken; an unknown language is an error naming it and the session goes on."""
    url = qwen3_server.base_url.replace("http", "ws") + "/v1/audio/speech/stream"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.config", "language": "Klingon"}))
        event = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
        assert event["type"] == "session.created", event
        event = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
        assert event["type"] == "error" and event["param"] == "language", event
        audio, done = await speak_session(ws, {"voice": "bob", "seed": 5, "language": "English",
                                               "instructions": "Cheerful."}, "Hello there. How are you today?")
    assert len(done) == 2  # one utterance per sentence
    assert audio and len(audio) % FRAME_BYTES == 0


def test_zmq_speech_equals_http(qwen3_server: ServerProc):
    """The ZeroMQ gateway's speech builds the same rows: the same seed gives the same PCM as
    POST /v1/audio/speech, and its steps carry the K=4 frames."""
    client = openai.OpenAI(base_url=qwen3_server.base_url + "/v1", api_key="none", max_retries=0)
    http = speak(client, 7, "bob")
    with ZmqClient(qwen3_server.zmq_endpoint, timeout_s=WAIT_S) as c:
        steps = list(c.speech("Hello there.", voice="bob", sampling={"seed": 7}))
    assert steps[-1].finished
    assert all(s.frames.shape == (len(s.token_ids), 4) for s in steps if s.token_ids)
    pcm = b"".join(s.audio.tobytes() for s in steps if s.audio is not None)
    assert pcm == http


def test_greedy_speech_frames_equal_the_reference(qwen3_server: ServerProc, qwen3_tts_golden):
    """The golden speaker_non_streaming case (alice, auto, non-streaming: CustomVoice's default)
    spoken as text through the ZeroMQ gateway, greedy with no penalty (the folder's groups are
    greedy): the frames equal the reference generate()'s, so tokenizer, prompt rows and the
    engine agree end to end."""
    case = np.load(Path(qwen3_tts_golden("qwen3_tts_golden")) / "custom_voice" / "speaker_non_streaming.npz")
    ids = case["text_ids"].tolist()
    text = text_of_ids(ids[ids.index(153) + 1 : -2])  # after tts_bos, before tts_eos, tts_pad
    n = len(case["frames"])
    with ZmqClient(qwen3_server.zmq_endpoint, timeout_s=WAIT_S) as c:
        steps = list(c.speech(text, voice="alice", sampling={"temperature": 0.0, "repetition_penalty": 1.0,
                                                             "max_tokens": n}))
    frames = np.concatenate([s.frames for s in steps if s.token_ids])
    np.testing.assert_array_equal(frames, case["frames"])


def test_zmq_streamed_text_is_spoken_whatever_its_timing(qwen3_server: ServerProc):
    """A speech request whose text arrives in pieces (stream_input, then appends): it speaks
    before the text is complete, and the frames do not depend on when the pieces arrive (the
    same seed with the pieces at once and 150 ms apart gives the same frames and PCM); an
    append to an id taking no text is refused naming `id`."""
    pieces = ["Hello there ", "how are ", "you today? ", "I am fine."]
    sampling = {"seed": 11, "max_tokens": MAX_FRAMES}
    with ZmqClient(qwen3_server.zmq_endpoint, timeout_s=WAIT_S) as c:
        fast = list(c.speech_streamed(pieces, voice="bob", sampling=sampling))
        slow = list(c.speech_streamed(pieces, voice="bob", sampling=sampling, interval_s=0.15))
    for steps in (fast, slow):
        assert steps[-1].finished and steps[-1].finish_reason in ("stop", "length")
    frames = [np.concatenate([s.frames for s in steps if s.token_ids]) for steps in (fast, slow)]
    np.testing.assert_array_equal(frames[0], frames[1])
    pcm = [b"".join(s.audio.tobytes() for s in steps if s.audio is not None) for steps in (fast, slow)]
    assert pcm[0] == pcm[1] and len(pcm[0]) % FRAME_BYTES == 0 and pcm[0]
    with ZmqClient(qwen3_server.zmq_endpoint, timeout_s=WAIT_S) as c:
        c.sock.send(encode(ZmqRequest("append", "nobody", input="more", final=True)))
        reply = decode_reply(c.sock.recv_multipart()[0])
        assert reply.code == "invalid_request" and reply.param == "id"
        # the whole text is bounded by --max-input-chars: the piece past it is refused, the
        # request goes on with the text it has
        c.sock.send(encode(ZmqRequest("speech", "long", input="Hello there ", voice="bob", stream_input=True)))
        c.sock.send(encode(ZmqRequest("append", "long", input="x" * MAX_CHARS)))
        c.sock.send(encode(ZmqRequest("append", "long", input="bye.", final=True)))
        replies = []
        while not (replies and getattr(replies[-1], "finished", False)):
            assert c.sock.poll(WAIT_S * 1000)
            replies.append(decode_reply(c.sock.recv_multipart()[0]))
    errors = [r for r in replies if isinstance(r, ErrorReply)]
    assert len(errors) == 1 and errors[0].param == "input" and "dropped" in errors[0].message
    assert any(r.audio is not None for r in replies if not isinstance(r, ErrorReply))


def test_a_custom_voice_model_takes_no_reference_clip(qwen3_server: ServerProc):
    client = openai.OpenAI(base_url=qwen3_server.base_url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="omnistream", voice="alice", input="Hi.", response_format="pcm",
                                   extra_body={"ref_audio": "AAAA", "task_type": "Base"})
    assert e.value.body["param"] in ("ref_audio", "task_type")
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="omnistream", voice="alice", input="Hi.", response_format="pcm",
                                   extra_body={"ref_audio": "AAAA"})
    assert e.value.body["param"] == "ref_audio" and "Base" in e.value.body["message"]


async def streamed_session(url: str, pieces: list[str], pause_s: float) -> tuple[bytes, list[dict]]:
    """A WebSocket session in stream_input mode: the pieces of one utterance (`pause_s`
    apart), input.flush, then a second utterance in one piece and session.close."""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.config", "voice": "bob", "seed": 5, "stream_input": True}))
        for piece in pieces:
            await ws.send(json.dumps({"type": "input.text", "text": piece}))
            await asyncio.sleep(pause_s)
        await ws.send(json.dumps({"type": "input.flush"}))
        await ws.send(json.dumps({"type": "input.text", "text": "Fine, thanks."}))
        await ws.send(json.dumps({"type": "session.close"}))
        return await session_audio(ws)


async def test_ws_stream_input_speaks_text_as_it_arrives(qwen3_server: ServerProc):
    """session.config stream_input: input.text pieces join one utterance that starts speaking
    before its text is complete; input.flush ends it and the next text opens another. The
    frames do not depend on when the pieces come: the same seed with the pieces at once and
    120 ms apart gives the same audio."""
    url = qwen3_server.base_url.replace("http", "ws") + "/v1/audio/speech/stream"
    pieces = ["Hello there ", "how are ", "you today? "]
    fast, done = await streamed_session(url, pieces, 0.0)
    slow, _ = await streamed_session(url, pieces, 0.12)
    assert len(done) == 2
    assert fast and len(fast) % FRAME_BYTES == 0 and fast == slow
    # audio.done names what each utterance said: the streamed one's whole text
    assert [(d["text"], d["sentence_text"]) for d in done] == [("".join(pieces),) * 2, ("Fine, thanks.",) * 2]
