"""Text-to-speech WebSockets (the TTS session, ElevenLabs stream-input) with real clients."""

import asyncio
import base64
import json

import aiohttp
import msgspec
import pytest
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.server.ws_support import recv_json
from tests.support.fake_engine import FakeEngine, chunk_marks, make_tokenizer, serve

SPS = 240


async def collect_session(ws, timeout: float = 5.0, current: int | None = None) -> tuple[list[dict], dict[int, bytes]]:
    """Read until the server closes: (events, utterance index -> PCM bytes). `current`: the
    utterance whose audio is already flowing when we start reading."""
    events: list[dict] = []
    audio: dict[int, bytes] = {}
    async with asyncio.timeout(timeout):
        while True:
            try:
                msg = await ws.recv()
            except ConnectionClosed:
                return events, audio
            if isinstance(msg, bytes):
                assert current is not None, "binary audio before audio.start"
                audio[current] = audio.get(current, b"") + msg
                continue
            event = json.loads(msg)
            events.append(event)
            if event["type"] == "audio.start":
                current = event["utterance"]
            elif event["type"] == "audio.done":
                current = None


async def test_tts_session_streams_audio_before_the_text_is_complete():
    engine = FakeEngine(samples_per_step=SPS, step_delay=0.005)
    async with serve(engine) as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            created = await recv_json(ws)
            assert created["type"] == "session.created"
            assert created["session"] == {"voice": "tara", "format": "pcm_s16le", "sample_rate": 24000}
            await ws.send(json.dumps({"type": "session.config", "voice": "leo", "sample_rate": 24000, "temperature": 0.5}))
            assert (await recv_json(ws))["session"]["voice"] == "leo"

            await ws.send(json.dumps({"type": "input.text", "text": "Hello there. This is"}))
            start = await recv_json(ws)
            assert start == {"type": "audio.start", "utterance": 0, "sentence_index": 0, "sentence_text": "Hello there.",
                             "format": "pcm_s16le", "sample_rate": 24000, "text": "Hello there."}
            first_audio = await asyncio.wait_for(ws.recv(), 2.0)
            assert isinstance(first_audio, bytes) and len(first_audio) == SPS * 2  # before the last text chunk

            await ws.send(json.dumps({"type": "input.text", "text": " the second"}))
            await ws.send(json.dumps({"type": "input.text", "text": " one"}))
            await ws.send(json.dumps({"type": "input.flush"}))
            await ws.send(json.dumps({"type": "session.close"}))
            events, audio = await collect_session(ws, current=0)
            audio[0] = first_audio + audio.get(0, b"")
            assert ws.close_code == 1000
        kinds = [e["type"] for e in events]
        assert kinds == ["audio.done", "audio.start", "audio.done", "session.done"]
        assert events[1]["text"] == "This is the second one"
        assert events[0]["usage"]["output_tokens"] == 6 and events[0]["finish_reason"] == "length"
        for k in (0, 1):
            marks = chunk_marks(audio[k], SPS)
            assert [step for _, step in marks] == [1, 2, 3, 4, 5]
            assert {serial for serial, _ in marks} == {k}
        assert [r.sampling.temperature for r in engine.requests] == [0.5, 0.5]
        assert engine.aborted == []


async def test_utterances_come_out_in_order_even_when_a_later_one_is_faster():
    # Each segment's request runs slower the earlier it is, so with prefetch the second one
    # finishes generating first; the client must still hear them in order.
    engine = FakeEngine(samples_per_step=SPS, step_delay=lambda req: 0.03 if len(req.prompt_token_ids) > 20 else 0.0)
    async with serve(engine, ws_max_inflight_utterances=2) as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            text = "This first sentence is much longer than the rest. Hi. Yo."
            await ws.send(json.dumps({"type": "input.text", "text": text}))
            await ws.send(json.dumps({"type": "session.close"}))
            events, audio = await collect_session(ws)
    starts = [e for e in events if e["type"] == "audio.start"]
    assert [e["text"] for e in starts] == ["This first sentence is much longer than the rest.", "Hi.", "Yo."]
    assert sorted(audio) == [0, 1, 2]
    for k in audio:
        marks = chunk_marks(audio[k], SPS)
        assert [step for _, step in marks] == [1, 2, 3, 4, 5]
        assert len({serial for serial, _ in marks}) == 1
    # the prefetched second request really did finish generating before the first
    ids = [r.request_id for r in engine.requests]
    assert engine.finished == [ids[1], ids[0], ids[2]]


