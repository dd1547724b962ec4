"""End to end, ZeroMQ: the Python clients and `omnistream client zmq` against the real server,
compared with the in-process engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.helpers import (
    WAIT_S,
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


# ---- shutdown --------------------------------------------------------------------------------

SIGTERM_RUNS = 3  # the ContextTerminated traceback showed in about one shutdown of two to five


def test_sigterm_shuts_down_cleanly_without_traceback(tmp_path: Path):
    """Fresh servers, each serving a ZeroMQ request, then SIGTERM: exit code 0 and no traceback
    from either process (the engine's input thread once polled a terminated context)."""
    import signal
    import subprocess

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
