"""ElevenLabs multi-stream-input / stream-input on a FakeEngine, driven with the exact messages
LiveKit's plugin 1.8.9 and Pipecat 1.14 send (read from their installed source; the plugins
themselves run against a real server in tests/e2e/test_e2e_voice_agents.py)."""

import asyncio
import base64
import json
import time

import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from tests.server.ws_support import recv_json
from tests.support.fake_engine import FakeEngine, chunk_marks, serve

SPS = 240
LIVEKIT_QUERY = ("model_id=eleven_turbo_v2_5&output_format=pcm_24000&enable_ssml_parsing=false&enable_logging=true"
                 "&inactivity_timeout=180&apply_text_normalization=auto&sync_alignment=true")
MULTI = "/v1/text-to-speech/tara/multi-stream-input?"


async def until_final(ws, context_id: str, timeout: float = 5.0) -> list[dict]:
    """Messages up to and including the context's isFinal."""
    out = []
    async with asyncio.timeout(timeout):
        while True:
            m = await recv_json(ws, timeout)
            out.append(m)
            if m.get("isFinal") and m.get("contextId") == context_id:
                return out


def audio_of(messages: list[dict], context_id: str) -> bytes:
    return b"".join(base64.b64decode(m["audio"]) for m in messages if m.get("contextId") == context_id and m.get("audio"))


def chars_of(messages: list[dict], context_id: str) -> str:
    return "".join(c for m in messages if m.get("contextId") == context_id and m.get("alignment")
                   for c in m["alignment"]["chars"])


async def livekit_turn(ws, context_id: str, sentences: list[str]) -> None:
    """What LiveKit's _Connection._send_loop writes for one turn (auto_mode: one sentence per
    message, flushed), then close_context."""
    await ws.send(json.dumps({"text": " ", "voice_settings": {}, "context_id": context_id}))
    for s in sentences:
        await ws.send(json.dumps({"text": s + " ", "context_id": context_id, "flush": True}))
    await ws.send(json.dumps({"text": "", "context_id": context_id, "flush": True}))
    await ws.send(json.dumps({"context_id": context_id, "close_context": True}))


async def test_livekit_turns_on_one_socket():
    engine = FakeEngine(samples_per_step=SPS, step_delay=0.002)
    async with serve(engine, api_key="k") as s:
        async with websockets.connect(s.url(MULTI + LIVEKIT_QUERY, "ws"), additional_headers={"xi-api-key": "k"}) as ws:
            await livekit_turn(ws, "c1", ["Hello there.", "How are you?"])
            first = await until_final(ws, "c1")
            await livekit_turn(ws, "c2", ["Second turn."])
            second = await until_final(ws, "c2")
    assert all(m.get("contextId") == "c1" for m in first) and all(m.get("contextId") == "c2" for m in second)
    assert first[-1] == {"isFinal": True, "contextId": "c1"}
    assert chunk_marks(audio_of(first, "c1"), SPS) == [(0, k) for k in range(1, 6)] + [(1, k) for k in range(1, 6)]
    assert chars_of(first, "c1") == "Hello there. How are you?"
    assert chars_of(second, "c2") == "Second turn."
    for m in first:
        if m.get("alignment"):
            a = m["alignment"]
            assert len(a["chars"]) == len(a["charStartTimesMs"]) == len(a["charDurationsMs"])
            assert m["normalizedAlignment"] == a
    assert engine.aborted == []


