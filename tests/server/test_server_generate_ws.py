"""/v1/generate/stream: tokens and hidden rows over a WebSocket, with a real client."""

import asyncio
import json

import numpy as np
import pytest
import websockets

from tests.server.ws_support import recv_json
from tests.support.fake_engine import FakeEngine, serve


async def test_generate_stream_sends_tokens_and_hidden_rows():
    engine = FakeEngine(steps=4)
    async with serve(engine) as s:
        async with websockets.connect(s.url("/v1/generate/stream", "ws")) as ws:
            prompt = [5, 6, 7]
            await ws.send(json.dumps({"prompt_token_ids": prompt, "sampling": {"temperature": 0.0, "max_tokens": 3}, "hidden_state_layers": [0, 4]}))
            tokens, positions = [], []
            while True:
                msg = await recv_json(ws)
                if msg["type"] == "done":
                    break
                assert msg["type"] == "step"
                tokens += msg["token_ids"]
                hidden = msg["hidden"]
                raw = await asyncio.wait_for(ws.recv(), 2.0)
                rows = np.frombuffer(raw, dtype=hidden["dtype"]).reshape(hidden["shape"])
                first, end = hidden["positions"]
                assert rows.shape == (end - first, 2, 8)
                assert np.array_equal(rows[:, 1, 0], np.arange(first, end) + 4000)
                positions.append((first, end))
            assert msg == {"type": "done", "finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
            assert tokens == [engine.token(prompt, k) for k in range(3)]
            assert positions == [(0, 3), (3, 4), (4, 5)]
            # the connection takes another request, this time without hidden states
            await ws.send(json.dumps({"type": "generate", "prompt": "Hello", "sampling": {"max_tokens": 2}}))
            step = await recv_json(ws)
            assert step["hidden"] is None
            assert (await recv_json(ws))["type"] == "step"
            assert (await recv_json(ws))["type"] == "done"
        assert engine.requests[0].sampling.temperature == 0.0


@pytest.mark.parametrize(
    "message,param",
    [
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
        ({"sampling": {"temperature": 0}}, "prompt_token_ids"),
        ({"prompt_token_ids": [1], "sampling": {"temperature": -1}}, "sampling.temperature"),
        ({"prompt_token_ids": [1], "sampling": {"tempurature": 1}}, "sampling.tempurature"),
        ({"prompt_token_ids": [1], "sampling": {"max_tokens": "many"}}, "sampling.max_tokens"),
        ({"prompt_token_ids": [1], "hidden_state_layers": [9]}, "hidden_state_layers"),
    ],
)
async def test_generate_stream_bad_requests_name_the_field(message, param):
    async with serve() as s:
        async with websockets.connect(s.url("/v1/generate/stream", "ws")) as ws:
            await ws.send(json.dumps(message))
            err = await recv_json(ws)
            assert (err["type"], err["code"], err["param"]) == ("error", "invalid_field", param)
            await ws.send(json.dumps({"prompt_token_ids": [1], "sampling": {"max_tokens": 1}}))
            assert (await recv_json(ws))["type"] == "step"


async def test_generate_stream_cancel_and_busy():
    engine = FakeEngine(steps=500, step_delay=0.01)
    async with serve(engine) as s:
        async with websockets.connect(s.url("/v1/generate/stream", "ws")) as ws:
            await ws.send(json.dumps({"prompt_token_ids": [1, 2], "sampling": {"max_tokens": 500}}))
            assert (await recv_json(ws))["type"] == "step"
            await ws.send(json.dumps({"prompt_token_ids": [3]}))
            while (msg := await recv_json(ws))["type"] == "step":
                pass
            assert msg["code"] == "busy"
            await ws.send(json.dumps({"type": "cancel"}))
            while (msg := await recv_json(ws))["type"] == "step":
                pass
            assert msg == {"type": "done", "finish_reason": "abort", "usage": None}
        assert engine.aborted == [engine.requests[0].request_id]
