"""Slow, idle and greedy clients (issue 32 item 2) against the app on the fake engine: header and
body read timeouts (raw sockets), the WebSocket inactivity timeout and its keepalives,
admission that counts work instead of sockets, the per-client cap, and long inputs tokenized
off the event loop."""

import asyncio
import json
import time

import aiohttp
import pytest
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.server.ws_support import recv_json
from tests.support.fake_engine import FakeEngine, serve

SPEECH = {"input": "Hi", "response_format": "pcm"}
WS_PATHS = ["/v1/audio/speech/stream", "/v1/text-to-speech/tara/stream-input", "/v1/generate/stream"]


def host_port(base_url: str) -> tuple[str, int]:
    host, port = base_url.removeprefix("http://").split(":")
    return host, int(port)


async def closed_within(ws, timeout: float) -> int | None:
    """Read (and drop) messages until the server closes; its close code."""
    async with asyncio.timeout(timeout):
        try:
            while True:
                await ws.recv()
        except ConnectionClosed:
            return ws.close_code


async def read_until_closed(reader: asyncio.StreamReader, timeout: float) -> bytes:
    data = b""
    async with asyncio.timeout(timeout):
        try:
            while chunk := await reader.read(4096):
                data += chunk
        except ConnectionResetError:
            pass
    return data


# ---- HTTP: header and body read timeouts ----------------------------------------------------------


async def test_a_trickled_request_head_is_cut_off_and_others_are_served():
    async with serve(http_header_timeout_s=0.5) as s:
        reader, writer = await asyncio.open_connection(*host_port(s.base_url))
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100 + b"\r\n\r\n"
        t0 = time.monotonic()
        sent = 0
        closed_at = None
        async with aiohttp.ClientSession() as http:
            for byte in head:  # one byte every 0.1 s: the whole head would take ~12 s
                try:
                    writer.write(bytes([byte]))
                    await writer.drain()
                except ConnectionResetError:
                    break
                sent += 1
                async with http.get(s.url("/health")) as r:  # others are served meanwhile
                    assert r.status == 200
                try:
                    if await asyncio.wait_for(reader.read(1), 0.1) == b"":
                        closed_at = time.monotonic() - t0
                        break
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    closed_at = time.monotonic() - t0
                    break
        writer.close()
        assert closed_at is not None and sent < len(head), "the slow head was never cut off"
        assert 0.4 <= closed_at < 1.5


async def test_a_connection_that_sends_nothing_is_closed():
    async with serve(http_header_timeout_s=0.3) as s:
        reader, writer = await asyncio.open_connection(*host_port(s.base_url))
        t0 = time.monotonic()
        assert await read_until_closed(reader, 2.0) == b""
        assert time.monotonic() - t0 < 1.0
        writer.close()


async def test_a_fast_client_is_not_affected_by_the_header_timeout():
    async with serve(http_header_timeout_s=0.3) as s:
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(s.url("/v1/audio/speech"), json=SPEECH) as r:
                    assert r.status == 200
                    await r.read()


async def test_a_trickled_body_gets_408_and_holds_no_work_slot():
    async with serve(http_body_timeout_s=0.5, max_concurrent_requests=1) as s:
        reader, writer = await asyncio.open_connection(*host_port(s.base_url))
        body = json.dumps(SPEECH).encode()
        writer.write(
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:3]
        )
        await writer.drain()
        t0 = time.monotonic()

        async def trickle() -> None:
            for byte in body[3:]:
                await asyncio.sleep(0.1)
                try:
                    writer.write(bytes([byte]))
                    await writer.drain()
                except ConnectionResetError:
                    return

        trickler = asyncio.create_task(trickle())
        # while the body trickles in, the only work slot is free for someone else
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), json=SPEECH) as r:
                assert r.status == 200
                await r.read()
        status_line = await asyncio.wait_for(reader.readline(), 2.0)
        took = time.monotonic() - t0
        trickler.cancel()
        writer.close()
        assert status_line.startswith(b"HTTP/1.1 408"), status_line
        assert 0.4 <= took < 1.5
        rest = await asyncio.wait_for(reader.read(4096), 2.0)
        payload = json.loads(rest.split(b"\r\n\r\n", 1)[1])
        assert payload["error"]["code"] == "request_timeout"
        assert "http_body_timeout_s" in payload["error"]["message"]


# ---- WebSocket inactivity --------------------------------------------------------------------------