async def test_bad_messages_are_error_events_while_other_sessions_carry_on():
    engine = FakeEngine(samples_per_step=SPS, step_delay=0.005)
    async with serve(engine, max_ws_message_bytes=2048) as s:
        url = s.url("/v1/audio/speech/stream", "ws")

        async def healthy() -> dict[int, bytes]:
            async with websockets.connect(url) as ws:
                await recv_json(ws)
                for chunk in ("One sentence here. ", "Another sentence", " there."):
                    await ws.send(json.dumps({"type": "input.text", "text": chunk}))
                    await asyncio.sleep(0.01)
                await ws.send(json.dumps({"type": "session.close"}))
                events, audio = await collect_session(ws)
                assert events[-1]["type"] == "session.done" and ws.close_code == 1000
                return audio

        async def misbehaving() -> None:
            async with websockets.connect(url) as ws:
                await recv_json(ws)
                await ws.send("{not json")
                err = await recv_json(ws)
                assert (err["type"], err["code"]) == ("error", "invalid_json")
                await ws.send("[1, 2]")
                assert (await recv_json(ws))["code"] == "invalid_json"
                await ws.send(json.dumps({"type": "input.shout", "text": "x"}))
                err = await recv_json(ws)
                assert err["code"] == "unknown_type" and err["param"] == "type"
                await ws.send(json.dumps({"text": "no type"}))
                assert (await recv_json(ws))["code"] == "unknown_type"
                await ws.send(b"\x00\x01")
                assert (await recv_json(ws))["code"] == "binary_not_allowed"
                await ws.send(json.dumps({"type": "input.text", "text": 42}))
                err = await recv_json(ws)
                assert err["code"] == "invalid_field" and err["param"] == "text"
                # still usable after all of that
                await ws.send(json.dumps({"type": "input.text", "text": "Still here."}))
                await ws.send(json.dumps({"type": "session.close"}))
                events, audio = await collect_session(ws)
                assert [e["type"] for e in events] == ["audio.start", "audio.done", "session.done"]
                assert len(audio[0]) == 5 * SPS * 2
            async with websockets.connect(url) as ws:
                await recv_json(ws)
                await ws.send(json.dumps({"type": "input.text", "text": "x" * 3000}))
                err = await recv_json(ws)
                assert err["code"] == "message_too_large"
                with pytest.raises(ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 2.0)
                assert ws.close_code == 1009

        results = await asyncio.gather(healthy(), misbehaving())
        audio = results[0]
        assert sorted(audio) == [0, 1]
        assert all(len(a) == 5 * SPS * 2 for a in audio.values())


@pytest.mark.parametrize(
    "config,param",
    [
        ({"voice": "alloy"}, "voice"),
        ({"sample_rate": 16000}, "sample_rate"),
        ({"response_format": "wav"}, "response_format"),
        ({"temperature": -1}, "temperature"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
async def test_bad_session_config_names_the_field_and_keeps_the_session(config, param):
    async with serve() as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "session.config", **config}))
            err = await recv_json(ws)
            assert (err["type"], err["code"], err["param"]) == ("error", "invalid_field", param)
            assert param in err["message"]
            await ws.send(json.dumps({"type": "input.text", "text": "Fine."}))
            await ws.send(json.dumps({"type": "session.close"}))
            events, _ = await collect_session(ws)
            assert events[-1]["type"] == "session.done"


async def test_a_multi_codebook_model_refuses_token_penalties_at_config_and_at_the_door():
    """A multi-codebook model (the engine's Ready says codes_per_frame > 1) takes no token
    penalty: session.config refuses it at once, as the HTTP body is refused before the engine
    (it used to be accepted, and every later sentence failed)."""
    engine = FakeEngine(steps=3, samples_per_step=SPS)
    engine.info = msgspec.structs.replace(engine.info, codes_per_frame=32)
    async with serve(engine) as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "session.config", "repetition_penalty": 1.2}))
            err = await recv_json(ws)
            assert (err["type"], err["code"], err["param"]) == ("error", "invalid_field", "repetition_penalty")
            await ws.send(json.dumps({"type": "input.text", "text": "Fine."}))
            await ws.send(json.dumps({"type": "session.close"}))
            events, audio = await collect_session(ws)
            assert events[-1]["type"] == "session.done" and audio  # the session goes on, without it
        async with aiohttp.ClientSession() as http:
            body = {"input": "Hi", "response_format": "pcm", "frequency_penalty": 0.5}
            async with http.post(s.url("/v1/audio/speech"), json=body) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "frequency_penalty"
        assert len(engine.requests) == 1  # the sentence; the refused body never reached the engine


