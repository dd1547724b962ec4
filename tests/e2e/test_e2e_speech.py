"""End to end, speech: POST /v1/audio/speech through the official `openai` package and plain
HTTP, the WS speech session with a `websockets` client, bad input."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import wave
from pathlib import Path

import aiohttp
import openai
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from tests.e2e.helpers import (
    FRAME_BYTES,
    SAMPLE_RATE,
    TOKENS_PER_FRAME,
    WAIT_S,
    frames_of,
    max_lsb_diff,
    recv_event,
    speak_http,
    speak_openai,
)
from tests.support.server_proc import ServerProc

pytestmark = pytest.mark.e2e


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
    prompt = SpeechProfile.load(model_dir).build_prompt(TextTokenizer.from_folder(model_dir), "tara", text).ids
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
        assert start == {"type": "audio.start", "utterance": 0, "sentence_index": 0,
                         "sentence_text": "Hello there, how are you today?", "format": "pcm_s16le",
                         "sample_rate": SAMPLE_RATE, "text": "Hello there, how are you today?"}
        first = await asyncio.wait_for(ws.recv(), WAIT_S)
        # Audio of the first sentence is here; the rest of the text has not been sent yet.
        assert isinstance(first, bytes) and len(first) > 0 and len(first) % FRAME_BYTES == 0

        await ws.send(json.dumps({"type": "input.text", "text": "This is omnistream speaking"}))
        await ws.send(json.dumps({"type": "input.flush"}))
        events, audio, done = await read_utterances_continuing(ws, first)
        await ws.send(json.dumps({"type": "session.close"}))
        assert (await recv_event(ws)) == {"type": "session.done", "total_sentences": 2}
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


# ---- bad input ----------------------------------------------------------------------------------

BAD_BODIES = [
    (b'{"input": "hi", ', None, "invalid_json"),
    (json.dumps({"voice": "tara"}), "input", "missing_required_parameter"),
    (json.dumps({"input": "   "}), "input", "invalid_value"),
    (json.dumps({"input": "a" * 4097}), "input", "invalid_value"),
    (json.dumps({"input": "hi", "voice": "nobody"}), "voice", "invalid_value"),
    (json.dumps({"input": "hi", "response_format": "ogg"}), "response_format", "unsupported_value"),
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
        assert (await recv_event(healthy)) == {"type": "session.done", "total_sentences": 2}
        assert [e["text"] for e in events if e["type"] == "audio.start"] == [
            "Hello there, how are you today?", "And this is the second one."]
        for d in done:
            assert len(audio[d["utterance"]]) == frames_of(d["usage"]["output_tokens"], d["finish_reason"]) * FRAME_BYTES


# ---- whole WAV files carry their length -------------------------------------------------------------


def test_non_streamed_wav_has_the_exact_length_header(client: openai.OpenAI):
    with client.audio.speech.with_streaming_response.create(
        model="omnistream", voice="tara", input="Hello there.", response_format="wav",
        extra_body={"stream": False, "max_new_tokens": 70, "seed": 3},
    ) as r:
        assert r.status_code == 200, r.text
        data = r.read()
        assert int(r.headers["content-length"]) == len(data)
    riff_size, data_size = struct.unpack("<I", data[4:8])[0], struct.unpack("<I", data[40:44])[0]
    assert (riff_size, data_size) == (len(data) - 8, len(data) - 44)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SAMPLE_RATE)
        assert w.getnframes() == (len(data) - 44) // 2 > 0
        assert len(w.readframes(w.getnframes())) == len(data) - 44
    # the same request streamed keeps the unknown-length header (sizes are not known up front)
    _, chunks = speak_openai(client, "wav", seed=3, max_new_tokens=70)
    streamed = b"".join(chunks)
    assert struct.unpack("<I", streamed[40:44])[0] == 0xFFFFFFFF
    assert max_lsb_diff(streamed[44:], data[44:]) <= 1 and len(streamed) == len(data)


# ---- hostile input against the real server ------------------------------------------------------------


async def test_surrogates_and_deep_json_never_crash_the_real_server(server: ServerProc):
    async with aiohttp.ClientSession() as http:
        for path, body, param in [("/v1/audio/speech", {"input": "hi \ud800 x"}, "input"),
                                  ("/v1/completions", {"prompt": "hi \ud800 x"}, "prompt")]:
            async with http.post(server.base_url + path, json=body) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == param
        deep = b'{"input": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        async with http.post(server.base_url + "/v1/audio/speech", data=deep,
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "json_too_deep"
    for path, msg in [("/v1/generate/stream", {"prompt": "hi \ud800 x"}),
                      ("/v1/audio/speech/stream", {"type": "input.text", "text": "hi \ud800 x"}),
                      ("/v1/text-to-speech/tara/stream-input", {"text": "hi \ud800 x"})]:
        async with websockets.connect(server.ws_url + path) as ws:
            if path == "/v1/audio/speech/stream":
                assert (await recv_event(ws))["type"] == "session.created"
            await ws.send(json.dumps(msg))
            err = await recv_event(ws, timeout=1.0)
            assert (err["type"], err["code"]) == ("error", "invalid_unicode")
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 1.0)
            assert ws.close_code == 1007
    async with websockets.connect(server.ws_url + "/v1/generate/stream") as ws:
        await ws.send('{"prompt": "x", "y": ' + "[" * 20_000 + "]" * 20_000 + "}")
        assert (await recv_event(ws, timeout=1.0))["code"] == "json_too_deep"
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 1.0)
        assert ws.close_code == 1009
    async with aiohttp.ClientSession() as http:
        assert len(await speak_http(http, server, seed=1, max_new_tokens=28)) > 0  # still serving
