"""The front end over a pool of two fake engines: /health, /metrics and /v1/engine/stats per
engine, WebSocket sessions pinned to one engine, the ZeroMQ gateway when one engine dies."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
import websockets
import zmq

from server.engine_pool import EnginePool
from server.routes.zmq_gateway import ZmqGateway
from server.settings import ServerSettings
from server.tts.voices import SpeechProfile
from streaming.zmq_client import AsyncZmqClient, ZmqRequestError
from tests.server.ws_support import recv_json
from tests.support.fake_engine import FakeEngine, make_tokenizer, serve

WAIT_S = 10.0


async def test_health_metrics_and_stats_per_engine():
    a, b = FakeEngine(), FakeEngine()
    async with serve(EnginePool([a, b])) as s, aiohttp.ClientSession() as http:
        async with http.get(s.url("/health")) as r:
            body = await r.json()
            assert r.status == 200 and body["status"] == "ok"
            assert [(e["engine"], e["healthy"], e["device"]) for e in body["engines"]] == [(0, True, "fake"), (1, True, "fake")]
        a.dead = True
        async with http.get(s.url("/health")) as r:
            body = await r.json()
            assert r.status == 200 and body["status"] == "degraded"
            assert [e["healthy"] for e in body["engines"]] == [False, True]
        async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi", "response_format": "pcm"}) as r:
            assert r.status == 200 and len(await r.read()) > 0  # served by engine 1
        assert (len(a.requests), len(b.requests)) == (0, 1)
        async with http.get(s.url("/metrics")) as r:
            text = await r.text()
        assert 'omnistream_engine_healthy{engine="0"} 0.0' in text
        assert 'omnistream_engine_healthy{engine="1"} 1.0' in text
        assert 'omnistream_engine_requests_total{engine="1"} 1.0' in text
        assert 'omnistream_engine_requests_total{engine="0"}' not in text  # no counters from a dead engine
        async with http.get(s.url("/v1/engine/stats")) as r:
            body = await r.json()
            assert r.status == 200 and body["num_requests_total"] == 1 and body["num_total_blocks"] == 128
            assert [e["stats"] is None for e in body["engines"]] == [True, False]
        b.dead = True
        async with http.get(s.url("/health")) as r:
            assert r.status == 503 and (await r.json())["status"] == "unavailable"
        async with http.get(s.url("/v1/engine/stats")) as r:
            assert r.status == 503
        async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi"}) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "engine_unavailable"


async def test_each_tts_session_keeps_one_engine():
    a, b = (FakeEngine(samples_per_step=240, step_delay=0.005) for _ in range(2))
    tokenizer = make_tokenizer()

    async def session(url: str, word: str) -> None:
        async with websockets.connect(url) as ws:
            await recv_json(ws)
            text = " ".join(f"{word} number {k} is here." for k in range(4))
            await ws.send(json.dumps({"type": "input.text", "text": text}))
            await ws.send(json.dumps({"type": "session.close"}))
            async with asyncio.timeout(WAIT_S):
                while True:
                    msg = await ws.recv()
                    if isinstance(msg, str):
                        kind = json.loads(msg)["type"]
                        assert kind != "error", msg
                        if kind == "session.done":
                            return

    async with serve(EnginePool([a, b])) as s:
        url = s.url("/v1/audio/speech/stream", "ws")
        await asyncio.gather(session(url, "Alpha"), session(url, "Bravo"), session(url, "Charlie"))

    def speakers(engine: FakeEngine) -> set[str]:
        return {w for r in engine.requests for w in ("Alpha", "Bravo", "Charlie")
                if w in tokenizer.decode(r.prompt_token_ids)}

    assert len(a.requests) + len(b.requests) >= 6  # several utterances per session
    # without the pin, the utterances of three sessions would interleave over both engines
    assert speakers(a) and speakers(b) and not speakers(a) & speakers(b)


@contextlib.asynccontextmanager
async def gateway(engine: EnginePool):
    gw = ZmqGateway(engine, make_tokenizer(), SpeechProfile(), ServerSettings(zmq_endpoint="tcp://127.0.0.1:*"))
    await gw.start()
    try:
        yield gw.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    finally:
        await gw.close()


async def test_zmq_requests_on_a_dying_engine_fail_and_the_others_finish():
    a, b = FakeEngine(steps=20, step_delay=0.01), FakeEngine(steps=20, step_delay=0.01)
    a.die_at_step = 5

    async def run(c: AsyncZmqClient) -> str:
        try:
            steps = [s async for s in c.generate(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 20})]
        except ZmqRequestError as e:
            return e.code
        return steps[-1].finish_reason

    async with gateway(EnginePool([a, b])) as ep, AsyncZmqClient(ep) as c:
        got = await asyncio.wait_for(asyncio.gather(*(run(c) for _ in range(4))), WAIT_S)
    assert sorted(got) == ["length", "length", "unavailable", "unavailable"]
    assert (len(a.requests), len(b.requests)) == (2, 2)


@pytest.mark.parametrize("n", [1, 2])
async def test_the_pool_admits_up_to_the_engines_own_refusal(n: int):
    engines = [FakeEngine() for _ in range(n)]
    for e in engines:
        e.overloaded = True
    async with serve(EnginePool(engines)) as s, aiohttp.ClientSession() as http:
        async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi"}) as r:
            assert r.status == 429 and r.headers["Retry-After"]
