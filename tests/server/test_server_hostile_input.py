"""Issue 32: malformed text and JSON never crash a request, on any protocol, through real clients
(aiohttp, `openai`, `websockets`) against the real app on a FakeEngine. HTTP answers 400 naming
the field; a WebSocket answers an error event and, when the message cannot be read, a close
code (1007 / 1009) within a second; a server bug in a session is an error event and 1011; the
server keeps serving everyone else."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from tests.server.ws_support import recv_json
from tests.support.fake_engine import FakeEngine, serve

SURROGATE = "hi \ud800 x"  # json.dumps writes it as the escape "\ud800": valid JSON, invalid text
WS_PATHS = ["/v1/audio/speech/stream", "/v1/text-to-speech/tara/stream-input", "/v1/generate/stream"]


def deep(depth: int) -> str:
    return '{"input": "hi", "x": ' + "[" * depth + "]" * depth + "}"


async def post(s, path: str, data) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        kw = {"json": data} if isinstance(data, dict) else {"data": data, "headers": {"Content-Type": "application/json"}}
        async with http.post(s.url(path), **kw) as resp:
            return resp.status, await resp.json()


async def still_serving(s) -> None:
    status, _ = await post(s, "/v1/completions", {"prompt": [1], "max_tokens": 2})
    assert status == 200


# ---- HTTP ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/audio/speech", {"input": SURROGATE}, "input"),
        ("/v1/audio/speech", {"input": "ok", "voice": SURROGATE}, "voice"),
        ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
        ("/v1/completions", {"prompt": [SURROGATE]}, "prompt"),
        ("/v1/completions", {"prompt": "ok", "user": SURROGATE}, "user"),
    ],
)
async def test_lone_surrogate_is_a_400_naming_the_field(path, body, param):
    async with serve() as s:
        status, out = await post(s, path, body)
        assert status == 400, out
        err = out["error"]
        assert (err["param"], err["code"]) == (param, "invalid_unicode") and "Unicode" in err["message"]
        assert s.engine.requests == []
        await still_serving(s)


@pytest.mark.parametrize("path", ["/v1/audio/speech", "/v1/completions"])
async def test_100k_deep_json_is_a_400(path):
    async with serve() as s:
        status, out = await post(s, path, deep(100_000).encode())
        assert status == 400
        assert out["error"]["code"] == "json_too_deep" and "32" in out["error"]["message"]
        await still_serving(s)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/audio/speech", {"input": "bell \x07"}, "input"),
        ("/v1/completions", {"prompt": "nul \x00 byte"}, "prompt"),
    ],
)
async def test_control_characters_are_refused(path, body, param):
    async with serve() as s:
        status, out = await post(s, path, body)
        assert status == 400 and (out["error"]["param"], out["error"]["code"]) == (param, "invalid_text")


async def test_nan_speed_names_the_field():
    async with serve() as s:
        status, out = await post(s, "/v1/audio/speech", b'{"input": "hi", "speed": NaN}')
        assert status == 400 and out["error"]["param"] == "speed"


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens", "invalid_type"),
        ({"prompt": "hi", "max_tokens": 10**9}, "max_tokens", "invalid_value"),
        ({"prompt": "hi", "max_tokens": 4097}, "max_tokens", "invalid_value"),
        ({"prompt": "hi", "temperature": "0.5"}, "temperature", "invalid_type"),
        ({"prompt": "hi", "frobnicate": True}, "frobnicate", "unknown_parameter"),
        ({"prompt": "hi", "hidden_state_layers": [-1, 4]}, "hidden_state_layers", "invalid_value"),
        ({"prompt": "hi", "hidden_state_layers": [-6]}, "hidden_state_layers", "invalid_value"),
    ],
)
async def test_completions_strict_types_bounds_and_unknown_keys(body, param, code):
    async with serve() as s:
        status, out = await post(s, "/v1/completions", body)
        assert status == 400 and (out["error"]["param"], out["error"]["code"]) == (param, code), out
        assert s.engine.requests == []


async def test_openai_client_max_tokens_string_is_refused_naming_it():
    async with serve() as s:
        client = openai.AsyncOpenAI(base_url=s.url("/v1"), api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="x", prompt="hi", extra_body={"max_tokens": "5"})
        assert e.value.body["param"] == "max_tokens"
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="x", prompt="hi", max_tokens=10**9)
        assert e.value.body["param"] == "max_tokens"
        # what the openai client sends by default (user included) is accepted
        resp = await client.completions.create(model="x", prompt="hi", max_tokens=2, user="u1", seed=1)
        assert resp.choices[0].finish_reason == "length"


async def test_negative_hidden_layers_are_normalised_on_http_and_ws():
    engine = FakeEngine(steps=2, num_layers=4)
    async with serve(engine) as s:
        status, _ = await post(s, "/v1/completions", {"prompt": [1], "max_tokens": 1, "hidden_state_layers": [-1, -3, 0]})
        assert status == 200
        async with websockets.connect(s.url("/v1/generate/stream", "ws")) as ws:
            await ws.send(json.dumps({"prompt_token_ids": [1], "sampling": {"max_tokens": 1}, "hidden_state_layers": [-5, 2]}))
            while True:
                msg = await asyncio.wait_for(ws.recv(), 2.0)
                if isinstance(msg, str) and json.loads(msg)["type"] == "done":
                    break
    assert [r.hidden_state_layers for r in engine.requests] == [[4, 2, 0], [0, 2]]


# ---- WebSockets ---------------------------------------------------------------------------------


async def opened(ws, path: str) -> None:
    if path == "/v1/audio/speech/stream":
        assert (await recv_json(ws))["type"] == "session.created"


async def closed_within(ws, seconds: float) -> int:
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(ws.recv(), seconds)
    return ws.close_code


def surrogate_message(path: str) -> str:
    if path == "/v1/audio/speech/stream":
        return json.dumps({"type": "input.text", "text": SURROGATE})
    if path == "/v1/generate/stream":
        return json.dumps({"prompt": SURROGATE})
    return json.dumps({"text": SURROGATE})


@pytest.mark.parametrize("path", WS_PATHS)
async def test_ws_lone_surrogate_is_an_error_event_and_close_1007_within_a_second(path):
    async with serve() as s:
        async with websockets.connect(s.url(path, "ws")) as ws:
            await opened(ws, path)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await ws.send(surrogate_message(path))
            err = await recv_json(ws, timeout=1.0)
            assert (err["type"], err["code"]) == ("error", "invalid_unicode")
            assert err["param"] in ("text", "prompt")
            assert await closed_within(ws, 1.0) == 1007
            assert loop.time() - t0 < 1.0
        assert s.engine.requests == []
        await still_serving(s)


@pytest.mark.parametrize("path", WS_PATHS)
async def test_ws_20k_deep_json_is_an_error_event_and_close_1009(path):
    async with serve() as s:
        async with websockets.connect(s.url(path, "ws")) as ws:
            await opened(ws, path)
            await ws.send(deep(20_000))  # 40 kB: under the frame limit
            err = await recv_json(ws, timeout=1.0)
            assert (err["type"], err["code"]) == ("error", "json_too_deep")
            assert await closed_within(ws, 1.0) == 1009
        await still_serving(s)


@pytest.mark.parametrize(
    "message,param",
    [
        ({"type": "session.config", "speed": -5}, "speed"),
        ({"type": "session.config", "speed": "fast"}, "speed"),
        ({"type": "session.config", "speed": 1.5}, "speed"),
        ({"type": "session.config", "instructions": "whisper"}, "instructions"),
        ({"type": "session.config", "colour": "red"}, "colour"),
        ({"type": "session.config", "max_new_tokens": "5"}, "max_new_tokens"),
        ({"type": "session.config", "max_new_tokens": 10**9}, "max_new_tokens"),
        ({"type": "input.text", "text": "hi", "extra": 1}, "extra"),
        ({"type": "input.text", "text": "bell \x07"}, "text"),
        ({"type": "input.flush", "now": True}, "now"),
    ],
)
async def test_session_config_is_judged_as_http_judges_the_body(message, param):
    async with serve() as s:
        # the same field on POST /v1/audio/speech
        body = {"input": "Hi", **{k: v for k, v in message.items() if k not in ("type", "text")}}
        if message["type"] == "session.config":
            status, out = await post(s, "/v1/audio/speech", body)
            assert status == 400 and out["error"]["param"] == param
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)
            await ws.send(json.dumps(message))
            err = await recv_json(ws)
            assert (err["type"], err["code"], err["param"]) == ("error", "invalid_field", param), err
            if message["type"] == "session.config":
                # the same words, too (an unknown key's list of accepted keys is per message shape)
                assert err["message"].split(";")[0] == out["error"]["message"].split(";")[0]
            # a field mistake keeps the session
            await ws.send(json.dumps({"type": "session.config", "speed": 1.0, "voice": "leo"}))
            assert (await recv_json(ws))["session"]["voice"] == "leo"


@pytest.mark.parametrize(
    "message,param",
    [
        ({"text": "hi", "bogus": 1}, "bogus"),
        ({"text": "hi", "flush": "yes"}, "flush"),
        ({"text": " ", "voice_settings": {"speed": 2.0}}, "voice_settings.speed"),
        ({"text": " ", "voice_settings": {"pitch": 1}}, "voice_settings.pitch"),
    ],
)
async def test_elevenlabs_messages_follow_the_same_schema(message, param):
    async with serve() as s:
        async with websockets.connect(s.url("/v1/text-to-speech/tara/stream-input", "ws")) as ws:
            await ws.send(json.dumps(message))
            err = await recv_json(ws)
            assert (err["code"], err["param"]) == ("invalid_field", param)


@pytest.mark.parametrize(
    "message,param",
    [
        ({"prompt_token_ids": [1], "sampling": {"max_tokens": "5"}}, "sampling.max_tokens"),
        ({"prompt_token_ids": [1], "sampling": {"max_tokens": 10**9}}, "sampling.max_tokens"),
        ({"prompt_token_ids": [1], "hidden_state_layers": [0, 0]}, "hidden_state_layers"),
        ({"prompt_token_ids": [1], "extra": 1}, "extra"),
        ({"type": "cancel", "now": True}, "now"),
        ({"prompt": "a\x00b"}, "prompt"),
    ],
)
async def test_generate_stream_strict_fields(message, param):
    async with serve() as s:
        async with websockets.connect(s.url("/v1/generate/stream", "ws")) as ws:
            await ws.send(json.dumps(message))
            err = await recv_json(ws)
            assert (err["code"], err["param"]) == ("invalid_field", param)
            await ws.send(json.dumps({"prompt_token_ids": [1], "sampling": {"max_tokens": 1}}))
            assert (await recv_json(ws))["type"] == "step"


async def test_a_bug_in_a_session_is_an_error_event_and_1011_not_an_http_response(monkeypatch):
    from server.routes import generate_ws

    def broken(ctx, obj):
        raise RuntimeError("a bug")

    monkeypatch.setattr(generate_ws, "parse_generate_message", broken)
    async with serve() as s:
        async with websockets.connect(s.url("/v1/generate/stream", "ws")) as ws:
            await ws.send(json.dumps({"prompt_token_ids": [1]}))
            err = await recv_json(ws, timeout=1.0)
            assert (err["type"], err["code"]) == ("error", "internal_error")
            assert await closed_within(ws, 1.0) == 1011
        await still_serving(s)


@pytest.mark.parametrize("path,module,cls", [
    ("/v1/generate/stream", "server.routes.generate_ws", "GenerateSession"),
    ("/v1/audio/speech/stream", "server.routes.tts_ws", "SpeechStreamSession"),
    ("/v1/text-to-speech/tara/stream-input", "server.routes.elevenlabs_ws", "ElevenLabsSocket"),
])
async def test_a_session_whose_construction_fails_is_1011_not_an_http_response(monkeypatch, path, module, cls):
    """The session object is built inside the guard: a failing constructor (after the upgrade)
    is an error event and close 1011, never an HTTP 500 written into the upgraded socket."""
    import importlib

    def broken(self, *a, **k):
        raise RuntimeError("a bug in the constructor")

    monkeypatch.setattr(getattr(importlib.import_module(module), cls), "__init__", broken)
    async with serve() as s:
        async with websockets.connect(s.url(path, "ws")) as ws:
            err = await recv_json(ws, timeout=1.0)
            assert (err["type"], err["code"]) == ("error", "internal_error")
            assert await closed_within(ws, 1.0) == 1011
        await still_serving(s)
