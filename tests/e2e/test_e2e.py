"""End to end: the REAL server process (`python -m server.cli serve`) on the embedded tiny
default model, driven by the clients users have: the official `openai` package, a
`websockets` client, the ZeroMQ clients and `omnistream client`.

The tiny default speaks noise, but every path is real. Facts about it the tests rely on:
- one codec frame = 7 audio tokens = 2048 samples = 4096 bytes of s16le PCM, and the Orpheus
  constraint lets end-of-speech (token 505) come only at a frame boundary, so an utterance
  of n audio tokens is exactly n // 7 frames of audio;
- sampling is seeded and per request, so a seeded request gives the same tokens whether it
  runs alone or in a batch (PCM may differ by float noise: we allow 1 LSB).

One server serves the whole module; the engine-death test runs last because it restarts
the engine.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import struct
import time
from pathlib import Path

import aiohttp
import numpy as np
import openai
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from tests.support.server_proc import ServerProc, http_get, start_server

pytestmark = pytest.mark.e2e

SAMPLE_RATE = 24000
TOKENS_PER_FRAME = 7
FRAME_BYTES = 2048 * 2
END_OF_SPEECH = 505  # runner.models.default_model SPECIALS["<|end_of_speech|>"]
LONG_SEED = 1  # "Hello there." with seed 1 runs to max_new_tokens=700 without end-of-speech
WAIT_S = 60.0  # generous: the CPU is shared with other jobs


# ---- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProc:
    srv = start_server(tmp_path_factory.mktemp("e2e"), "--max-num-seqs", "48")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def model_dir(server: ServerProc) -> Path:
    from runner.models.default_model import ensure_default_model

    return ensure_default_model(server.cache_dir)  # already built by the server: just its path


@pytest.fixture
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=WAIT_S, max_retries=0)


def frames_of(output_tokens: int, finish_reason: str) -> int:
    """Codec frames an utterance yields: its audio tokens (all output tokens but the
    end-of-speech token when it stopped on one) // 7."""
    audio_tokens = output_tokens - (1 if finish_reason == "stop" else 0)
    return audio_tokens // TOKENS_PER_FRAME


def max_lsb_diff(a: bytes, b: bytes) -> int:
    x = np.frombuffer(a, "<i2").astype(np.int32)
    y = np.frombuffer(b, "<i2").astype(np.int32)
    return int(np.abs(x - y).max()) if len(x) else 0


def speak_openai(client: openai.OpenAI, fmt: str, seed: int, max_new_tokens: int, text: str = "Hello there.") -> tuple[dict, list[bytes]]:
    with client.audio.speech.with_streaming_response.create(
        model="omnistream", voice="tara", input=text, response_format=fmt,
        extra_body={"max_new_tokens": max_new_tokens, "seed": seed},
    ) as r:
        assert r.status_code == 200, r.text
        return dict(r.headers), list(r.iter_bytes())