@pytest.mark.parametrize("path", WS_PATHS)
async def test_an_idle_session_is_closed_with_an_error_event_and_1008(path):
    async with serve(ws_inactivity_timeout_s=0.3) as s:
        async with websockets.connect(s.url(path, "ws")) as ws:
            t0 = time.monotonic()
            if path.endswith("speech/stream"):
                assert (await recv_json(ws))["type"] == "session.created"
            err = await recv_json(ws, timeout=2.0)
            assert (err["type"], err["code"]) == ("error", "inactivity_timeout")
            assert await closed_within(ws, 1.0) == 1008
            assert ws.close_reason == "inactivity timeout"
            assert 0.25 <= time.monotonic() - t0 < 1.5


@pytest.mark.parametrize(
    "path,keepalive,answer",
    [
        ("/v1/audio/speech/stream", {"type": "ping"}, {"type": "pong"}),
        ("/v1/generate/stream", {"type": "ping"}, {"type": "pong"}),
        ("/v1/text-to-speech/tara/stream-input", {"text": " "}, None),
    ],
)
async def test_keepalives_keep_a_session_open(path, keepalive, answer):
    async with serve(ws_inactivity_timeout_s=0.3) as s:
        async with websockets.connect(s.url(path, "ws"), ping_interval=None) as ws:
            if path.endswith("speech/stream"):
                await recv_json(ws)
            for _ in range(8):  # 1.2 s: four times the timeout
                await ws.send(json.dumps(keepalive))
                if answer is not None:
                    assert await recv_json(ws) == answer
                await asyncio.sleep(0.15)
            assert ws.close_code is None
            # then silence: closed after the timeout
            err = await recv_json(ws, timeout=2.0)
            assert err["code"] == "inactivity_timeout"
            assert await closed_within(ws, 1.0) == 1008


async def test_protocol_pings_are_answered_but_are_not_activity():
    async with serve(ws_inactivity_timeout_s=0.4) as s:
        async with websockets.connect(s.url("/v1/generate/stream", "ws"), ping_interval=0.1) as ws:
            pong = await ws.ping()
            await asyncio.wait_for(pong, 1.0)
            assert (await recv_json(ws, timeout=2.0))["code"] == "inactivity_timeout"
            assert await closed_within(ws, 1.0) == 1008


async def test_work_in_flight_is_not_idleness():
    # a generation (40 steps x 20 ms = 0.8 s) runs past the 0.3 s timeout without a client message
    engine = FakeEngine(steps=40, step_delay=0.02)
    async with serve(engine, ws_inactivity_timeout_s=0.3) as s:
        async with websockets.connect(s.url("/v1/generate/stream", "ws")) as ws:
            await ws.send(json.dumps({"prompt_token_ids": [1, 2], "sampling": {"max_tokens": 40}}))
            while (event := await recv_json(ws, timeout=2.0))["type"] == "step":
                pass
            assert event["type"] == "done"
            done_at = time.monotonic()
            err = await recv_json(ws, timeout=2.0)  # idle from the end of the work on
            assert err["code"] == "inactivity_timeout"
            assert 0.25 <= time.monotonic() - done_at < 1.0

        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "input.text", "text": "Hello there."}))
            await ws.send(json.dumps({"type": "input.flush"}))
            kinds = []
            while (msg := await asyncio.wait_for(ws.recv(), 2.0)) and not (
                isinstance(msg, str) and json.loads(msg)["type"] == "error"
            ):
                if isinstance(msg, str):
                    kinds.append(json.loads(msg)["type"])
            assert kinds == ["audio.start", "audio.done"]  # all spoken before the idle close
            assert await closed_within(ws, 1.0) == 1008


async def test_the_client_may_choose_its_inactivity_timeout_within_bounds():
    async with serve(ws_inactivity_timeout_s=5.0, ws_max_inactivity_timeout_s=30.0) as s:
        url = s.url("/v1/text-to-speech/tara/stream-input?inactivity_timeout=1", "ws")
        async with websockets.connect(url) as ws:
            t0 = time.monotonic()
            assert (await recv_json(ws, timeout=3.0))["code"] == "inactivity_timeout"
            assert 0.9 <= time.monotonic() - t0 < 2.0
        for bad in ("0", "0.5", "31", "abc", "nan", "inf"):
            for path in WS_PATHS:
                with pytest.raises(InvalidStatus) as e:
                    await websockets.connect(s.url(f"{path}?inactivity_timeout={bad}", "ws"))
                assert e.value.response.status_code == 400
                assert json.loads(e.value.response.body)["error"]["param"] == "inactivity_timeout"


