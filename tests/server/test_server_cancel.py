"""Cancel with no late audio (issue 35 item 6): a cancelled or closed context sends no audio
after its acknowledgement, and its engine request is gone by then (the fake engine's generator
is closed, i.e. aborted, before the acknowledgement leaves). The real engine's
cancel-to-free latency is measured in tests/e2e/test_e2e_cancel.py."""

import asyncio
import json
import time

import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from tests.server.test_server_cartesia_ws import pipecat_msg
from tests.server.test_server_elevenlabs_ws import MULTI, audio_of, until_final
from tests.server.ws_support import recv_json
from tests.support.fake_engine import FakeEngine, serve

SPS = 240
STEP_S = 0.03  # the fake engine's step: "within one step" is checked against it


async def silent_for(ws, seconds: float) -> list:
    """Whatever arrives in `seconds` (a late chunk would show here)."""
    got = []
    try:
        async with asyncio.timeout(seconds):
            while True:
                got.append(await ws.recv())
    except (TimeoutError, ConnectionClosed):
        return got


async def test_cartesia_cancel_frees_the_request_before_the_next_message_and_sends_nothing_after():
    engine = FakeEngine(samples_per_step=SPS, steps=400, step_delay=STEP_S)
    # prefetch on: the cancel must free the prefetched request too
    async with serve(engine, ws_max_inflight_utterances=2) as s:
        async with websockets.connect(s.url("/tts/websocket", "ws")) as ws:
            await ws.send(pipecat_msg("A long answer. And more of it. ", "c", cont=True))
            assert (await recv_json(ws))["type"] == "chunk"
            assert len(engine.active) == 2  # the sentence being sent and the prefetched one
            sent = time.monotonic()
            await ws.send(json.dumps({"context_id": "c", "cancel": True}))
            # Cartesia has no cancel acknowledgement; the reply to the next message is one, since
            # the reader aborts the context's requests before it reads on.
            await ws.send(json.dumps({"context_id": "m", "mystery": 1}))
            before_ack = []
            while (m := await recv_json(ws))["type"] != "error":
                before_ack.append(m)
            acked = time.monotonic() - sent
            assert (m["context_id"], m["param"]) == ("m", "mystery")
            assert engine.active == set() and len(engine.aborted) == 2  # freed before the ack
            assert len(before_ack) <= 2, before_ack  # at most a chunk already on its way
            assert await silent_for(ws, 5 * STEP_S) == []
    assert acked < 2.0  # loose: a loaded CI box; the real engine's figure is in test_e2e_cancel


async def test_elevenlabs_close_context_sends_no_audio_after_is_final_and_leaves_nothing_running():
    engine = FakeEngine(samples_per_step=SPS, steps=8, step_delay=0.002)
    async with serve(engine) as s:
        async with websockets.connect(s.url(MULTI + "output_format=pcm_24000", "ws")) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "x"}))
            await ws.send(json.dumps({"text": "Flushed sentence. ", "context_id": "x", "flush": True}))
            await ws.send(json.dumps({"text": "never flushed", "context_id": "x"}))
            await ws.send(json.dumps({"context_id": "x", "close_context": True}))
            got = await until_final(ws, "x")
            assert engine.active == set()  # every request of the context finished by isFinal
            assert len(audio_of(got, "x")) == 7 * SPS * 2  # the flushed text is spoken, no more
            assert await silent_for(ws, 0.2) == []
    assert len(engine.requests) == 1  # the unflushed text was dropped


async def test_elevenlabs_close_socket_mid_speech_then_disconnect_aborts_everything():
    engine = FakeEngine(samples_per_step=SPS, steps=400, step_delay=STEP_S)
    async with serve(engine) as s:
        async with websockets.connect(s.url(MULTI + "output_format=pcm_24000", "ws")) as ws:
            await ws.send(json.dumps({"text": "A long one. ", "context_id": "x", "flush": True}))
            assert (await recv_json(ws))["contextId"] == "x"
        aborted = await engine.wait_aborted(1)
        assert aborted and engine.active == set()


@pytest.mark.parametrize("path", ["/v1/audio/speech/stream", "/tts/websocket"])
async def test_a_client_closing_mid_speech_gets_no_audio_after_the_close_and_frees_the_engine(path):
    engine = FakeEngine(samples_per_step=SPS, steps=400, step_delay=STEP_S)
    async with serve(engine) as s:
        ws = await websockets.connect(s.url(path, "ws"))
        if path == "/tts/websocket":
            await ws.send(pipecat_msg("A long answer. ", "c", cont=True))
        else:
            await recv_json(ws)  # session.created
            await ws.send(json.dumps({"type": "input.text", "text": "A long answer. And more. "}))
        while not isinstance(m := await asyncio.wait_for(ws.recv(), 2.0), bytes) and "chunk" not in m:
            pass
        await ws.close()  # the close handshake is the acknowledgement
        assert await engine.wait_aborted(1, timeout=1.0)
        await asyncio.sleep(2 * STEP_S)
        assert engine.active == set()
