"""End to end, ZeroMQ: the Python clients and `omnistream client zmq` against the real server,
compared with the in-process engine."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.helpers import (
    WAIT_S,
    stats,
)
from tests.support.server_proc import ServerProc

pytestmark = pytest.mark.e2e


# ---- ZeroMQ clients against the in-process engine ----------------------------------------------

ZMQ_PROMPT = [500, 501, 40, 41, 42, 43, 44, 45, 502, 503]
ZMQ_CASES = [
    {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "repetition_penalty": 1.1, "seed": 11, "max_tokens": 12},
    {"temperature": 0.0, "max_tokens": 9},
]
HIDDEN_LAYERS = [0, -1]


def reference_outputs(model_dir: Path) -> list[tuple[list[int], np.ndarray]]:
    """(tokens, hidden rows by position) of each ZMQ_CASES request, run in-process."""
    from runner.config import EngineConfig
    from runner.engine.engine import Engine
    from streaming.sampling_params import SamplingParams

    engine = Engine(EngineConfig.build(model_dir, device="cpu", dtype="float32"))
    results = []
    for i, case in enumerate(ZMQ_CASES):
        engine.add_request(f"ref-{i}", ZMQ_PROMPT, SamplingParams(**case), hidden_state_layers=HIDDEN_LAYERS)
        tokens: list[int] = []
        rows: list[tuple[tuple[int, int], np.ndarray]] = []
        while engine.has_unfinished:
            for o in engine.step():
                tokens += o.new_token_ids
                if o.hidden is not None:
                    rows.append((o.hidden_positions, np.array(o.hidden)))
        results.append((tokens, stitch(rows)))
    return results


def stitch(rows: list[tuple[tuple[int, int], np.ndarray]]) -> np.ndarray:
    """Hidden chunks in position order; positions must tile [0, end) exactly once."""
    rows = sorted(rows, key=lambda r: r[0][0])
    pos = 0
    for (first, end), arr in rows:
        assert first == pos and end - first == arr.shape[0], (first, end, pos, arr.shape)
        pos = end
    return np.concatenate([arr for _, arr in rows])


def test_zmq_clients_match_in_process_engine(server: ServerProc, model_dir: Path):
    from streaming.zmq_client import AsyncZmqClient, ZmqClient

    expected = reference_outputs(model_dir)

    def check(steps, want) -> None:
        tokens, want_hidden = want
        got_tokens = [t for s in steps for t in s.token_ids]
        assert got_tokens == tokens
        assert steps[-1].finished and sum(s.finished for s in steps) == 1
        assert steps[-1].usage["prompt_tokens"] == len(ZMQ_PROMPT)
        assert steps[-1].usage["completion_tokens"] == len(tokens)
        hidden = stitch([(s.hidden_positions, s.hidden) for s in steps if s.hidden is not None])
        # every computed position: the prompt and all sampled tokens but the last
        assert hidden.shape == (len(ZMQ_PROMPT) + len(tokens) - 1, len(HIDDEN_LAYERS), 128)
        np.testing.assert_allclose(hidden, want_hidden, atol=1e-4, rtol=0)

    with ZmqClient(server.zmq_endpoint, timeout_s=WAIT_S) as c:
        for case, want in zip(ZMQ_CASES, expected):
            check(list(c.generate(prompt_token_ids=ZMQ_PROMPT, sampling=case, hidden_state_layers=HIDDEN_LAYERS)), want)

    async def concurrently() -> list[list]:
        async with AsyncZmqClient(server.zmq_endpoint) as c:
            async def run(case):
                return [s async for s in c.generate(prompt_token_ids=ZMQ_PROMPT, sampling=case,
                                                    hidden_state_layers=HIDDEN_LAYERS)]

            return await asyncio.wait_for(asyncio.gather(*(run(case) for case in ZMQ_CASES)), WAIT_S)

    for steps, want in zip(asyncio.run(concurrently()), expected):
        check(steps, want)


async def test_async_zmq_slow_consumer_ends_only_its_request(server: ServerProc):
    from streaming.zmq_client import AsyncZmqClient, ZmqRequestError

    sampling = {"max_tokens": 60, "ignore_eos": True, "seed": 1}
    async with AsyncZmqClient(server.zmq_endpoint, queue_bound=2) as c:
        slow = c.generate(prompt_token_ids=ZMQ_PROMPT, sampling=sampling)
        with pytest.raises(ZmqRequestError) as info:
            async with asyncio.timeout(WAIT_S):
                async for _ in slow:
                    await asyncio.sleep(1.0)  # one-token steps pile up meanwhile
        assert info.value.code == "overloaded"
        # the socket's reader survived: the next request on the same client completes (one
        # token: within the bound of 2 even if the reader runs ahead of this consumer)
        steps = await asyncio.wait_for(
            _collect(c.generate(prompt_token_ids=ZMQ_PROMPT, sampling={"max_tokens": 1, "temperature": 0})), WAIT_S)
        assert steps[-1].finished and sum(len(s.token_ids) for s in steps) == 1


async def _collect(stream) -> list:
    return [s async for s in stream]


def test_cli_client_zmq_prints_tokens_per_step(server: ServerProc, capsys):
    from server.cli import main

    rc = main(["client", "zmq", "Hello there.", "--zmq-endpoint", server.zmq_endpoint, "--max-tokens", "5"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    steps = [line for line in out if line.startswith("step ")]
    assert len(steps) >= 1
    n_tokens = sum(len(json.loads(line.split(": ", 1)[1])) for line in steps)
    finished = [line for line in out if line.startswith("finished: ")]
    assert len(finished) == 1
    usage = json.loads(finished[0].split("usage=", 1)[1])
    assert usage["completion_tokens"] == n_tokens and 1 <= n_tokens <= 5


# ---- docs/zmq.md's examples run as written --------------------------------------------------------

DOCS_ZMQ = Path(__file__).resolve().parents[2] / "docs" / "zmq.md"
DOC_ENDPOINT = "tcp://127.0.0.1:5555"


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, re.DOTALL)


def test_docs_zmq_examples_run_as_written(server: ServerProc, tmp_path: Path):
    """Each python block of docs/zmq.md, run in a fresh interpreter against the real server
    (only the endpoint is replaced: the test server listens on a free port)."""
    blocks = python_blocks(DOCS_ZMQ.read_text())
    assert len(blocks) >= 2
    for i, code in enumerate(blocks):
        assert DOC_ENDPOINT in code, f"block {i} does not use the documented endpoint"
        script = tmp_path / f"example{i}.py"
        script.write_text(code.replace(DOC_ENDPOINT, server.zmq_endpoint))
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=WAIT_S,
                              cwd=tmp_path)  # not the checkout: the installed package must do
        assert done.returncode == 0, f"block {i}:\n{code}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
        assert "length" in done.stdout or "stop" in done.stdout, done.stdout


# ---- hygiene against the real server ------------------------------------------------------------------

async def test_a_1mb_prompt_does_not_stall_health(server: ServerProc):
    """A 1 MB text prompt (over max_input_chars: refused naming `prompt` without being
    tokenized) while /health is polled: its latency stays low."""
    import aiohttp

    from streaming.zmq_client import AsyncZmqClient, ZmqRequestError

    big = ("Hello there, this is a test of the speech server. " * 21000)[:1_000_000]
    latencies: list[float] = []
    stop = asyncio.Event()

    async def poll_health(http: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            t0 = loop.time()
            async with http.get(server.base_url + "/health") as r:
                assert r.status == 200
            latencies.append(loop.time() - t0)
            await asyncio.sleep(0.005)

    async with aiohttp.ClientSession() as http, AsyncZmqClient(server.zmq_endpoint) as c:
        poller = asyncio.create_task(poll_health(http))
        await asyncio.sleep(0.1)
        for _ in range(3):
            with pytest.raises(ZmqRequestError) as info:
                await asyncio.wait_for(_collect(c.generate(prompt=big)), WAIT_S)
            assert info.value.param == "prompt" and "over the limit" in info.value.message
        await asyncio.sleep(0.1)
        stop.set()
        await poller
    assert max(latencies) < 0.3, f"/health took up to {max(latencies):.3f} s"


async def test_a_client_that_closes_mid_request_is_aborted_in_the_engine(server: ServerProc):
    """A raw DEALER starts a 4,000-token request and closes its socket after the first step: the
    engine drops the request (its id leaves the active list) long before it could finish."""
    import aiohttp
    import msgspec
    import zmq
    import zmq.asyncio

    from streaming.zmq_protocol import StepReply, decode_reply

    async with aiohttp.ClientSession() as http:
        before = (await stats(http, server))["num_aborted_total"]
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.zmq_endpoint)
        try:
            await sock.send(msgspec.msgpack.encode({
                "type": "generate", "id": "leaver", "prompt_token_ids": ZMQ_PROMPT,
                "sampling": {"max_tokens": 4000, "ignore_eos": True, "seed": 3}}))
            first = decode_reply((await asyncio.wait_for(sock.recv_multipart(), WAIT_S))[0])
            assert isinstance(first, StepReply) and not first.finished
        finally:
            sock.close(0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while True:
            s = await stats(http, server)
            if s["num_aborted_total"] > before and not any(r.startswith("zmq-") for r in s["active_request_ids"]):
                break
            assert loop.time() < deadline, f"the request was not aborted: {s}"
            await asyncio.sleep(0.05)


def test_api_key_is_required_on_zmq_when_the_server_has_one(tmp_path: Path, model_dir: Path):
    """A server with --api-key: a ZeroMQ request without the key, or with a wrong one, is
    refused (`unauthorized`, naming api_key) and not run; with it, served."""
    from streaming.zmq_client import ZmqClient, ZmqRequestError
    from tests.support.server_proc import start_server

    srv = start_server(tmp_path / "keyed", "--api-key", "sekret", "--cache-dir", str(model_dir.parent))
    try:
        for key in (None, "wrong"):
            with ZmqClient(srv.zmq_endpoint, timeout_s=WAIT_S, api_key=key) as c:
                with pytest.raises(ZmqRequestError) as info:
                    list(c.generate(prompt_token_ids=ZMQ_PROMPT, sampling={"max_tokens": 2}))
                assert (info.value.code, info.value.param) == ("unauthorized", "api_key")
        with ZmqClient(srv.zmq_endpoint, timeout_s=WAIT_S, api_key="sekret") as c:
            assert c.ping() >= 0
            steps = list(c.generate(prompt_token_ids=ZMQ_PROMPT, sampling={"max_tokens": 2}))
        assert steps[-1].finished and steps[-1].usage["completion_tokens"] == 2
        req = urllib.request.Request(srv.base_url + "/v1/engine/stats", headers={"Authorization": "Bearer sekret"})
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:
            assert json.loads(r.read())["num_requests_total"] == 1  # the refused ones never reached it
    finally:
        srv.stop()


# ---- shutdown --------------------------------------------------------------------------------

SIGTERM_RUNS = 3  # the ContextTerminated traceback showed in about one shutdown of two to five


def test_sigterm_shuts_down_cleanly_without_traceback(tmp_path: Path):
    """Fresh servers, each serving a ZeroMQ request, then SIGTERM: exit code 0 and no traceback
    from either process (the engine's input thread once polled a terminated context)."""
    import signal

    from streaming.zmq_client import ZmqClient
    from tests.support.server_proc import STOP_GRACE_S, start_server

    for run in range(SIGTERM_RUNS):
        # one model cache for all runs (the last --cache-dir wins): built once
        srv = start_server(tmp_path / f"run{run}", "--cache-dir", str(tmp_path / "cache"))
        try:
            with ZmqClient(srv.zmq_endpoint, timeout_s=WAIT_S) as c:
                steps = list(c.generate(prompt_token_ids=ZMQ_PROMPT, sampling={"max_tokens": 2}))
            assert steps[-1].finished
            srv.proc.send_signal(signal.SIGTERM)
            try:
                rc = srv.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                rc = None
        finally:
            srv.stop()
        out = srv.output(tail_chars=100_000)
        assert rc == 0, f"run {run}: exit code {rc}\n{out}"
        assert "Traceback" not in out and "ContextTerminated" not in out, f"run {run}:\n{out}"
