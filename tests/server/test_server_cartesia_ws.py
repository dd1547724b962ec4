"""Cartesia's /tts/websocket on a FakeEngine with the messages Pipecat's CartesiaTTSService sends
(_build_msg: transcript, continue, context_id, model_id, voice, output_format, add_timestamps),
plus cancel and the field errors. The `cartesia` SDK itself runs in tests/e2e/test_e2e_cartesia.py."""

import asyncio
import base64
import json

import pytest
import websockets

from tests.server.ws_support import recv_json
from tests.support.fake_engine import FakeEngine, chunk_marks, serve

SPS = 240
PCM = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}


def pipecat_msg(text: str, context_id: str, cont: bool = True, **fmt) -> str:
    return json.dumps({"transcript": text, "continue": cont, "context_id": context_id, "model_id": "sonic-2",
                       "voice": {"mode": "id", "id": "tara"}, "output_format": {**PCM, **fmt},
                       "add_timestamps": True, "use_normalized_timestamps": False})


async def until_done(ws, context_id: str) -> list[dict]:
    out = []
    async with asyncio.timeout(5):
        while True:
            m = await recv_json(ws)
            out.append(m)
            if m["type"] == "done" and m["context_id"] == context_id:
                return out


async def test_pipecat_turn_with_word_timestamps_and_flush():
    engine = FakeEngine(samples_per_step=SPS, step_delay=0.002)
    async with serve(engine) as s:
        async with websockets.connect(s.url("/tts/websocket?cartesia_version=2025-04-16", "ws"),
                                      additional_headers={"X-API-Key": "x"}) as ws:
            await ws.send(pipecat_msg("Hello there, ", "t1"))
            await ws.send(pipecat_msg("how are you today? ", "t1"))
            await ws.send(json.dumps({"transcript": "", "continue": True, "flush": True, "context_id": "t1",
                                      "output_format": PCM}))
            await ws.send(pipecat_msg("", "t1", cont=False))  # Pipecat's flush_audio: continue false
            events = await until_done(ws, "t1")
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "done" and "flush_done" in kinds and kinds.count("done") == 1
    pcm = b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == "chunk")
    assert chunk_marks(pcm, SPS) == [(0, k) for k in range(1, 6)]
    words, starts, ends = [], [], []
    for e in events:
        if e["type"] == "timestamps":
            ts = e["word_timestamps"]
            words += ts["words"]
            starts += ts["start"]
            ends += ts["end"]
    assert words == ["Hello", "there,", "how", "are", "you", "today?"]
    assert starts == sorted(starts) and ends[-1] == pytest.approx(len(pcm) / 2 / 24000, abs=0.002)


async def test_cancel_aborts_and_sends_nothing_more():
    engine = FakeEngine(samples_per_step=SPS, steps=400, step_delay=0.01)
    async with serve(engine) as s:
        async with websockets.connect(s.url("/tts/websocket", "ws")) as ws:
            await ws.send(pipecat_msg("A long answer. ", "c", cont=True))
            assert (await recv_json(ws))["type"] == "chunk"
            await ws.send(json.dumps({"context_id": "c", "cancel": True}))
            await ws.send(pipecat_msg("Next turn.", "d", cont=False))
            after = await until_done(ws, "d")
            # a chunk already on the wire may come first; none after the next context's audio
            late = [i for i, e in enumerate(after) if e.get("context_id") == "c"]
            first_d = next(i for i, e in enumerate(after) if e.get("context_id") == "d")
            assert all(i < first_d for i in late)
    assert engine.aborted == [engine.requests[0].request_id]


@pytest.mark.parametrize("patch,param", [
    ({"output_format": {"container": "ogg", "sample_rate": 24000}}, "output_format.container"),
    ({"output_format": {"container": "raw", "encoding": "pcm_s8", "sample_rate": 24000}}, "output_format.encoding"),
    ({"output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 12345}}, "output_format.sample_rate"),
    ({"output_format": {"container": "mp3", "sample_rate": 44100, "bit_rate": 1000}}, "output_format.bit_rate"),
    ({"voice": {"mode": "embedding", "id": "tara"}}, "voice.mode"),
    ({"voice": {"mode": "id", "id": "nobody"}}, "voice"),
    ({"add_phoneme_timestamps": True}, "add_phoneme_timestamps"),
    ({"speed": "fast"}, "speed"),
    ({"transcript": 5}, "transcript"),
    ({"mystery": 1}, "mystery"),
])
async def test_bad_requests_name_the_field(patch, param):
    async with serve() as s:
        async with websockets.connect(s.url("/tts/websocket", "ws")) as ws:
            msg = {**json.loads(pipecat_msg("Hi.", "e", cont=False)), **patch}
            await ws.send(json.dumps(msg))
            err = await recv_json(ws)
            assert (err["type"], err["code"], err["param"], err["context_id"]) == ("error", "invalid_field", param, "e")
            await ws.send(pipecat_msg("Still fine.", "ok", cont=False))
            assert (await until_done(ws, "ok"))[-1]["type"] == "done"


async def test_mulaw_8k_and_a_second_context_at_once():
    engine = FakeEngine(samples_per_step=SPS)
    async with serve(engine) as s:
        async with websockets.connect(s.url("/tts/websocket", "ws")) as ws:
            await ws.send(pipecat_msg("One.", "u", cont=False, encoding="pcm_mulaw", sample_rate=8000))
            await ws.send(pipecat_msg("Two.", "v", cont=False, encoding="pcm_f32le", sample_rate=16000))
            seen, done = [], set()
            async with asyncio.timeout(5):
                while done != {"u", "v"}:
                    m = await recv_json(ws)
                    seen.append(m)
                    if m["type"] == "done":
                        done.add(m["context_id"])
    n = engine.audio_samples_per_request()
    ulaw = b"".join(base64.b64decode(m["data"]) for m in seen if m["type"] == "chunk" and m["context_id"] == "u")
    f32 = b"".join(base64.b64decode(m["data"]) for m in seen if m["type"] == "chunk" and m["context_id"] == "v")
    assert abs(len(ulaw) - n // 3) <= 1 and abs(len(f32) // 4 - n * 2 // 3) <= 1