async def test_disconnect_aborts_in_flight_requests():
    engine = FakeEngine(steps=500, step_delay=0.01, samples_per_step=SPS)
    async with serve(engine, ws_max_inflight_utterances=2) as s:  # a prefetched request is aborted too
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "input.text", "text": "First one. Second one. "}))
            await recv_json(ws)  # audio.start
            assert isinstance(await asyncio.wait_for(ws.recv(), 2.0), bytes)
        aborted = await engine.wait_aborted(2)  # the one being sent and the prefetched one
        assert sorted(aborted) == sorted(r.request_id for r in engine.requests)
        assert not engine.active


async def test_engine_overload_is_an_error_event_and_the_session_goes_on():
    engine = FakeEngine(samples_per_step=SPS)
    async with serve(engine) as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            engine.overloaded = True
            await ws.send(json.dumps({"type": "input.text", "text": "Busy now. "}))
            err = await recv_json(ws)
            assert (err["code"], err["utterance"]) == ("overloaded", 0)
            engine.overloaded = False
            await ws.send(json.dumps({"type": "input.text", "text": "Better now. "}))
            await ws.send(json.dumps({"type": "session.close"}))
            events, audio = await collect_session(ws)
            assert [e["type"] for e in events] == ["audio.start", "audio.done", "session.done"]
            assert sorted(audio) == [1]


async def test_dead_engine_closes_the_session_with_1011():
    engine = FakeEngine(samples_per_step=SPS)
    engine.die_at_step = 2
    async with serve(engine) as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "input.text", "text": "Doomed. "}))
            events, _ = await collect_session(ws)
            assert events[-1]["code"] == "engine_unavailable"
            assert ws.close_code == 1011


async def test_ws_admission_and_auth_are_checked_before_the_upgrade():
    # The open-session bound is what refuses an upgrade (idle sessions hold no work slot:
    # tests/server/test_server_slow_clients.py)
    engine = FakeEngine(steps=500, step_delay=0.01)
    async with serve(engine, max_open_sessions=1, api_key="k") as s:
        url = s.url("/v1/audio/speech/stream", "ws")
        with pytest.raises(InvalidStatus) as e:
            await websockets.connect(url)
        assert e.value.response.status_code == 401
        async with websockets.connect(url + "?api_key=k") as first:
            await recv_json(first)
            with pytest.raises(InvalidStatus) as e:
                await websockets.connect(url, additional_headers={"Authorization": "Bearer k"})
            assert e.value.response.status_code == 429
            assert e.value.response.headers["Retry-After"] == "1"
        await asyncio.sleep(0.05)
        async with websockets.connect(url, additional_headers={"xi-api-key": "k"}) as again:
            assert (await recv_json(again))["type"] == "session.created"


# ---- ElevenLabs stream-input --------------------------------------------------------------------


async def test_elevenlabs_stream_input():
    engine = FakeEngine(samples_per_step=SPS, step_delay=0.002)
    async with serve(engine) as s:
        url = s.url("/v1/text-to-speech/mia/stream-input?model_id=eleven_flash_v2_5&output_format=pcm_24000", "ws")
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"text": " ", "voice_settings": {"stability": 0.5}, "generation_config": {"chunk_length_schedule": [50]}}))
            await ws.send(json.dumps({"text": "Hello world. ", "try_trigger_generation": True}))
            await ws.send(json.dumps({"text": "Goodbye", "flush": True}))
            await ws.send(json.dumps({"text": ""}))
            messages = []
            async with asyncio.timeout(5):
                async for msg in ws:
                    messages.append(json.loads(msg))
            assert ws.close_code == 1000
    assert messages[-1] == {"isFinal": True}
    chunks = messages[:-1]
    assert all(m["isFinal"] is False and "contextId" not in m for m in chunks)
    spoken = "".join(c for m in chunks if m["alignment"] for c in m["alignment"]["chars"])
    assert spoken == "Hello world. Goodbye"  # every character timed once, the segments' space kept
    pcm = b"".join(base64.b64decode(m["audio"]) for m in chunks)
    marks = chunk_marks(pcm, SPS)
    assert marks == [(0, k) for k in range(1, 6)] + [(1, k) for k in range(1, 6)]
    assert len(engine.requests) == 2
    assert make_tokenizer().decode(engine.requests[1].prompt_token_ids[2:-4]) == "mia: Goodbye"