async def test_two_contexts_interleave_each_in_order():
    engine = FakeEngine(samples_per_step=SPS, step_delay=0.003)
    async with serve(engine) as s:
        async with websockets.connect(s.url(MULTI + "output_format=pcm_16000", "ws")) as ws:
            for c in ("a", "b"):
                await ws.send(json.dumps({"text": " ", "context_id": c}))
            await ws.send(json.dumps({"text": "Apple one. ", "context_id": "a"}))
            await ws.send(json.dumps({"text": "Banana two. ", "context_id": "b"}))
            for c in ("a", "b"):
                await ws.send(json.dumps({"context_id": c, "close_context": True}))
            seen: list[dict] = []
            finals = set()
            async with asyncio.timeout(5):
                while finals != {"a", "b"}:
                    m = await recv_json(ws)
                    seen.append(m)
                    if m.get("isFinal"):
                        finals.add(m["contextId"])
    n = engine.audio_samples_per_request() * 16000 // 24000
    for c in ("a", "b"):
        assert abs(len(audio_of(seen, c)) // 2 - n) <= 1  # resampled to 16 kHz, every sample once
    assert chars_of(seen, "a") == "Apple one." and chars_of(seen, "b") == "Banana two."


async def test_close_context_drops_unflushed_text_and_keepalives_open_nothing():
    engine = FakeEngine(samples_per_step=SPS)
    async with serve(engine) as s:
        async with websockets.connect(s.url(MULTI + "output_format=pcm_24000", "ws")) as ws:
            await ws.send(json.dumps({"text": ""}))  # Pipecat's keepalive before any context
            await ws.send(json.dumps({"text": " ", "context_id": "x"}))
            await ws.send(json.dumps({"text": "an unfinished thought", "context_id": "x"}))
            await ws.send(json.dumps({"text": "", "context_id": "x"}))  # a context's keepalive
            await ws.send(json.dumps({"context_id": "x", "close_context": True}))
            assert await recv_json(ws) == {"isFinal": True, "contextId": "x"}
            await ws.send(json.dumps({"context_id": "never-opened", "close_context": True}))  # harmless
            await ws.send(json.dumps({"close_socket": True}))
            with pytest.raises(ConnectionClosed):
                await recv_json(ws)
            assert ws.close_code == 1000
    assert engine.requests == []


async def test_close_socket_speaks_every_context_then_closes():
    engine = FakeEngine(samples_per_step=SPS, step_delay=0.002)
    async with serve(engine) as s:
        async with websockets.connect(s.url(MULTI + "output_format=ulaw_8000", "ws")) as ws:
            await ws.send(json.dumps({"text": "First context", "context_id": "p"}))
            await ws.send(json.dumps({"text": "Second context", "context_id": "q"}))
            await ws.send(json.dumps({"close_socket": True}))
            messages = [json.loads(m) async for m in ws]
            assert ws.close_code == 1000
    assert {m["contextId"] for m in messages if m.get("isFinal")} == {"p", "q"}
    n = engine.audio_samples_per_request() // 3  # mu-law at 8 kHz: one byte a sample
    assert abs(len(audio_of(messages, "p")) - n) <= 1 and abs(len(audio_of(messages, "q")) - n) <= 1


BAD = [
    ({"text": " ", "voice_settings": {"stability": 2}, "context_id": "c"}, "voice_settings.stability"),
    ({"text": " ", "voice_settings": {"similarity_boost": -0.1}, "context_id": "c"}, "voice_settings.similarity_boost"),
    ({"text": " ", "voice_settings": {"speed": 1.1}, "context_id": "c"}, "voice_settings.speed"),
    ({"text": " ", "voice_settings": {"speed": 3}, "context_id": "c"}, "voice_settings.speed"),
    ({"text": " ", "voice_settings": {"loudness": 1}, "context_id": "c"}, "voice_settings.loudness"),
    ({"text": " ", "generation_config": {"chunk_length_schedule": [10]}, "context_id": "c"},
     "generation_config.chunk_length_schedule"),
    ({"text": " ", "generation_config": {"chunk_length_schedule": "fast"}, "context_id": "c"},
     "generation_config.chunk_length_schedule"),
    ({"text": 5, "context_id": "c"}, "text"),
    ({"text": "hi", "context_id": 7}, "context_id"),
    ({"text": "hi", "flush": "yes", "context_id": "c"}, "flush"),
    ({"text": "hi", "surprise": 1, "context_id": "c"}, "surprise"),
    ({"text": "hi", "pronunciation_dictionary_locators": [{"pronunciation_dictionary_id": "d"}], "context_id": "c"},
     "pronunciation_dictionary_locators"),
]


@pytest.mark.parametrize("message,param", BAD, ids=[b[1] for b in BAD])
async def test_bad_fields_name_the_field_and_the_context(message, param):
    async with serve() as s:
        async with websockets.connect(s.url(MULTI + "output_format=pcm_24000", "ws")) as ws:
            await ws.send(json.dumps(message))
            err = await recv_json(ws)
            assert err["type"] == "error" and err["error"] == err["code"] == "invalid_field"
            assert err["param"] == param and param.split(".")[-1] in err["message"]
            if isinstance(message.get("context_id"), str):
                assert err["contextId"] == "c"  # LiveKit fails that context's stream on it
            await ws.send(json.dumps({"text": "Still here.", "context_id": "ok", "flush": True}))
            assert (await recv_json(ws)).get("contextId") == "ok"  # the socket goes on


async def test_settings_only_in_a_contexts_first_message_and_five_contexts_at_most():
    async with serve(FakeEngine(step_delay=0.05)) as s:
        async with websockets.connect(s.url(MULTI + "output_format=pcm_24000", "ws")) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "c"}))
            await ws.send(json.dumps({"text": "x", "voice_settings": {"stability": 0.5}, "context_id": "c"}))
            err = await recv_json(ws)
            assert (err["param"], err["contextId"]) == ("voice_settings", "c")
            for i in range(4):
                await ws.send(json.dumps({"text": " ", "context_id": f"more{i}"}))
            await ws.send(json.dumps({"text": " ", "context_id": "sixth"}))
            err = await recv_json(ws)
            assert (err["param"], err["contextId"]) == ("context_id", "sixth") and "5" in err["message"]