async def stats(http: aiohttp.ClientSession, server: ServerProc) -> dict:
    async with http.get(server.base_url + "/v1/engine/stats") as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def speak_http(http: aiohttp.ClientSession, server: ServerProc, seed: int, max_new_tokens: int,
                     text: str = "Hello there.") -> bytes:
    body = {"input": text, "voice": "tara", "response_format": "pcm", "seed": seed, "max_new_tokens": max_new_tokens}
    async with http.post(server.base_url + "/v1/audio/speech", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.read()


async def recv_event(ws, timeout: float = WAIT_S) -> dict:
    msg = await asyncio.wait_for(ws.recv(), timeout)
    assert isinstance(msg, str), f"expected a JSON event, got {len(msg)} binary bytes"
    return json.loads(msg)


# ---- POST /v1/audio/speech through the official openai client ----------------------------------


def test_openai_client_streams_pcm_and_wav(client: openai.OpenAI):
    headers, chunks = speak_openai(client, "pcm", seed=3, max_new_tokens=70)
    pcm = b"".join(chunks)
    assert headers["content-type"] == "audio/pcm"
    assert int(headers["x-sample-rate"]) == SAMPLE_RATE
    assert len(pcm) > 0 and len(pcm) % FRAME_BYTES == 0, len(pcm)
    assert len(pcm) <= (70 // TOKENS_PER_FRAME) * FRAME_BYTES

    headers, chunks = speak_openai(client, "wav", seed=3, max_new_tokens=70)
    wav = b"".join(chunks)
    assert headers["content-type"] == "audio/wav"
    riff, riff_size, wave, fmt_id, fmt_size = struct.unpack("<4sI4s4sI", wav[:20])
    assert (riff, wave, fmt_id, fmt_size) == (b"RIFF", b"WAVE", b"fmt ", 16)
    tag, channels, rate, byte_rate, align, bits = struct.unpack("<HHIIHH", wav[20:36])
    assert (tag, channels, rate, byte_rate, align, bits) == (1, 1, SAMPLE_RATE, 2 * SAMPLE_RATE, 2, 16)
    data_id, data_size = struct.unpack("<4sI", wav[36:44])
    assert data_id == b"data"
    assert riff_size == data_size == 0xFFFFFFFF  # streaming form: sizes unknown up front
    body = wav[44:]
    assert len(body) == len(pcm)  # same seed, same request: the same audio behind a header
    assert max_lsb_diff(body, pcm) <= 1


@pytest.mark.parametrize("seed", [1, 2, 5])
def test_openai_client_sse_events_match_usage(client: openai.OpenAI, model_dir: Path, seed: int):
    from server.tokenizer import TextTokenizer
    from server.tts.voices import SpeechProfile

    text, max_new = "Hello there.", 140  # a multiple of 7: output % 7 tells stop from length
    with client.audio.speech.with_streaming_response.create(
        model="omnistream", voice="tara", input=text, response_format="pcm", stream_format="sse",
        extra_body={"max_new_tokens": max_new, "seed": seed},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and kinds.count("speech.audio.done") == 1, kinds
    assert set(kinds[:-1]) <= {"speech.audio.delta"}, kinds
    deltas = [base64.b64decode(e["audio"]) for e in events[:-1]]
    assert all(len(d) > 0 and len(d) % FRAME_BYTES == 0 for d in deltas), [len(d) for d in deltas]

    usage = events[-1]["usage"]
    prompt = SpeechProfile.load(model_dir).build_prompt(TextTokenizer.from_folder(model_dir), "tara", text)
    assert usage["input_tokens"] == len(prompt)
    out = usage["output_tokens"]
    assert usage["total_tokens"] == len(prompt) + out
    # End-of-speech only at a frame boundary: stopped -> 7k + 1 tokens, else the length cap.
    stopped = out % TOKENS_PER_FRAME == 1
    assert stopped or out == max_new, out
    total = sum(map(len, deltas))
    assert total == frames_of(out, "stop" if stopped else "length") * FRAME_BYTES


# ---- WS /v1/audio/speech/stream -----------------------------------------------------------------


async def read_utterances(ws, expect: int) -> tuple[list[dict], dict[int, bytes], list[dict]]:
    """Events until `expect` audio.done events; binary frames belong to the open utterance."""
    audio: dict[int, bytes] = {}
    events: list[dict] = []
    done: list[dict] = []
    current = None
    while len(done) < expect:
        msg = await asyncio.wait_for(ws.recv(), WAIT_S)
        if isinstance(msg, bytes):
            assert current is not None, "binary audio outside an utterance"
            audio[current] += msg
            continue
        event = json.loads(msg)
        events.append(event)
        assert event["type"] != "error", event
        if event["type"] == "audio.start":
            assert current is None, "audio.start inside another utterance"
            current = event["utterance"]
            audio[current] = b""
        elif event["type"] == "audio.done":
            assert event["utterance"] == current
            current = None
            done.append(event)
    return events, audio, done


async def read_utterances_continuing(ws, first: bytes) -> tuple[list[dict], dict[int, bytes], list[dict]]:
    """Finish utterance 0 (whose first frame `first` was already read), then read utterance 1."""
    audio = {0: first}
    done: list[dict] = []
    while not done:
        msg = await asyncio.wait_for(ws.recv(), WAIT_S)
        if isinstance(msg, bytes):
            audio[0] += msg
            continue
        event = json.loads(msg)
        assert event["type"] == "audio.done" and event["utterance"] == 0, event
        done.append(event)
    events, rest, more = await read_utterances(ws, 1)
    return events, audio | rest, done + more


async def test_ws_session_audio_starts_before_text_is_complete(server: ServerProc):
    async with websockets.connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        assert (await recv_event(ws))["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.config", "voice": "tara", "max_new_tokens": 70, "seed": 3}))
        updated = await recv_event(ws)
        assert updated["type"] == "session.updated" and updated["session"]["sample_rate"] == SAMPLE_RATE

        await ws.send(json.dumps({"type": "input.text", "text": "Hello there, how are"}))
        await ws.send(json.dumps({"type": "input.text", "text": " you today? "}))
        start = await recv_event(ws)
        assert start == {"type": "audio.start", "utterance": 0, "format": "pcm_s16le", "sample_rate": SAMPLE_RATE,
                         "text": "Hello there, how are you today?"}
        first = await asyncio.wait_for(ws.recv(), WAIT_S)
        # Audio of the first sentence is here; the rest of the text has not been sent yet.
        assert isinstance(first, bytes) and len(first) > 0 and len(first) % FRAME_BYTES == 0

        await ws.send(json.dumps({"type": "input.text", "text": "This is omnistream speaking"}))
        await ws.send(json.dumps({"type": "input.flush"}))
        events, audio, done = await read_utterances_continuing(ws, first)
        await ws.send(json.dumps({"type": "session.close"}))
        assert (await recv_event(ws)) == {"type": "session.done"}
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), WAIT_S)
        assert ws.close_code == 1000

    starts = [e for e in events if e["type"] == "audio.start"]
    assert [s["text"] for s in starts] == ["This is omnistream speaking"]
    assert [d["utterance"] for d in done] == [0, 1]
    for d in done:
        assert d["finish_reason"] in ("stop", "length")
        n = frames_of(d["usage"]["output_tokens"], d["finish_reason"])
        assert n > 0 and len(audio[d["utterance"]]) == n * FRAME_BYTES, (d, len(audio[d["utterance"]]))


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