# ---- admission counts work, not sockets ----------------------------------------------------------


async def test_idle_sessions_do_not_hold_admission_slots():
    async with serve(max_concurrent_requests=2) as s:
        sessions = []
        for i in range(6):  # 3x the limit, of every kind
            ws = await websockets.connect(s.url(WS_PATHS[i % 3], "ws"))
            sessions.append(ws)
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.post(s.url("/v1/audio/speech"), json=SPEECH) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
            async with http.post(s.url("/v1/completions"), json={"prompt": [1, 2], "max_tokens": 2}) as r:
                assert r.status == 200
        # and the idle sessions still work
        gen = sessions[2]
        await gen.send(json.dumps({"prompt_token_ids": [1], "sampling": {"max_tokens": 1}}))
        assert (await recv_json(gen))["type"] == "step"
        for ws in sessions:
            await ws.close()


async def test_sessions_with_work_in_flight_count_and_give_their_slot_back():
    engine = FakeEngine(steps=30, step_delay=0.02)
    async with serve(engine, max_concurrent_requests=1, retry_after_s=2) as s:
        async with aiohttp.ClientSession() as http, websockets.connect(s.url("/v1/generate/stream", "ws")) as gen:
            await gen.send(json.dumps({"prompt_token_ids": [1], "sampling": {"max_tokens": 30}}))
            assert (await recv_json(gen))["type"] == "step"
            async with http.post(s.url("/v1/audio/speech"), json=SPEECH) as r:
                assert r.status == 429  # the busy session holds the only slot
                assert r.headers["Retry-After"] == "2"

            # a TTS session asking for a slot meanwhile: an overloaded event, the session goes on
            async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as tts:
                await recv_json(tts)
                await tts.send(json.dumps({"type": "input.text", "text": "Hello there."}))
                await tts.send(json.dumps({"type": "input.flush"}))
                err = await recv_json(tts)
                assert (err["type"], err["code"], err["param"]) == ("error", "overloaded", "text")
                assert err["retry_after_s"] == 2 and err["dropped"] == "Hello there."

                while (await recv_json(gen, timeout=3.0))["type"] == "step":
                    pass  # the generation ends: its slot comes back
                await tts.send(json.dumps({"type": "input.text", "text": "Hello again."}))
                await tts.send(json.dumps({"type": "input.flush"}))
                assert (await recv_json(tts, timeout=3.0))["type"] == "audio.start"
                while not isinstance(msg := await asyncio.wait_for(tts.recv(), 3.0), str) or json.loads(msg)["type"] != "audio.done":
                    pass
            # the TTS session has spoken everything: the slot is free again for HTTP
            await asyncio.sleep(0.05)
            async with http.post(s.url("/v1/audio/speech"), json=SPEECH) as r:
                assert r.status == 200
                await r.read()

            # a generate message while the slot is taken is an overloaded event too
            async with http.post(s.url("/v1/audio/speech"), json=SPEECH) as busy:
                await gen.send(json.dumps({"prompt_token_ids": [1], "sampling": {"max_tokens": 1}}))
                err = await recv_json(gen)
                assert (err["type"], err["code"]) == ("error", "overloaded")
                await busy.read()
            await gen.send(json.dumps({"type": "ping"}))
            assert await recv_json(gen) == {"type": "pong"}  # the session is still usable
        async with aiohttp.ClientSession() as http:
            async with http.get(s.url("/metrics")) as m:
                text = await m.text()
        assert 'omnistream_admission_rejected_total{endpoint="/v1/generate/stream"} 1.0' in text
        assert 'omnistream_admission_rejected_total{endpoint="/v1/audio/speech/stream"} 1.0' in text