@pytest.mark.parametrize(
    "path,param",
    [
        ("/v1/text-to-speech/rachel/stream-input", "voice"),
        ("/v1/text-to-speech/tara/stream-input?output_format=mp3_44100_999", "output_format"),
        ("/v1/text-to-speech/tara/stream-input?output_format=ogg", "output_format"),
        ("/v1/text-to-speech/tara/stream-input?auto_mode=yes", "auto_mode"),
        ("/v1/text-to-speech/tara/stream-input?apply_text_normalization=maybe", "apply_text_normalization"),
        ("/v1/text-to-speech/tara/multi-stream-input?inactivity_timeout=0", "inactivity_timeout"),
        ("/v1/text-to-speech/tara/multi-stream-input?bogus=1", "bogus"),
    ],
)
async def test_elevenlabs_bad_voice_or_format_refuses_the_upgrade(path, param):
    async with serve() as s:
        with pytest.raises(InvalidStatus) as e:
            await websockets.connect(s.url(path, "ws"))
        assert e.value.response.status_code == 400
        assert json.loads(e.value.response.body)["error"]["param"] == param


async def test_elevenlabs_bad_message_is_an_error_event():
    async with serve() as s:
        async with websockets.connect(s.url("/v1/text-to-speech/tara/stream-input?output_format=pcm_24000", "ws")) as ws:
            await ws.send(json.dumps({"flush": True}))
            err = await recv_json(ws)
            assert (err["code"], err["param"]) == ("invalid_field", "text")
            assert err["type"] == "error" and err["error"] == "invalid_field"  # ElevenLabs clients read `error`
            await ws.send(json.dumps({"text": "Ok."}))
            await ws.send(json.dumps({"text": ""}))
            messages = [json.loads(m) async for m in ws]
            assert messages[-1] == {"isFinal": True}
            audio = b"".join(base64.b64decode(m["audio"]) for m in messages[:-1])
            assert len(audio) == s.engine.audio_samples_per_request() * 2


async def test_shutdown_closes_open_sessions_with_1001():
    engine = FakeEngine(steps=500, step_delay=0.01)
    async with websockets_server_and_client(engine) as (ws, stop):
        await ws.send(json.dumps({"type": "input.text", "text": "Talking for a long time. "}))
        assert (await recv_json(ws))["type"] == "audio.start"
        await stop()
        with pytest.raises(ConnectionClosed):
            while True:
                await asyncio.wait_for(ws.recv(), 2.0)
        assert ws.close_code == 1001
    assert engine.aborted == [engine.requests[0].request_id]


def websockets_server_and_client(engine):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def ctx():
        cm = serve(engine)
        s = await cm.__aenter__()
        stopped = False

        async def stop():
            nonlocal stopped
            stopped = True
            await cm.__aexit__(None, None, None)

        try:
            async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
                await recv_json(ws)
                yield ws, stop
        finally:
            if not stopped:
                await cm.__aexit__(None, None, None)

    return ctx()


async def test_close_is_seen_at_once_with_many_segments_pending():
    # Without handler cancellation (web.run_app's default) the session must notice the close
    # itself while segments are queued behind a long utterance.
    engine = FakeEngine(steps=500, step_delay=0.01)
    async with serve(engine, handler_cancellation=False, ws_max_inflight_utterances=1) as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "input.text", "text": "One. Two. Three. Four. Five. Six. "}))
            assert (await recv_json(ws))["type"] == "audio.start"
        await engine.wait_aborted(1, timeout=1.0)
        async with asyncio.timeout(3):
            while True:
                text = await scrape(s)
                if 'omnistream_active_streams{endpoint="/v1/audio/speech/stream"} 0.0' in text:
                    break
                await asyncio.sleep(0.02)
        assert not engine.active and len(engine.requests) == 1


