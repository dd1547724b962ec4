"""server/routes/zmq_gateway.py on the fake engine: the Python clients, plain msgpack maps, errors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from server.routes.zmq_gateway import ZmqGateway
from server.settings import ServerSettings
from server.tts.voices import SpeechProfile
from streaming.zmq_client import AsyncZmqClient, ZmqClient, ZmqRequestError
from streaming.zmq_protocol import ErrorReply, PongReply, StepReply, decode_reply
from tests.streaming.test_schema import GENERATE_ROWS, LIMITS
from tests.support.fake_engine import FakeEngine, make_tokenizer

WAIT_S = 10.0
plain = msgspec.msgpack.Encoder()


@contextlib.asynccontextmanager
async def gateway(engine: FakeEngine, **settings) -> AsyncIterator[str]:
    """A gateway on a free loopback port; yields the endpoint clients connect to."""
    gw = ZmqGateway(engine, make_tokenizer(), SpeechProfile(), ServerSettings(zmq_endpoint="tcp://127.0.0.1:*", **settings))
    await gw.start()
    try:
        yield gw.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    finally:
        await gw.close()


@contextlib.contextmanager
def dealer(endpoint: str):
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(0)


async def reply(sock) -> tuple[StepReply | ErrorReply, list]:
    frames = await asyncio.wait_for(sock.recv_multipart(), WAIT_S)
    return decode_reply(frames[0]), frames


async def test_async_client_generate_with_hidden_states():
    engine = FakeEngine(steps=4)
    prompt, layers = [3, 4, 5], [0, -1]
    async with gateway(engine) as ep, AsyncZmqClient(ep) as c:
        steps = await asyncio.wait_for(_collect(c.generate(prompt_token_ids=prompt, sampling={"max_tokens": 3},
                                                           hidden_state_layers=layers)), WAIT_S)
    assert [t for s in steps for t in s.token_ids] == [engine.token(prompt, k) for k in range(3)]
    assert [s.finished for s in steps] == [False, False, True] and steps[-1].finish_reason == "length"
    assert steps[-1].usage == {"prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 0}
    assert steps[0].hidden_positions == (0, 3) and steps[1].hidden_positions == (3, 4)
    normalised = [0, engine.info.num_layers]  # -1 counts from the end (streaming.schema's rule)
    np.testing.assert_array_equal(steps[0].hidden, engine.hidden_rows(0, 3, normalised))
    assert engine.requests[0].hidden_state_layers == normalised and not engine.requests[0].audio


async def test_sync_client_speech_streams_audio():
    engine = FakeEngine(steps=5)

    def speak(ep: str) -> list:
        with ZmqClient(ep, timeout_s=WAIT_S) as c:
            return list(c.speech("Hello there.", sampling={"max_tokens": 5}))

    async with gateway(engine) as ep:
        steps = await asyncio.to_thread(speak, ep)
    pcm = np.concatenate([s.audio for s in steps if s.audio is not None])
    assert pcm.dtype == np.int16 and pcm.size == engine.audio_samples_per_request(5)
    assert steps[-1].finished and engine.requests[0].audio


async def test_plain_msgpack_maps_and_the_error_replies():
    engine = FakeEngine(steps=3)
    async with gateway(engine) as ep:
        with dealer(ep) as s:
            await s.send(plain.encode({"type": "generate", "id": "1", "prompt_token_ids": [1, 2],
                                       "sampling": {"max_tokens": 2, "temperature": 0}}))
            got = [await reply(s) for _ in range(2)]
            assert [r.token_ids for r, _ in got] == [[engine.token([1, 2], 0)], [engine.token([1, 2], 1)]]
            assert got[-1][0].finished and [len(f) for _, f in got] == [1, 1]  # no tensors asked for

            async def error_for(*frames: bytes) -> ErrorReply:
                await s.send_multipart(list(frames))
                r, _ = await reply(s)
                assert isinstance(r, ErrorReply)
                return r

            r = await error_for(plain.encode({"type": "shout", "id": "2"}))
            assert (r.id, r.code, r.param) == ("2", "invalid_request", "type")
            r = await error_for(plain.encode({"type": "generate", "id": "3", "promt": "x"}))
            assert (r.id, r.code, r.param) == ("3", "invalid_request", "promt") and "unknown field" in r.message
            r = await error_for(b"a", b"b")
            assert (r.id, r.code, r.param) == ("", "invalid_request", None) and "one msgpack frame" in r.message
            r = await error_for(plain.encode({"type": "speech", "id": "4", "input": "Hi.", "voice": "nobody"}))
            assert (r.id, r.code, r.param) == ("4", "invalid_request", "voice")
            r = await error_for(plain.encode({"type": "generate", "id": "5"}))
            assert (r.id, r.param) == ("5", "prompt_token_ids")  # neither given: as the generate stream says
            engine.overloaded = True
            r = await error_for(plain.encode({"type": "generate", "id": "6", "prompt_token_ids": [1]}))
            assert (r.id, r.code) == ("6", "overloaded")


async def test_duplicate_ids_are_refused_and_abort_stops_the_request():
    engine = FakeEngine(steps=50, step_delay=0.02)
    async with gateway(engine) as ep:
        with dealer(ep) as s:
            start = plain.encode({"type": "generate", "id": "x", "prompt_token_ids": [1]})
            await s.send(start)
            first, _ = await reply(s)
            assert isinstance(first, StepReply) and first.id == "x"
            await s.send(start)
            while isinstance(r := (await reply(s))[0], StepReply):
                pass
            assert (r.id, r.param) == ("x", "id")
            await s.send(plain.encode({"type": "abort", "id": "x"}))
            assert len(await engine.wait_aborted(1, timeout=WAIT_S)) == 1


async def test_client_error_reply_raises_with_code_and_param():
    async with gateway(FakeEngine()) as ep, AsyncZmqClient(ep) as c:
        with pytest.raises(ZmqRequestError) as info:
            await asyncio.wait_for(_collect(c.speech("Hi.", voice="nobody")), WAIT_S)
    assert (info.value.code, info.value.param) == ("invalid_request", "voice")


async def _collect(stream) -> list:
    return [s async for s in stream]


# ---- authentication ------------------------------------------------------------------------

async def test_with_a_key_every_message_must_carry_it():
    engine = FakeEngine(steps=2)
    async with gateway(engine, api_key="sekret") as ep:
        with dealer(ep) as s:
            for extra in ({}, {"api_key": "wrong"}, {"api_key": 5}):
                await s.send(plain.encode({"type": "generate", "id": "a", "prompt_token_ids": [1], **extra}))
                r, _ = await reply(s)
                assert isinstance(r, ErrorReply) and (r.id, r.code, r.param) == ("a", "unauthorized", "api_key")
            # the key is checked before anything else about the frame
            await s.send(plain.encode({"type": "generate", "id": "b", "promt": 1}))
            r, _ = await reply(s)
            assert (r.id, r.code, r.param) == ("b", "unauthorized", "api_key")
            assert engine.requests == []
            await s.send(plain.encode({"type": "generate", "id": "c", "prompt_token_ids": [1], "api_key": "sekret"}))
            r, _ = await reply(s)
            assert isinstance(r, StepReply) and r.id == "c"
        async with AsyncZmqClient(ep, api_key="sekret") as good, AsyncZmqClient(ep) as anonymous:
            steps = await asyncio.wait_for(_collect(good.generate(prompt_token_ids=[2])), WAIT_S)
            assert steps[-1].finished and await asyncio.wait_for(good.ping(), WAIT_S) >= 0
            with pytest.raises(ZmqRequestError) as info:
                await asyncio.wait_for(_collect(anonymous.generate(prompt_token_ids=[2])), WAIT_S)
            assert (info.value.code, info.value.param) == ("unauthorized", "api_key")
            with pytest.raises(ZmqRequestError, match="unauthorized"):
                await asyncio.wait_for(anonymous.ping(), WAIT_S)

    def sync_client(ep: str, key: str | None) -> str:
        with ZmqClient(ep, timeout_s=WAIT_S, api_key=key) as c:
            try:
                return str(list(c.generate(prompt_token_ids=[3]))[-1].finish_reason)
            except ZmqRequestError as e:
                return e.code

    async with gateway(FakeEngine(steps=2), api_key="sekret") as ep:
        assert await asyncio.to_thread(sync_client, ep, "sekret") == "length"
        assert await asyncio.to_thread(sync_client, ep, None) == "unauthorized"


# ---- size limit and malformed frames ------------------------------------------------------------

async def test_a_frame_over_the_limit_gets_an_error_naming_the_limit():
    engine = FakeEngine(steps=2)
    async with gateway(engine, zmq_max_message_bytes=2048) as ep:
        with dealer(ep) as s:
            await s.send(plain.encode({"type": "generate", "id": "big", "prompt": "x" * 3000}))
            r, _ = await reply(s)
            assert isinstance(r, ErrorReply) and (r.id, r.code) == ("big", "too_large")
            assert "2048 bytes" in r.message and "zmq_max_message_bytes" in r.message
            assert engine.requests == []
            await s.send(plain.encode({"type": "generate", "id": "ok", "prompt_token_ids": [1]}))
            assert (await reply(s))[0].id == "ok"  # the connection still serves


@pytest.mark.parametrize("frame, param, id_", [
    (b"\xc1", None, ""),  # not msgpack
    (plain.encode([1, 2]), None, ""),  # not a map
    (plain.encode({"type": "generate"}), "id", ""),  # missing id
    (plain.encode({"type": "generate", "id": 7}), "id", ""),
    (plain.encode({"id": "t"}), "type", "t"),
    (plain.encode({"type": "generate", "id": "h", "prompt_token_ids": [1], "hidden_state_layers": [0, "x"]}),
     "hidden_state_layers", "h"),
    (plain.encode({"type": "generate", "id": "s", "prompt_token_ids": [1], "sampling": [1]}), "sampling", "s"),
    (plain.encode({"type": "generate", "id": "m", "prompt_token_ids": [1], "sampling": {"max_tokenz": 2}}),
     "sampling.max_tokenz", "m"),
    (plain.encode({"type": "generate", "id": "p", "prompt": 5}), "prompt", "p"),
    (plain.encode({"type": "generate", "id": "e", "prompt": ""}), "prompt", "e"),
    (plain.encode({"type": "generate", "id": "2", "prompt": "Hi", "prompt_token_ids": [1]}), "prompt", "2"),
    (plain.encode({"type": "generate", "id": "v", "prompt_token_ids": [10**9]}), "prompt_token_ids", "v"),
    (plain.encode({"type": "speech", "id": "i"}), "input", "i"),
])
async def test_malformed_frames_get_an_error_naming_the_field(frame: bytes, param: str | None, id_: str):
    engine = FakeEngine()
    async with gateway(engine) as ep:
        with dealer(ep) as s:
            await s.send(frame)
            r, _ = await reply(s)
    assert isinstance(r, ErrorReply) and (r.id, r.code, r.param) == (id_, "invalid_request", param), r
    assert r.message.startswith(f"{param}") if param else r.message
    assert engine.requests == []


async def test_engine_side_field_names_are_put_in_the_clients_terms():
    engine = FakeEngine(max_model_len=4)
    async with gateway(engine) as ep, AsyncZmqClient(ep) as c:
        with pytest.raises(ZmqRequestError) as info:  # too long for the model, as text: `prompt`
            await asyncio.wait_for(_collect(c.generate(prompt="Hello there, this is a test.")), WAIT_S)
        assert info.value.param == "prompt" and "fewer than 4" in info.value.message
        engine.reject_field = "prompt_token_ids"  # the engine's name for the prompt
        with pytest.raises(ZmqRequestError) as info:
            await asyncio.wait_for(_collect(c.generate(prompt="Hi")), WAIT_S)
        assert info.value.param == "prompt" and info.value.message.startswith("prompt: ")
        with pytest.raises(ZmqRequestError) as info:
            await asyncio.wait_for(_collect(c.speech("Hi.")), WAIT_S)
        assert info.value.param == "input"
        with pytest.raises(ZmqRequestError) as info:
            await asyncio.wait_for(_collect(c.generate(prompt_token_ids=[1])), WAIT_S)
        assert info.value.param == "prompt_token_ids"


# ---- large text prompts -----------------------------------------------------------------------

BIG_TEXT = ("Hello there, this is a test of the speech server. " * 21000)[:1_000_000]


async def _worst_loop_gap(work) -> tuple[float, object]:
    """(longest the event loop went without running a 1 ms ticker while `work` ran, its result)."""
    worst = 0.0

    async def tick() -> None:
        nonlocal worst
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.001)
            worst = max(worst, loop.time() - t)

    ticker = asyncio.create_task(tick())
    try:
        result = await work
    finally:
        ticker.cancel()
    return worst, result


async def test_a_1mb_prompt_over_max_input_chars_is_refused_at_once():
    engine = FakeEngine()
    async with gateway(engine, zmq_max_message_bytes=2 << 20) as ep, AsyncZmqClient(ep) as c:
        with pytest.raises(ZmqRequestError) as info:
            await asyncio.wait_for(_collect(c.generate(prompt=BIG_TEXT)), WAIT_S)
    assert info.value.param == "prompt" and "over the limit of 4096" in info.value.message
    assert engine.requests == []


async def test_a_1mb_prompt_is_tokenized_off_the_event_loop():
    """Allowed by max_input_chars, a 1 MB prompt takes ~0.7 s to tokenize: in a worker thread
    that releases the GIL, the loop (every other stream) keeps running."""
    engine = FakeEngine(max_model_len=10**7, steps=1)
    async with gateway(engine, zmq_max_message_bytes=2 << 20, max_input_chars=2_000_000) as ep, \
            AsyncZmqClient(ep) as c:
        gap, steps = await _worst_loop_gap(asyncio.wait_for(_collect(c.generate(prompt=BIG_TEXT)), WAIT_S))
    assert steps[-1].finished and len(engine.requests[0].prompt_token_ids) > 100_000
    assert gap < 0.3, f"the event loop stalled {gap:.3f} s"


# ---- clients that go away ---------------------------------------------------------------------

async def test_a_client_that_closes_its_socket_has_its_request_aborted():
    engine = FakeEngine(steps=10_000, step_delay=0.005)
    async with gateway(engine) as ep:
        with dealer(ep) as other:
            await other.send(plain.encode({"type": "generate", "id": "stay", "prompt_token_ids": [2]}))
            with dealer(ep) as leaver:
                await leaver.send(plain.encode({"type": "generate", "id": "x", "prompt_token_ids": [1]}))
                assert isinstance((await reply(leaver))[0], StepReply)
            # closed mid-request: aborted in the engine, without an `abort` message
            aborted = await engine.wait_aborted(1, timeout=WAIT_S)
            assert len(aborted) == 1 and len(engine.active) == 1  # the other client's still runs
            assert (await reply(other))[0].id == "stay"


CHILD_CLIENT = """
import sys, time, msgspec, zmq
s = zmq.Context().socket(zmq.DEALER)
s.connect(sys.argv[1])
s.send(msgspec.msgpack.encode({"type": "generate", "id": "c", "prompt_token_ids": [1]}))
print("sent", flush=True)
time.sleep(120)  # alive but not reading: its libzmq still answers the server's heartbeats
"""


async def test_a_frozen_client_is_dropped_by_heartbeat_and_its_request_aborted():
    import os
    import signal
    import sys

    engine = FakeEngine(steps=10_000, step_delay=0.01)
    timeout_s = 0.6
    async with gateway(engine, zmq_client_timeout_s=timeout_s) as ep:
        child = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD_CLIENT, ep,
                                                     stdout=asyncio.subprocess.PIPE)
        try:
            assert (await asyncio.wait_for(child.stdout.readline(), WAIT_S)).strip() == b"sent"
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT_S
            while not engine.active and loop.time() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(3 * timeout_s)
            assert engine.aborted == [] and len(engine.active) == 1  # slow to read is not gone
            os.kill(child.pid, signal.SIGSTOP)  # frozen: no heartbeat replies any more
            t0 = loop.time()
            await engine.wait_aborted(1, timeout=WAIT_S)
            assert loop.time() - t0 < 4 * timeout_s + 1.0
        finally:
            child.kill()
            await child.wait()


async def test_ping_is_answered_with_a_pong():
    async with gateway(FakeEngine()) as ep:
        with dealer(ep) as s:
            await s.send(plain.encode({"type": "ping", "id": "p1"}))
            r, _ = await reply(s)
    assert isinstance(r, PongReply) and r.id == "p1"


# ---- the shared schema's judgments, through the real gateway ---------------------------------------

@pytest.mark.parametrize("field,value,param", GENERATE_ROWS)
async def test_the_gateway_judges_each_field_as_http_does(field, value, param):
    """streaming.schema's table (the same rows HTTP completions and the generate stream are run
    through), sent as msgpack to the gateway: refused naming the same field, or served."""
    engine = FakeEngine(steps=1, vocab_size=LIMITS.vocab_size, num_layers=LIMITS.num_layers,
                        max_model_len=LIMITS.max_model_len)
    msg: dict = {"type": "generate", "id": "r", "prompt_token_ids": [1, 2]}
    if field == "hidden_state_layers":
        msg[field] = value
    else:
        msg["sampling"] = {field: value}
    async with gateway(engine) as ep:
        with dealer(ep) as s:
            await s.send(plain.encode(msg))
            r, _ = await reply(s)
    if param is None:
        assert isinstance(r, StepReply) and r.finished, r
    else:
        want = param if field == "hidden_state_layers" else f"sampling.{param}"
        assert isinstance(r, ErrorReply) and (r.code, r.param) == ("invalid_request", want), r
        assert engine.requests == []


@pytest.mark.parametrize("msg, param", [
    ({"type": "generate", "prompt": "hi \x00 there"}, "prompt"),  # control characters, as on HTTP
    ({"type": "generate", "prompt": "   "}, "prompt"),
    ({"type": "speech", "input": "hi \x1b there"}, "input"),
    ({"type": "speech", "input": "Hi.", "sampling": {"max_tokens": 10**9}}, "sampling.max_tokens"),
    ({"type": "speech", "input": "Hi.", "sampling": {"temperature": float("nan")}}, "sampling.temperature"),
    # text streamed in: only a model with the streaming-text layout (Qwen3-TTS) takes it
    ({"type": "speech", "input": "Hi ", "stream_input": True}, "stream_input"),
    ({"type": "append", "input": "more"}, "id"),  # no stream_input request under this id
])
async def test_text_and_speech_fields_are_judged_by_the_schema(msg: dict, param: str):
    engine = FakeEngine()
    async with gateway(engine) as ep:
        with dealer(ep) as s:
            await s.send(plain.encode({"id": "t", **msg}))
            r, _ = await reply(s)
    assert isinstance(r, ErrorReply) and (r.id, r.code, r.param) == ("t", "invalid_request", param), r
    assert engine.requests == []


async def test_invalid_utf8_is_refused_without_a_traceback():
    raw = b"\x83\xa4type\xa8generate\xa2id\xa1u\xa6prompt\xa3\xed\xa0\x80"  # a lone surrogate's bytes
    async with gateway(FakeEngine()) as ep:
        with dealer(ep) as s:
            await s.send(raw)
            r, _ = await reply(s)
            await s.send(plain.encode({"type": "generate", "id": "ok", "prompt_token_ids": [1]}))
            assert (await reply(s))[0].id == "ok"
    assert isinstance(r, ErrorReply) and r.code == "invalid_request" and "UTF-8" in r.message


async def test_a_bug_handling_one_frame_is_answered_and_the_gateway_keeps_serving(monkeypatch):
    """A bug while handling one frame is logged and answered internal_error; the socket loop
    goes on and the next message is served (an escaping exception used to end ZeroMQ for all)."""
    from server.routes.zmq_gateway import ZmqGateway as Gw

    real, failed = Gw._read, []

    def read_once_broken(self, raw):
        if not failed:
            failed.append(1)
            raise RuntimeError("a bug")
        return real(self, raw)

    monkeypatch.setattr(Gw, "_read", read_once_broken)
    async with gateway(FakeEngine()) as ep:
        with dealer(ep) as sock:
            await sock.send(plain.encode({"type": "ping", "id": "a"}))
            first = msgspec.msgpack.decode((await asyncio.wait_for(sock.recv_multipart(), WAIT_S))[0])
            assert (first["type"], first["code"]) == ("error", "internal_error")
            await sock.send(plain.encode({"type": "ping", "id": "b"}))
            second = msgspec.msgpack.decode((await asyncio.wait_for(sock.recv_multipart(), WAIT_S))[0])
            assert (second["type"], second["id"]) == ("pong", "b")
