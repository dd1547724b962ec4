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
from server.tts.voices import SpeechProfile
from streaming.zmq_client import AsyncZmqClient, ZmqClient, ZmqRequestError
from streaming.zmq_protocol import ErrorReply, StepReply, decode_reply
from tests.support.fake_engine import FakeEngine, make_tokenizer

WAIT_S = 10.0
plain = msgspec.msgpack.Encoder()


@contextlib.asynccontextmanager
async def gateway(engine: FakeEngine) -> AsyncIterator[str]:
    """A gateway on a free loopback port; yields the endpoint clients connect to."""
    gw = ZmqGateway(engine, make_tokenizer(), SpeechProfile(), "tcp://127.0.0.1:*")
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
    np.testing.assert_array_equal(steps[0].hidden, engine.hidden_rows(0, 3, layers))
    assert engine.requests[0].hidden_state_layers == layers and not engine.requests[0].audio


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
            assert (r.id, r.code) == ("", "invalid_request") and "promt" in r.message
            r = await error_for(b"a", b"b")
            assert (r.id, r.code, r.message) == ("", "invalid_request", "expected exactly one msgpack frame")
            r = await error_for(plain.encode({"type": "speech", "id": "4", "input": "Hi.", "voice": "nobody"}))
            assert (r.id, r.code, r.param) == ("4", "invalid_request", "voice")
            r = await error_for(plain.encode({"type": "generate", "id": "5"}))
            assert (r.id, r.param) == ("5", "prompt_token_ids")
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
