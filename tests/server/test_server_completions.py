"""POST /v1/completions: OpenAI client, SSE, hidden states, errors, disconnect."""

import base64
import json

import aiohttp
import numpy as np
import openai
import pytest

from tests.support.fake_engine import FakeEngine, make_tokenizer, serve


def client_for(served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url("/v1"), api_key="unused", max_retries=0)


def expected_text(engine: FakeEngine, prompt: list[int], n: int) -> str:
    return make_tokenizer().decode([engine.token(prompt, k) for k in range(n)])


async def test_openai_client_completion():
    engine = FakeEngine(steps=5)
    async with serve(engine) as s:
        resp = await client_for(s).completions.create(model="fake-orpheus", prompt="Hello there", max_tokens=4, temperature=0.2)
    prompt = engine.requests[0].prompt_token_ids
    tok = make_tokenizer()
    assert prompt == tok.encode("Hello there", add_bos=True)
    assert resp.object == "text_completion" and resp.model == "fake-orpheus"
    assert resp.choices[0].text == expected_text(engine, prompt, 4)
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (len(prompt), 4, len(prompt) + 4)
    assert engine.requests[0].sampling.temperature == 0.2 and engine.requests[0].sampling.max_tokens == 4
    assert engine.requests[0].hidden_state_layers == []


async def test_openai_client_streaming_completion_with_usage():
    engine = FakeEngine(steps=6)
    async with serve(engine) as s:
        stream = await client_for(s).completions.create(
            model="x", prompt=[3, 4, 5], max_tokens=16, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(engine, [3, 4, 5], 6)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert engine.requests[0].prompt_token_ids == [3, 4, 5]


async def sse_events(resp) -> list:
    out = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:]
            out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


async def test_streamed_hidden_states():
    engine = FakeEngine(steps=4, hidden_size=8, num_layers=4)
    async with serve(engine) as s:
        async with aiohttp.ClientSession() as http:
            body = {"prompt": [[9, 8, 7]], "max_tokens": 4, "stream": True, "return_hidden_states": True, "hidden_state_layers": [0, 2]}
            async with http.post(s.url("/v1/completions"), json=body) as resp:
                assert resp.status == 200
                events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    tokens, spans = [], []
    for c in chunks:
        choice = c["choices"][0]
        tokens += choice["token_ids"]
        h = choice["hidden_states"]
        rows = np.frombuffer(base64.b64decode(h["data"]), dtype=h["dtype"]).reshape(h["shape"])
        first, end = h["positions"]
        assert rows.shape == (end - first, 2, 8)
        assert np.array_equal(rows[:, 0, 3], np.arange(first, end, dtype=np.float32))
        assert np.array_equal(rows[:, 1, 0], np.arange(first, end, dtype=np.float32) + 2000)
        spans.append((first, end))
    assert spans == [(0, 3), (3, 4), (4, 5), (5, 6)]
    assert tokens == [engine.token([9, 8, 7], k) for k in range(4)]
    assert engine.requests[0].hidden_state_layers == [0, 2]


async def test_whole_response_hidden_states_default_to_the_final_layer():
    engine = FakeEngine(steps=3, num_layers=4)
    async with serve(engine) as s:
        async with aiohttp.ClientSession() as http:
            body = {"prompt": [1, 2], "max_tokens": 3, "return_hidden_states": True}
            async with http.post(s.url("/v1/completions"), json=body) as resp:
                out = await resp.json()
    h = out["choices"][0]["hidden_states"]
    assert h["shape"] == [4, 1, 8] and h["positions"] == [0, 4] and h["dtype"] == "float32"
    rows = np.frombuffer(base64.b64decode(h["data"]), dtype="<f4").reshape(h["shape"])
    assert np.array_equal(rows[:, 0, 0], np.arange(4, dtype=np.float32) + 4000)
    assert engine.requests[0].hidden_state_layers == [4]


