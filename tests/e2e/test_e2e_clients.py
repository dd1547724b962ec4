"""End to end, slow, idle and greedy clients (issue 32 item 2) against a REAL server process with
short timeouts: a trickled request head and body are cut off, 260 idle ElevenLabs-shaped
sessions (over max_concurrent_requests=256) do not lock POST /v1/audio/speech out, idle
sessions are closed with an error event + 1008 and kept open by their keepalive, and /health
stays fast while 1 MB inputs are tokenized."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from tests.e2e.helpers import WAIT_S, recv_event
from tests.support.server_proc import ServerProc, start_server

pytestmark = pytest.mark.e2e

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
IDLE_S = 1.5
SPEECH = {"input": "Hello there.", "voice": "tara", "response_format": "pcm", "max_new_tokens": 14, "seed": 1}
ELEVENLABS = "/v1/text-to-speech/tara/stream-input?output_format=pcm_24000"


@pytest.fixture(scope="module")
def limited(tmp_path_factory, server: ServerProc) -> ServerProc:
    """A server of its own with short slow-client limits (the cache with the built default model
    is shared with the session's server, so it starts at once)."""
    srv = start_server(
        tmp_path_factory.mktemp("e2e-clients"),
        "--cache-dir", str(server.cache_dir),  # overrides start_server's own
        "--http-header-timeout-s", str(HEADER_TIMEOUT_S),
        "--http-body-timeout-s", str(BODY_TIMEOUT_S),
        "--ws-inactivity-timeout-s", str(IDLE_S),
        "--max-input-chars", "1000000",
    )
    try:
        yield srv
    finally:
        srv.stop()


async def closed_within(ws, timeout: float) -> int | None:
    async with asyncio.timeout(timeout):
        try:
            while True:
                await ws.recv()
        except ConnectionClosed:
            return ws.close_code


async def test_a_trickled_request_head_is_cut_off(limited: ServerProc):
    reader, writer = await asyncio.open_connection("127.0.0.1", limited.http_port)
    t0 = time.monotonic()
    closed = False
    async with aiohttp.ClientSession() as http:
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n":
            try:
                writer.write(bytes([byte]))
                await writer.drain()
                if await asyncio.wait_for(reader.read(1), 0.25) == b"":
                    closed = True
                    break
            except TimeoutError:
                async with http.get(limited.base_url + "/health") as r:  # others are served meanwhile
                    assert r.status == 200
            except ConnectionResetError:
                closed = True
                break
    took = time.monotonic() - t0
    writer.close()
    assert closed, "a 1-byte-per-0.25-s request head was never cut off"
    assert HEADER_TIMEOUT_S * 0.8 <= took < HEADER_TIMEOUT_S + 2.0


async def test_a_trickled_body_is_answered_408(limited: ServerProc):
    body = json.dumps(SPEECH).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", limited.http_port)
    writer.write(
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:1]
    )
    await writer.drain()
    t0 = time.monotonic()

    async def trickle() -> None:
        for byte in body[1:]:
            await asyncio.sleep(0.25)
            writer.write(bytes([byte]))
            await writer.drain()

    trickler = asyncio.create_task(trickle())
    try:
        status = await asyncio.wait_for(reader.readline(), BODY_TIMEOUT_S + 5.0)
        took = time.monotonic() - t0
    finally:
        trickler.cancel()
        await asyncio.gather(trickler, return_exceptions=True)
        writer.close()
    assert status.startswith(b"HTTP/1.1 408"), status
    assert BODY_TIMEOUT_S * 0.8 <= took < BODY_TIMEOUT_S + 2.0


async def test_idle_elevenlabs_sessions_do_not_lock_out_speech(limited: ServerProc):
    """The reported lock-out: max_concurrent_requests (256) + 4 ElevenLabs-shaped sessions that
    never send a message, then POST /v1/audio/speech and a generation on one of them."""
    url = limited.ws_url + ELEVENLABS + "&inactivity_timeout=120"  # they must stay open meanwhile
    sessions = []
    try:
        for chunk in range(0, 260, 20):
            sessions += await asyncio.gather(*(websockets.connect(url, open_timeout=WAIT_S) for _ in range(20)))
            assert chunk + 20 == len(sessions)
        async with aiohttp.ClientSession() as http:
            async with http.post(limited.base_url + "/v1/audio/speech", json=SPEECH) as r:
                assert r.status == 200, await r.text()
                assert len(await r.read()) > 0
            async with http.post(limited.base_url + "/v1/completions",
                                 json={"prompt": "Hello", "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
        assert all(ws.close_code is None for ws in sessions)  # none was closed to make room
        # and an idle session still speaks
        ws = sessions[7]
        await ws.send(json.dumps({"text": " "}))
        await ws.send(json.dumps({"text": "Hello there.", "flush": True}))
        await ws.send(json.dumps({"text": ""}))
        event = await recv_event(ws)
        assert event["isFinal"] is False and event["audio"]
    finally:
        await asyncio.gather(*(ws.close() for ws in sessions), return_exceptions=True)


async def test_idle_sessions_are_closed_and_keepalives_keep_them(limited: ServerProc):
    async with websockets.connect(limited.ws_url + ELEVENLABS) as idle, \
            websockets.connect(limited.ws_url + ELEVENLABS) as kept, \
            websockets.connect(limited.ws_url + "/v1/generate/stream") as pinged:
        t0 = time.monotonic()
        for _ in range(int(IDLE_S * 2 / 0.3)):  # twice the timeout
            await kept.send(json.dumps({"text": " "}))
            await pinged.send(json.dumps({"type": "ping"}))
            assert await recv_event(pinged) == {"type": "pong"}
            await asyncio.sleep(0.3)
        err = await recv_event(idle, timeout=1.0)  # already waiting
        assert (err["type"], err["code"]) == ("error", "inactivity_timeout")
        assert await closed_within(idle, 2.0) == 1008
        assert kept.close_code is None and pinged.close_code is None
        assert (await recv_event(kept, timeout=IDLE_S + 3.0))["code"] == "inactivity_timeout"
        assert await closed_within(kept, 2.0) == 1008
        assert time.monotonic() - t0 >= IDLE_S * 2


@pytest.mark.parametrize("path,field", [("/v1/completions", "prompt"), ("/v1/audio/speech", "input")])
async def test_a_1mb_input_does_not_stall_health(limited: ServerProc, path: str, field: str):
    """A 1 MB text (within max_input_chars here, so it is tokenized, then refused as longer than
    the model's context) while /health is polled: its latency stays low."""
    big = ("Hello there, this is a test of the speech server. " * 21000)[:1_000_000]
    body = {"prompt": big, "max_tokens": 1} if field == "prompt" else {**SPEECH, "input": big}
    latencies: list[float] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as http:

        async def poll_health() -> None:
            loop = asyncio.get_running_loop()
            while not stop.is_set():
                t0 = loop.time()
                async with http.get(limited.base_url + "/health") as r:
                    assert r.status == 200
                latencies.append(loop.time() - t0)
                await asyncio.sleep(0.005)

        poller = asyncio.create_task(poll_health())
        await asyncio.sleep(0.1)
        for _ in range(2):
            async with http.post(limited.base_url + path, json=body) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == field
        await asyncio.sleep(0.1)
        stop.set()
        await poller
    assert max(latencies) < 0.3, f"/health took up to {max(latencies):.3f} s"
