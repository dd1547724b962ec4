"""vllm-omni's names on /v1/audio/speech/stream: a client written for vllm-omni's streaming TTS
WebSocket (`input.done`, `sentence_index` / `sentence_text`, `total_sentences`, `task_type` /
`language` / `instructions` / `stream_audio` in session.config) works by changing its URL."""

import json

import pytest
import websockets

from tests.server.test_server_tts_ws import SPS, collect_session
from tests.server.ws_support import recv_json
from tests.support.fake_engine import FakeEngine, serve


async def test_a_vllm_omni_client_session_end_to_end():
    engine = FakeEngine(samples_per_step=SPS, step_delay=0.002)
    async with serve(engine) as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            assert (await recv_json(ws))["type"] == "session.created"
            # vllm-omni's client: config first, text in pieces, input.done; no input.flush.
            config = {"type": "session.config", "voice": "leo", "response_format": "pcm", "stream_audio": True,
                      "task_type": "CustomVoice", "language": "Auto", "instructions": ""}
            await ws.send(json.dumps(config))
            assert (await recv_json(ws))["type"] == "session.updated"
            for piece in ("Hello there. How", " are you? And the", " tail"):
                await ws.send(json.dumps({"type": "input.text", "text": piece}))
            await ws.send(json.dumps({"type": "input.flush"}))  # omnistream's flush: indices go on across it
            await ws.send(json.dumps({"type": "input.text", "text": "After the flush."}))
            await ws.send(json.dumps({"type": "input.done"}))
            events, audio = await collect_session(ws)
            assert ws.close_code == 1000
    starts = [e for e in events if e["type"] == "audio.start"]
    dones = [e for e in events if e["type"] == "audio.done"]
    texts = ["Hello there.", "How are you?", "And the tail", "After the flush."]
    assert [e["sentence_text"] for e in starts] == texts
    assert [e["sentence_index"] for e in starts] == [0, 1, 2, 3] == [e["sentence_index"] for e in dones]
    assert all(e["sentence_index"] == e["utterance"] for e in starts + dones)
    assert events[-1] == {"type": "session.done", "total_sentences": 4}
    assert sorted(audio) == [0, 1, 2, 3] and all(len(a) == 5 * SPS * 2 for a in audio.values())


async def test_total_sentences_counts_a_failed_sentence_and_input_done_with_nothing_buffered():
    async with serve(FakeEngine(samples_per_step=SPS)) as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "input.done"}))
            events, _ = await collect_session(ws)
            assert events == [{"type": "session.done", "total_sentences": 0}] and ws.close_code == 1000


@pytest.mark.parametrize(
    "config,param,words",
    [
        ({"task_type": "VoiceDesign"}, "task_type", "model is task_type 'CustomVoice'"),
        ({"task_type": "Base"}, "task_type", "model is task_type 'CustomVoice'"),
        ({"task_type": "Clone"}, "task_type", "CustomVoice, VoiceDesign, Base"),
        ({"stream_input": True}, "stream_input", "whole sentences only"),
        ({"task_type": 3}, "task_type", "str"),
        ({"language": "Chinese"}, "language", "Auto"),
        ({"instructions": "whisper it"}, "instructions", "instructions"),
        ({"stream_audio": False}, "stream_audio", "true"),
        ({"stream_audio": "yes"}, "stream_audio", "bool"),
        ({"response_format": "wav"}, "response_format", "pcm"),
    ],
)
async def test_a_vllm_omni_value_omnistream_cannot_honour_names_its_field(config, param, words):
    async with serve(FakeEngine(samples_per_step=SPS)) as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "session.config", **config}))
            err = await recv_json(ws)
            assert (err["type"], err["code"], err["param"]) == ("error", "invalid_field", param)
            assert words in err["message"], err["message"]
            # the session goes on
            await ws.send(json.dumps({"type": "input.text", "text": "Fine."}))
            await ws.send(json.dumps({"type": "input.done"}))
            events, _ = await collect_session(ws)
            assert events[-1] == {"type": "session.done", "total_sentences": 1}


async def test_input_done_extra_field_and_input_after_done_are_refused():
    async with serve(FakeEngine(samples_per_step=SPS, step_delay=0.01)) as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "input.done", "now": True}))
            err = await recv_json(ws)
            assert (err["code"], err["param"]) == ("invalid_field", "now")
            await ws.send(json.dumps({"type": "input.text", "text": "One."}))
            await ws.send(json.dumps({"type": "input.done"}))
            await ws.send(json.dumps({"type": "input.text", "text": "Too late."}))
            events, _ = await collect_session(ws)
            late = [e for e in events if e["type"] == "error"]
            assert [(e["code"], e["param"]) for e in late] == [("invalid_state", "type")]
            assert events[-1] == {"type": "session.done", "total_sentences": 1}