# ---- concurrency, disconnects --------------------------------------------------------------------


async def test_32_concurrent_streams_equal_their_solo_runs(server: ServerProc):
    n, max_new = 32, 70
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=4 * WAIT_S)) as http:
        together = await asyncio.gather(*(speak_http(http, server, 100 + i, max_new) for i in range(n)))
        for pcm in together:
            assert len(pcm) % FRAME_BYTES == 0 and len(pcm) <= (max_new // 7) * FRAME_BYTES
        assert sum(map(len, together)) > 0
        # Different seeds -> different audio (a mixed-up routing would show as equal streams).
        assert len({pcm for pcm in together if pcm}) == len([pcm for pcm in together if pcm])
        for i in (0, 9, 20, 31):
            alone = await speak_http(http, server, 100 + i, max_new)
            assert len(alone) == len(together[i]), f"stream {i}: {len(together[i])} bytes together, {len(alone)} alone"
            assert max_lsb_diff(alone, together[i]) <= 1, f"stream {i} differs from its solo run"


async def wait_for_idle_engine(http: aiohttp.ClientSession, server: ServerProc, aborted_before: int) -> dict:
    deadline = time.monotonic() + WAIT_S
    s: dict = {}
    while time.monotonic() < deadline:
        s = await stats(http, server)
        if (not s["active_request_ids"] and s["num_running"] == 0 and s["num_waiting"] == 0
                and s["num_free_blocks"] == s["num_total_blocks"] and s["num_aborted_total"] > aborted_before):
            return s
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine did not abort and free the request: {s}")


async def test_client_disconnect_aborts_request(server: ServerProc):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
        before = await stats(http, server)
        body = {"input": "Hello there.", "response_format": "pcm", "seed": LONG_SEED, "max_new_tokens": 700}
        r = await http.post(server.base_url + "/v1/audio/speech", json=body)
        assert r.status == 200
        first = await r.content.readany()
        assert len(first) > 0
        during = await stats(http, server)
        assert len(during["active_request_ids"]) == 1 and during["num_running"] == 1, during
        r.close()  # drop the connection mid-stream
        after = await wait_for_idle_engine(http, server, before["num_aborted_total"])
        assert after["num_requests_total"] == before["num_requests_total"] + 1
        assert after["num_generated_tokens_total"] - before["num_generated_tokens_total"] < 700


# ---- bad input ----------------------------------------------------------------------------------

BAD_BODIES = [
    (b'{"input": "hi", ', None, "invalid_json"),
    (json.dumps({"voice": "tara"}), "input", "missing_required_parameter"),
    (json.dumps({"input": "   "}), "input", "invalid_value"),
    (json.dumps({"input": "a" * 4097}), "input", "invalid_value"),
    (json.dumps({"input": "hi", "voice": "nobody"}), "voice", "invalid_value"),
    (json.dumps({"input": "hi", "response_format": "mp3"}), "response_format", "unsupported_value"),
    (json.dumps({"input": "hi", "speed": 1.5}), "speed", "unsupported_value"),
    (json.dumps({"input": "hi", "temperature": -1}), "temperature", "invalid_value"),
    (json.dumps({"input": "hi", "max_new_tokens": 0}), "max_new_tokens", "invalid_value"),
]


@pytest.mark.parametrize("body,param,code", BAD_BODIES, ids=[c[2] + ":" + str(c[1]) for c in BAD_BODIES])
async def test_bad_speech_request_is_400_naming_the_field(server: ServerProc, body, param, code):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.base_url + "/v1/audio/speech", data=body,
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param and err["code"] == code
    assert (param or "JSON") in err["message"]


def test_openai_client_sees_the_error_param(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as info:
        with client.audio.speech.with_streaming_response.create(model="omnistream", voice="nobody", input="hi"):
            pass
    assert info.value.status_code == 400 and info.value.param == "voice" and "nobody" in info.value.message


async def test_ws_bad_messages_are_error_events_and_other_sessions_carry_on(server: ServerProc):
    url = server.ws_url + "/v1/audio/speech/stream"
    async with websockets.connect(url) as healthy, websockets.connect(url, max_size=None) as bad:
        assert (await recv_event(healthy))["type"] == "session.created"
        await healthy.send(json.dumps({"type": "session.config", "max_new_tokens": 70, "seed": 3}))
        assert (await recv_event(healthy))["type"] == "session.updated"
        await healthy.send(json.dumps({"type": "input.text", "text": "Hello there, how are you today?"}))
        await healthy.send(json.dumps({"type": "input.flush"}))

        assert (await recv_event(bad))["type"] == "session.created"
        cases = [
            ("{not json", "invalid_json", None),
            (json.dumps({"type": "input.nope"}), "unknown_type", "type"),
            (b"\x00\x01\x02", "binary_not_allowed", None),
            (json.dumps({"type": "session.config", "voice": "nobody"}), "invalid_field", "voice"),
            (json.dumps({"type": "input.text", "text": 5}), "invalid_field", "text"),
        ]
        for msg, code, param in cases:
            await bad.send(msg)
            err = await recv_event(bad)
            assert err["type"] == "error" and err["code"] == code and err["param"] == param, (msg, err)
            assert err["message"]
        # still usable after the errors
        await bad.send(json.dumps({"type": "session.config", "voice": "leo"}))
        assert (await recv_event(bad))["session"]["voice"] == "leo"
        await bad.send(json.dumps({"type": "input.text", "text": "x" * 100_000}))
        err = await recv_event(bad)
        assert err["type"] == "error" and err["code"] == "message_too_large"
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(bad.recv(), WAIT_S)
        assert bad.close_code == 1009

        # the healthy session, open the whole time, speaks a second utterance and ends cleanly
        await healthy.send(json.dumps({"type": "input.text", "text": "And this is the second one."}))
        await healthy.send(json.dumps({"type": "session.close"}))
        events, audio, done = await read_utterances(healthy, 2)
        assert (await recv_event(healthy)) == {"type": "session.done"}
        assert [e["text"] for e in events if e["type"] == "audio.start"] == [
            "Hello there, how are you today?", "And this is the second one."]
        for d in done:
            assert len(audio[d["utterance"]]) == frames_of(d["usage"]["output_tokens"], d["finish_reason"]) * FRAME_BYTES


# ---- omnistream client ---------------------------------------------------------------------------


def test_cli_client_speak_and_ws_write_wav(server: ServerProc, tmp_path: Path):
    import wave

    from server.cli import main

    for mode in ("speak", "ws"):
        out = tmp_path / f"{mode}.wav"
        rc = main(["client", mode, "Hello there.", "--url", server.base_url, "-o", str(out), "--max-tokens", "35"])
        assert rc == 0
        with wave.open(str(out)) as w:  # a complete file: the header sizes match the data
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SAMPLE_RATE, 1, 2)
            frames = w.getnframes() if mode == "ws" else (out.stat().st_size - 44) // 2
            assert frames > 0 and frames % 2048 == 0


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


def test_cli_client_reports_server_errors(server: ServerProc, tmp_path: Path, capsys):
    from server.cli import main

    rc = main(["client", "speak", "Hello", "--voice", "nobody", "--url", server.base_url, "-o", str(tmp_path / "x.wav")])
    assert rc == 1
    assert "param=voice" in capsys.readouterr().err


# ---- omnistream bench -----------------------------------------------------------------------------


def test_bench_player_counts_underruns():
    from server.bench import Player

    p = Player(sample_rate=24000)
    p.arrive(10.0, 48000)  # 1 s of audio; playback starts now
    p.arrive(10.9, 24000)  # due at 11.0: in time
    p.arrive(11.7, 24000)  # due at 11.5: 0.2 s late -> one underrun, the player stalls
    p.arrive(12.1, 24000)  # due at 12.0 + 0.2 stall = 12.2: in time
    assert p.underruns == 1 and p.stall_s == pytest.approx(0.2)
    assert p.received_s == pytest.approx(2.5)


async def test_bench_level_against_the_server(server: ServerProc):
    from server.bench import render, run_level

    t0 = time.perf_counter()
    lv = await run_level(server.base_url, 2, "Hello there. How are you?", 35, WAIT_S, ramp_s=0.4)
    assert time.perf_counter() - t0 >= 0.2  # the second stream started half the ramp later
    assert not lv.timed_out and lv.errors == []
    for s in lv.streams:
        assert s.utterances == 2 and s.chunks > 0 and s.ttfa_s is not None and 0 < s.ttfa_s <= s.gen_s
        assert s.audio_s > 0 and round(s.audio_s * SAMPLE_RATE * 2) % FRAME_BYTES == 0
    table = render([lv], {"date": "today"})
    assert "| 2 | 0.4 |" in table and "Largest N" in table and "starts spread evenly over 0.4 s" in table
    # the front end settled its heap at start-up (server/gc_tuning.py) and watches its collections
    async with aiohttp.ClientSession() as http:
        async with http.get(server.base_url + "/metrics") as r:
            text = await r.text()
    full = re.search(r'omnistream_gc_pause_seconds_count\{generation="2"\} (\S+)', text)
    assert full and float(full.group(1)) >= 1, "the settling full collection was not observed"


# ---- engine death (last: it restarts the engine) -------------------------------------------------


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