async def test_open_sessions_are_bounded_separately():
    async with serve(max_open_sessions=2, max_concurrent_requests=1) as s:
        a = await websockets.connect(s.url(WS_PATHS[0], "ws"))
        b = await websockets.connect(s.url(WS_PATHS[2], "ws"))
        with pytest.raises(InvalidStatus) as e:
            await websockets.connect(s.url(WS_PATHS[1], "ws"))
        assert e.value.response.status_code == 429
        assert "max_open_sessions" in json.loads(e.value.response.body)["error"]["message"]
        async with aiohttp.ClientSession() as http:  # HTTP work is not refused by open sockets
            async with http.post(s.url("/v1/audio/speech"), json=SPEECH) as r:
                assert r.status == 200
                await r.read()
        await a.close()
        await asyncio.sleep(0.05)
        async with websockets.connect(s.url(WS_PATHS[1], "ws")) as c:
            await c.send(json.dumps({"text": " "}))
        await b.close()


async def test_one_client_cannot_take_every_slot():
    engine = FakeEngine(steps=20, step_delay=0.02)
    async with serve(engine, max_concurrent_requests=4, max_requests_per_client=1) as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), json=SPEECH) as first:
                assert first.status == 200
                async with http.post(s.url("/v1/audio/speech"), json=SPEECH) as second:
                    assert second.status == 429
                    assert "max_requests_per_client" in (await second.json())["error"]["message"]
                await first.read()
            async with http.post(s.url("/v1/audio/speech"), json=SPEECH) as third:
                assert third.status == 200  # its slot came back
                await third.read()


# ---- long inputs are tokenized off the event loop ----------------------------------------------------


@pytest.mark.parametrize("where", ["completions", "speech", "generate_ws"])
async def test_a_long_input_does_not_stall_other_requests(where):
    big = ("Hello there, this is a test of the speech server. " * 21000)[:1_000_000]
    latencies: list[float] = []
    stop = asyncio.Event()
    engine = FakeEngine(steps=1)
    async with serve(engine, max_input_chars=1_000_000, max_ws_message_bytes=2_000_000) as s, aiohttp.ClientSession() as http:

        async def poll_health() -> None:
            loop = asyncio.get_running_loop()
            while not stop.is_set():
                t0 = loop.time()
                async with http.get(s.url("/health")) as r:
                    assert r.status == 200
                latencies.append(loop.time() - t0)
                await asyncio.sleep(0.005)

        poller = asyncio.create_task(poll_health())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        if where == "completions":
            async with http.post(s.url("/v1/completions"), json={"prompt": big, "max_tokens": 1}) as r:
                # the tiny test model takes fewer tokens than 1 MB makes: refused after tokenizing
                assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
        elif where == "speech":
            async with http.post(s.url("/v1/audio/speech"), json={**SPEECH, "input": big}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "input"
        else:
            async with websockets.connect(s.url("/v1/generate/stream", "ws"), max_size=None) as ws:
                await ws.send(json.dumps({"prompt": big}))
                err = await recv_json(ws, timeout=10.0)
                assert (err["code"], err["param"]) == ("invalid_field", "prompt")
        took = time.monotonic() - t0
        await asyncio.sleep(0.05)
        stop.set()
        await poller
    # tokenizing takes ~0.5-1 s here; /health answered all along
    assert max(latencies) < min(0.3, took / 2), f"/health took up to {max(latencies):.3f} s of {took:.3f} s"


@pytest.mark.parametrize("path", WS_PATHS)
async def test_a_session_that_goes_away_mid_work_gives_its_slot_back(path):
    from server.admission import ADMISSION

    engine = FakeEngine(steps=500, step_delay=0.01)
    async with serve(engine, max_concurrent_requests=1) as s:
        admission = s.app[ADMISSION]
        ws = await websockets.connect(s.url(path, "ws"))
        if path.endswith("speech/stream"):
            await recv_json(ws)
            await ws.send(json.dumps({"type": "input.text", "text": "Hello there. And more."}))
            await ws.send(json.dumps({"type": "input.flush"}))
        elif "stream-input" in path:
            await ws.send(json.dumps({"text": "Hello there. And more.", "flush": True}))
        else:
            await ws.send(json.dumps({"prompt_token_ids": [1], "sampling": {"max_tokens": 500}}))
        await asyncio.wait_for(ws.recv(), 2.0)  # work is flowing
        assert (admission.active, admission.sessions) == (1, 1)
        ws.transport.abort()  # gone without a close handshake
        async with asyncio.timeout(2.0):
            while admission.active or admission.sessions:
                await asyncio.sleep(0.01)
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), json={**SPEECH, "max_new_tokens": 3}) as r:
                assert r.status == 200
                await r.read()
        assert (admission.active, admission.sessions) == (0, 0)
        assert engine.aborted  # the session's engine requests were aborted
