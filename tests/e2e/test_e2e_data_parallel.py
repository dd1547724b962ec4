"""End to end, native data parallel: a real server with `--data-parallel-size 2` (two CPU engine
processes behind one front end). Requests spread over both, a WebSocket session stays on one,
a disconnect frees its request on its engine, and killing one engine while both serve fails
only its streams; the other keeps serving and the killed one comes back and takes new work.
This module has its own server, since it kills an engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest
import websockets

from tests.e2e.helpers import FRAME_BYTES, LONG_SEED, WAIT_S, recv_event, speak_http
from tests.support.server_proc import ServerProc, http_get, start_server

pytestmark = pytest.mark.e2e

LONG = {"input": "Hello there.", "response_format": "pcm", "stream_format": "sse", "seed": LONG_SEED,
        "max_new_tokens": 700}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProc:
    srv = start_server(tmp_path_factory.mktemp("e2e-dp"), "--data-parallel-size", "2", "--max-num-seqs", "16")
    try:
        yield srv
    finally:
        srv.stop()


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with http.get(url) as r:
        return r.status, await r.json()


async def _per_engine(http: aiohttp.ClientSession, server: ServerProc) -> list[dict]:
    status, body = await _get(http, server.base_url + "/v1/engine/stats")
    assert status == 200, body
    return body["engines"]


async def _wait(cond, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def _open_sse(http: aiohttp.ClientSession, server: ServerProc) -> aiohttp.ClientResponse:
    r = await http.post(server.base_url + "/v1/audio/speech", json=LONG)
    assert r.status == 200, await r.text()
    first = await r.content.readline()
    assert json.loads(first[len(b"data: "):])["type"] == "speech.audio.delta"
    return r


async def _events(r: aiohttp.ClientResponse) -> list[dict]:
    rest = (await asyncio.wait_for(r.read(), WAIT_S)).decode()
    return [json.loads(line[len("data: "):]) for line in rest.splitlines() if line.startswith("data: ")]


async def _idle(http: aiohttp.ClientSession, server: ServerProc) -> bool:
    engines = await _per_engine(http, server)
    return all(e["stats"] is not None and not e["stats"]["active_request_ids"] and e["in_flight"] == 0
               and e["stats"]["num_free_blocks"] == e["stats"]["num_total_blocks"] for e in engines)


async def test_health_and_metrics_report_each_engine(server: ServerProc):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
        status, health = await _get(http, server.base_url + "/health")
        assert status == 200 and health["status"] == "ok"
        engines = health["engines"]
        assert [e["engine"] for e in engines] == [0, 1] and all(e["healthy"] for e in engines)
        pids = [e["pid"] for e in engines]
        assert len(set(pids)) == 2 and all(os.path.exists(f"/proc/{p}") for p in pids)
        async with http.get(server.base_url + "/metrics") as r:
            text = await r.text()
        for i, pid in enumerate(pids):
            assert f'omnistream_engine_healthy{{engine="{i}"}} 1.0' in text
            assert f'omnistream_engine_info{{device="cpu",engine="{i}",pid="{pid}"}} 1.0' in text
            assert f'omnistream_engine_kv_total_blocks{{engine="{i}"}}' in text


async def test_requests_spread_and_a_disconnect_frees_its_engine(server: ServerProc):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
        streams = [await _open_sse(http, server) for _ in range(4)]
        _, health = await _get(http, server.base_url + "/health")
        assert [e["in_flight"] for e in health["engines"]] == [2, 2]
        engines = await _per_engine(http, server)
        assert [len(e["stats"]["active_request_ids"]) for e in engines] == [2, 2]
        for r in streams:  # gone mid-stream: each engine aborts its own requests
            r.close()
        await _wait(lambda: _idle(http, server), "requests still held after their clients left")


async def test_a_sessions_utterances_stay_on_one_engine(server: ServerProc):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
        before = [e["stats"]["num_requests_total"] for e in await _per_engine(http, server)]
        async with websockets.connect(server.ws_url + "/v1/audio/speech/stream") as ws:
            assert (await recv_event(ws))["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.config", "max_new_tokens": 35, "seed": 2}))
            await recv_event(ws)
            await ws.send(json.dumps({"type": "input.text", "text": "One sentence. Another one. And a third."}))
            await ws.send(json.dumps({"type": "session.close"}))
            done = 0
            while True:
                msg = await asyncio.wait_for(ws.recv(), WAIT_S)
                if isinstance(msg, str):
                    kind = json.loads(msg)["type"]
                    assert kind != "error", msg
                    done += kind == "audio.done"
                    if kind == "session.done":
                        break
        assert done == 3
        after = [e["stats"]["num_requests_total"] for e in await _per_engine(http, server)]
        assert sorted(a - b for a, b in zip(after, before)) == [0, 3]


async def test_killing_one_engine_fails_only_its_streams_and_it_comes_back(server: ServerProc):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
        await _wait(lambda: _idle(http, server), "engines busy before the test")
        streams = [await _open_sse(http, server) for _ in range(4)]
        _, health = await _get(http, server.base_url + "/health")
        assert [e["in_flight"] for e in health["engines"]] == [2, 2]
        victim = health["engines"][0]["pid"]
        os.kill(victim, signal.SIGKILL)

        async def degraded() -> bool:
            status, h = await _get(http, server.base_url + "/health")
            return status == 200 and h["status"] == "degraded" and not h["engines"][0]["healthy"]

        await _wait(degraded, "/health does not show engine 0 down", timeout=5.0)
        # the survivor takes new work while engine 0 is down or restarting
        pcm = await speak_http(http, server, seed=3, max_new_tokens=35)
        assert len(pcm) > 0 and len(pcm) % FRAME_BYTES == 0

        outcomes = []
        for r in streams:
            events = await _events(r)
            assert events and all(e["type"] == "speech.audio.delta" for e in events[:-1]), events[-1:]
            outcomes.append(events[-1]["error"]["code"] if events[-1]["type"] == "error" else events[-1]["type"])
        assert sorted(outcomes) == ["engine_unavailable", "engine_unavailable", "speech.audio.done",
                                    "speech.audio.done"], outcomes

        async def back() -> bool:
            status, h = await _get(http, server.base_url + "/health")
            return status == 200 and h["status"] == "ok"

        await _wait(back, f"engine 0 not restarted:\n{server.output()}", timeout=3 * WAIT_S)
        _, health = await _get(http, server.base_url + "/health")
        assert health["engines"][0]["pid"] != victim and health["engines"][0]["restarts"] == 1
        assert health["engines"][1]["restarts"] == 0
        # new work reaches the restarted engine again (least loaded: one stream each)
        streams = [await _open_sse(http, server) for _ in range(2)]
        _, health = await _get(http, server.base_url + "/health")
        assert [e["in_flight"] for e in health["engines"]] == [1, 1]
        for r in streams:
            assert (await _events(r))[-1]["type"] == "speech.audio.done"
        await _wait(lambda: _idle(http, server), "requests left after the restart")
    status, body = await asyncio.to_thread(http_get, server.base_url + "/v1/engine/stats")
    assert status == 200 and body["engines"][0]["stats"]["num_requests_total"] >= 1  # the fresh engine's own
