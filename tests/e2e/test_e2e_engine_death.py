"""End to end: the engine process dies under a stream; the server answers 503, then its
supervisor restarts the engine. This module has its own server, since it kills the engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from tests.e2e.helpers import (
    FRAME_BYTES,
    LONG_SEED,
    WAIT_S,
    speak_http,
)
from tests.support.server_proc import ServerProc, http_get, start_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProc:
    srv = start_server(tmp_path_factory.mktemp("e2e-death"), "--max-num-seqs", "48")
    try:
        yield srv
    finally:
        srv.stop()


async def test_engine_death_is_503_then_supervisor_restarts_it(server: ServerProc):
    old_pid = server.engine_pid()
    assert old_pid is not None, "no engine child process found"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
        # an in-flight SSE stream: it must end with an error event, not hang or look complete
        body = {"input": "Hello there.", "response_format": "pcm", "stream_format": "sse",
                "seed": LONG_SEED, "max_new_tokens": 700}
        inflight = await http.post(server.base_url + "/v1/audio/speech", json=body)
        assert inflight.status == 200
        first = await inflight.content.readline()
        assert json.loads(first[len(b"data: "):])["type"] == "speech.audio.delta"

        os.kill(old_pid, signal.SIGKILL)
        t0 = time.monotonic()
        while True:
            async with http.get(server.base_url + "/health") as r:
                if r.status == 503:
                    assert (await r.json())["status"] == "unavailable"
                    break
            assert time.monotonic() - t0 < 5.0, "/health still 200 five seconds after the engine died"
            await asyncio.sleep(0.02)

        async with http.post(server.base_url + "/v1/audio/speech", json={"input": "Hi there."}) as r:
            assert r.status == 503
            assert r.headers["Retry-After"]
            assert (await r.json())["error"]["code"] == "engine_unavailable"

        rest = (await asyncio.wait_for(inflight.read(), WAIT_S)).decode()
        events = [json.loads(line[len("data: "):]) for line in rest.splitlines() if line.startswith("data: ")]
        assert events and events[-1]["type"] == "error", events[-1:]
        assert events[-1]["error"]["code"] == "engine_unavailable"
        assert all(e["type"] == "speech.audio.delta" for e in events[:-1])

        deadline = time.monotonic() + 3 * WAIT_S
        while (status := await asyncio.to_thread(server.health)) != 200:
            assert time.monotonic() < deadline, f"engine not restarted:\n{server.output()}"
            await asyncio.sleep(0.1)
        new_pid = server.engine_pid()
        assert new_pid is not None and new_pid != old_pid
        pcm = await speak_http(http, server, seed=3, max_new_tokens=35)
        assert len(pcm) > 0 and len(pcm) % FRAME_BYTES == 0
    status, body = await asyncio.to_thread(http_get, server.base_url + "/v1/engine/stats")
    assert status == 200 and body["num_requests_total"] == 1  # a fresh engine