async def scrape(s) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(s.url("/metrics")) as resp:
            return await resp.text()


async def test_text_far_ahead_of_speech_is_refused_not_buffered():
    engine = FakeEngine(steps=300, step_delay=0.01)
    async with serve(engine, ws_max_pending_segments=3, ws_max_inflight_utterances=1) as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "input.text", "text": "One. Two. "}))
            assert (await recv_json(ws))["type"] == "audio.start"
            # "Two." waits in the launcher for a slot; these four would make 4 > 3 queued
            await ws.send(json.dumps({"type": "input.text", "text": "Three. Four. Five. Six. "}))
            while True:
                msg = await asyncio.wait_for(ws.recv(), 2.0)
                if isinstance(msg, str):
                    break
            err = json.loads(msg)
            assert (err["code"], err["param"]) == ("input_overflow", "text"), err
            await ws.send(json.dumps({"type": "input.text", "text": "Three. "}))  # fits: accepted
        await engine.wait_aborted(1)
        assert len(engine.requests) == 1


@pytest.mark.parametrize("as_output", [False, True])
async def test_engine_rejection_in_a_tts_session_names_the_field(as_output):
    engine = FakeEngine()
    engine.reject_field = "sampling.max_tokens"
    engine.reject_as_output = as_output
    async with serve(engine) as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "input.text", "text": "Hi. "}))
            err = await recv_json(ws)
            assert (err["code"], err["param"], err["utterance"]) == ("invalid_field", "max_new_tokens", 0)
        async with websockets.connect(s.url("/v1/generate/stream", "ws")) as ws:
            await ws.send(json.dumps({"prompt_token_ids": [1]}))
            err = await recv_json(ws)
            assert (err["code"], err["param"]) == ("invalid_field", "sampling.max_tokens")


def ended_by_server(url: str, messages: list[dict], final: dict, sessions: int) -> list[str]:
    """Sessions of a client (websockets' threaded one, so it runs beside the server's loop
    as a separate client process would) that ends the input with the first message and sends
    the others right behind it, then reads to the end: the last event must be `final`, then
    the server's Close frame 1000, not a reset (1006). The failures, described."""
    from websockets.sync.client import connect

    failures: list[str] = []
    for _ in range(sessions):
        events: list = []
        with connect(url, close_timeout=5) as ws:
            if "speech/stream" in url:
                ws.recv(timeout=5)  # session.created
            try:
                for m in messages:
                    ws.send(json.dumps(m))
            except ConnectionClosed:
                pass  # the server has closed already; what it sent is still readable
            try:
                while True:
                    events.append(json.loads(ws.recv(timeout=5)))
            except ConnectionClosed:
                pass
            rcvd = ws.protocol.close_rcvd
            if rcvd is None or rcvd.code != 1000 or not events or events[-1] != final:
                failures.append(f"close {rcvd}, last events {events[-3:]}")
    return failures


@pytest.mark.parametrize("protocol", ["speech", "elevenlabs"])
async def test_a_session_the_server_ends_closes_cleanly_while_the_client_still_sends(protocol):
    # 32d_findings #6: the writer task used to close the socket while the reader waited; aiohttp
    # then closed TCP without waiting for the client's Close, and a client still sending got a
    # reset that discarded the session's last event and Close frame (1006). The reader now owns
    # the close, so both Close frames are exchanged first, under load, every time.
    if protocol == "speech":
        path = "/v1/audio/speech/stream"
        messages = [{"type": "session.close"}, {"type": "session.close"}, {"type": "session.config"}, {"type": "ping"}]
        final = {"type": "session.done", "total_sentences": 0}
    else:
        path = "/v1/text-to-speech/tara/stream-input"
        messages = [{"text": ""}, {"text": "more"}, {"text": " "}, {"text": "and more"}]
        final = {"isFinal": True}
    async with serve(FakeEngine(samples_per_step=SPS)) as s:
        failures = await asyncio.to_thread(ended_by_server, s.url(path, "ws"), messages, final, 200)
    assert not failures, f"{len(failures)} of 200 sessions: {failures[:3]}"