ERROR_CASES = [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 999999]}, "prompt"),
    ({"prompt": {"x": 1}}, "prompt"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "logprobs": 2}, "logprobs"),
    ({"prompt": "hi", "suffix": "end"}, "suffix"),
    ({"prompt": "hi", "stop": ["\n"]}, "stop"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty"),
    ({"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "hi", "return_hidden_states": "yes"}, "return_hidden_states"),
    ({"prompt": "hi", "hidden_state_layers": [5]}, "hidden_state_layers"),
    ({"prompt": "hi", "hidden_state_layers": [1, 1]}, "hidden_state_layers"),
    ({"prompt": "hi", "hidden_state_layers": "all"}, "hidden_state_layers"),
]


@pytest.mark.parametrize("body,param", ERROR_CASES)
async def test_bad_fields_are_400s_naming_the_field(body, param):
    async with serve() as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/completions"), json=body) as resp:
                assert resp.status == 400
                err = (await resp.json())["error"]
    assert err["param"] == param and param in err["message"]
    assert s.engine.requests == []


async def test_openai_client_sees_400_as_bad_request():
    async with serve() as s:
        with pytest.raises(openai.BadRequestError) as e:
            await client_for(s).completions.create(model="x", prompt="hi", n=2)
    assert e.value.body["param"] == "n"


async def test_max_tokens_past_the_context_is_refused_as_openai_does():
    # the fake engine's max_model_len is 4096: a 4000-token prompt leaves room for 96 tokens
    async with serve() as s:
        with pytest.raises(openai.BadRequestError) as e:
            await client_for(s).completions.create(model="x", prompt=[5] * 4000, max_tokens=97)
        assert e.value.body["param"] == "max_tokens" and "at most 96" in e.value.body["message"]
        assert s.engine.requests == []
        await client_for(s).completions.create(model="x", prompt=[5] * 4000, max_tokens=96)
        assert s.engine.requests[0].sampling.max_tokens == 96


async def test_disconnect_mid_stream_aborts():
    engine = FakeEngine(steps=300, step_delay=0.01)
    async with serve(engine) as s:
        async with aiohttp.ClientSession() as http:
            resp = await http.post(s.url("/v1/completions"), json={"prompt": [1], "max_tokens": 300, "stream": True})
            await resp.content.readline()
            resp.close()
        assert await engine.wait_aborted(1) == [engine.requests[0].request_id]


async def test_failure_mid_stream_is_an_error_event():
    engine = FakeEngine(steps=5)
    engine.fail_at_step = 2
    async with serve(engine) as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/completions"), json={"prompt": [1], "stream": True}) as resp:
                events = await sse_events(resp)
            assert events[-2]["error"]["code"] == "generation_failed" and events[-1] == "[DONE]"
            async with http.post(s.url("/v1/completions"), json={"prompt": [1]}) as resp:
                assert resp.status == 500
                assert (await resp.json())["error"]["type"] == "server_error"


async def test_incremental_decoding_holds_back_split_characters():
    tok = make_tokenizer()
    ids = tok.encode("héllo wörld ünïcode", add_bos=False)
    dec = tok.incremental_decoder()
    pieces = [dec.push([i]) for i in ids] + [dec.flush()]
    assert "".join(pieces) == "héllo wörld ünïcode"
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("as_output", [False, True])
async def test_engine_rejection_names_the_field(as_output):
    engine = FakeEngine()
    engine.reject_field = "sampling.top_k"
    engine.reject_as_output = as_output
    async with serve(engine) as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/completions"), json={"prompt": [1], "stream": True}) as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["param"] == "top_k"


async def test_slow_reader_dropped_by_the_engine_client_gets_an_error_event():
    engine = FakeEngine(steps=5)
    engine.overflow_at_step = 2
    async with serve(engine) as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/completions"), json={"prompt": [1], "stream": True}) as resp:
                events = await sse_events(resp)
            assert events[-2]["error"]["code"] == "overloaded" and events[-1] == "[DONE]"
            body = {"input": "Hi", "response_format": "pcm"}
            async with http.post(s.url("/v1/audio/speech"), json=body) as resp:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