async def test_api_key_in_the_first_message():
    async with serve(api_key="secret") as s:
        url = s.url("/v1/text-to-speech/tara/stream-input?output_format=pcm_24000", "ws")
        async with websockets.connect(url) as ws:  # no header: the upgrade is let through
            await ws.send(json.dumps({"text": " ", "xi_api_key": "secret"}))
            await ws.send(json.dumps({"text": "Hi.", "flush": True}))
            assert (await recv_json(ws))["audio"]
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"text": " ", "xi-api-key": "wrong"}))
            err = await recv_json(ws)
            assert (err["code"], err["param"]) == ("unauthorized", "xi_api_key")
            with pytest.raises(ConnectionClosed):
                await recv_json(ws)
            assert ws.close_code == 1008
        with pytest.raises(websockets.exceptions.InvalidStatus) as e:  # a wrong header is refused at once
            await websockets.connect(url, additional_headers={"xi-api-key": "wrong"})
        assert e.value.response.status_code == 401


async def test_idle_context_times_out_while_the_socket_lives():
    async with serve() as s:
        async with websockets.connect(s.url(MULTI + "output_format=pcm_24000&inactivity_timeout=1", "ws")) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "idle"}))
            started = time.monotonic()
            err = None
            while err is None and time.monotonic() - started < 4:
                await ws.send(json.dumps({"text": ""}))  # keeps the socket, not the context
                try:
                    err = await recv_json(ws, timeout=0.3)
                except TimeoutError:
                    pass
            assert err is not None and (err["code"], err["contextId"]) == ("context_timeout", "idle")
            await ws.send(json.dumps({"text": "Hi.", "context_id": "idle", "flush": True}))  # the id is free again
            assert (await recv_json(ws)).get("contextId") == "idle"


async def test_auto_mode_speaks_each_sentence_without_a_flush():
    engine = FakeEngine(samples_per_step=SPS)
    async with serve(engine) as s:
        async with websockets.connect(s.url(MULTI + "output_format=pcm_24000&auto_mode=true", "ws")) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "c"}))
            await ws.send(json.dumps({"text": "Pipecat sends whole sentences.", "context_id": "c"}))
            assert (await recv_json(ws)).get("contextId") == "c"  # no trailing space, no flush needed
