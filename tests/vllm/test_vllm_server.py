"""The real server with `--engine vllm` on the embedded Orpheus-shaped default model: the
openai client (completions with hidden states, streamed speech), a websockets speech
session and the ZeroMQ client get what they get from the native engine; a disconnect aborts
the vLLM request. One server (vLLM start-up is ~20 s) serves the module."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
import websockets  # noqa: E402

from tests.e2e.helpers import FRAME_BYTES, LONG_SEED, TOKENS_PER_FRAME, WAIT_S, frames_of, recv_event, stats  # noqa: E402
from tests.e2e.test_e2e_zmq import HIDDEN_LAYERS, ZMQ_PROMPT, stitch  # noqa: E402
from tests.support.server_proc import ServerProc, start_server  # noqa: E402
from tests.vllm.conftest import descendants, kill_leftovers  # noqa: E402

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0.0, "max_tokens": 9}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProc:
    srv = start_server(tmp_path_factory.mktemp("vllm-e2e"), "--engine", "vllm", "--enforce-eager",
                       "--max-model-len", "1024", "--kv-memory-gb", "0.05", "--max-num-seqs", "16", timeout=300)
    try:
        yield srv
    finally:
        tree = descendants(srv.proc.pid)  # the engine restarted by the last test included
        srv.stop()
        kill_leftovers([p for p in tree if Path(f"/proc/{p}").exists()])


@pytest.fixture(scope="module")
def native_greedy(server: ServerProc) -> tuple[list[int], np.ndarray]:
    """(tokens, hidden rows) of the greedy ZMQ_PROMPT request on the native engine, in-process."""
    from runner.config import EngineConfig
    from runner.engine.engine import Engine
    from runner.models.default_model import ensure_default_model
    from streaming.sampling_params import SamplingParams

    engine = Engine(EngineConfig.build(ensure_default_model(server.cache_dir), device="cpu", dtype="float32"))
    engine.add_request("ref", ZMQ_PROMPT, SamplingParams(**GREEDY), hidden_state_layers=HIDDEN_LAYERS)
    tokens, rows = [], []
    while engine.has_unfinished:
        for o in engine.step():
            tokens += o.new_token_ids
            if o.hidden is not None:
                rows.append((o.hidden_positions, np.array(o.hidden)))
    return tokens, stitch(rows)


@pytest.fixture
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=WAIT_S, max_retries=0)


def test_openai_completions_stream_hidden_states_as_the_native_engine(client, native_greedy):
    tokens, want = native_greedy
    chunks = list(client.completions.create(
        model="omnistream", prompt=ZMQ_PROMPT, stream=True, **GREEDY,
        extra_body={"return_hidden_states": True, "hidden_state_layers": HIDDEN_LAYERS}))
    got, rows = [], []
    for c in chunks:
        choice = c.choices[0].model_extra
        got += choice.get("token_ids") or []
        if h := choice.get("hidden_states"):
            arr = np.frombuffer(base64.b64decode(h["data"]), dtype=h["dtype"]).reshape(h["shape"])
            rows.append((tuple(h["positions"]), arr))
    assert got == tokens
    np.testing.assert_allclose(stitch(rows), want, atol=1e-4, rtol=0)


def test_zmq_client_gets_the_native_engines_tokens_and_rows(server: ServerProc, native_greedy):
    from streaming.zmq_client import ZmqClient

    tokens, want = native_greedy
    with ZmqClient(server.zmq_endpoint, timeout_s=WAIT_S) as c:
        steps = list(c.generate(prompt_token_ids=ZMQ_PROMPT, sampling=GREEDY, hidden_state_layers=HIDDEN_LAYERS))
    assert [t for s in steps for t in s.token_ids] == tokens
    assert steps[-1].finished and steps[-1].usage["completion_tokens"] == len(tokens)
    np.testing.assert_allclose(stitch([(s.hidden_positions, s.hidden) for s in steps if s.hidden is not None]), want,
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("seed", [1, 2])
def test_openai_speech_stream_is_valid_audio_codes(client, seed):
    """Every code goes through the codec stage, which ends a request on an id outside its
    slot: whole frames of audio for all tokens mean the logits processor kept every token in
    its window, and end-of-speech came only at a frame boundary."""
    max_new = 140
    with client.audio.speech.with_streaming_response.create(
        model="omnistream", voice="tara", input="Hello there.", response_format="pcm", stream_format="sse",
        extra_body={"max_new_tokens": max_new, "seed": seed},
    ) as r:
        assert r.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done", events[-1]
    out = events[-1]["usage"]["output_tokens"]
    stopped = out % TOKENS_PER_FRAME == 1
    assert stopped or out == max_new, out
    audio = sum(len(base64.b64decode(e["audio"])) for e in events[:-1])
    assert audio == frames_of(out, "stop" if stopped else "length") * FRAME_BYTES > 0


async def test_websocket_speech_session(server: ServerProc):
    async with websockets.connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        assert (await recv_event(ws))["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.config", "voice": "tara", "max_new_tokens": 70, "seed": 3}))
        assert (await recv_event(ws))["type"] == "session.updated"
        await ws.send(json.dumps({"type": "input.text", "text": "Hello there, how are you today?"}))
        await ws.send(json.dumps({"type": "input.flush"}))
        assert (await recv_event(ws))["type"] == "audio.start"
        audio = b""
        while isinstance(msg := await asyncio.wait_for(ws.recv(), WAIT_S), bytes):
            audio += msg
        done = json.loads(msg)
        assert done["type"] == "audio.done" and done["finish_reason"] in ("stop", "length"), done
        assert len(audio) == frames_of(done["usage"]["output_tokens"], done["finish_reason"]) * FRAME_BYTES > 0
        await ws.send(json.dumps({"type": "session.close"}))
        assert (await recv_event(ws)) == {"type": "session.done", "total_sentences": 1}


async def test_client_disconnect_aborts_the_vllm_request(server: ServerProc):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
        before = await stats(http, server)
        body = {"input": "Hello there.", "response_format": "pcm", "seed": LONG_SEED, "max_new_tokens": 700}
        r = await http.post(server.base_url + "/v1/audio/speech", json=body)
        assert r.status == 200
        assert len(await r.content.readany()) > 0
        assert len((await stats(http, server))["active_request_ids"]) == 1
        r.close()  # drop the connection mid-stream
        for _ in range(100):
            after = await stats(http, server)
            if not after["active_request_ids"] and after["num_running"] == 0:
                break
            await asyncio.sleep(0.1)
        assert after["active_request_ids"] == [] and after["num_running"] == 0, after
        assert after["num_aborted_total"] == before["num_aborted_total"] + 1
        assert after["num_generated_tokens_total"] - before["num_generated_tokens_total"] < 700


async def test_vllm_engine_core_death_fails_fast_and_the_engine_comes_back(server: ServerProc):
    """Last in the module: it restarts the engine. vLLM's engine core killed mid-request: the
    request ends at once, the front end restarts the engine process, which serves again."""
    import psutil

    def engine_and_cores() -> tuple[list[int], list[int]]:
        procs = []
        for p in descendants(server.proc.pid):
            with contextlib.suppress(psutil.NoSuchProcess):  # a dying process may vanish meanwhile
                procs.append((p, " ".join(psutil.Process(p).cmdline())))
        return [p for p, c in procs if "runner.vllm_engine.process" in c], [p for p, c in procs if "EngineCore" in c]

    engine, cores = engine_and_cores()
    assert len(engine) == 1 and len(cores) == 1
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
        body = {"input": "Hello there.", "response_format": "pcm", "seed": LONG_SEED, "max_new_tokens": 700}
        async with http.post(server.base_url + "/v1/audio/speech", json=body) as r:
            assert r.status == 200
            got = len(await r.content.readany())
            kill_leftovers(cores)
            with pytest.raises(aiohttp.ClientPayloadError):  # cut short, not a clean end
                got += len(await r.content.read())
        assert got < frames_of(700, "length") * FRAME_BYTES
        for _ in range(600):
            async with http.get(server.base_url + "/health") as h:
                if h.status == 200 and (await h.json())["status"] == "ok" and engine_and_cores()[0] not in ([], engine):
                    break  # a new engine process is up
            await asyncio.sleep(0.2)
        assert h.status == 200
        body = {"prompt": ZMQ_PROMPT, **GREEDY}
        async with http.post(server.base_url + "/v1/completions", json=body) as r:
            assert r.status == 200 and len((await r.json())["choices"][0]["token_ids"]) == GREEDY["max_tokens"]
