"""POST /v1/audio/speech through a real HTTP server on a FakeEngine."""

import asyncio
import base64
import io
import json
import struct
import wave

import aiohttp
import openai
import pytest

from streaming.encoders import resolve_format
from tests.streaming.decode import decode, streamed_slack
from tests.support.fake_engine import FakeEngine, chunk_marks, make_tokenizer, serve

SPS = 240  # samples per fake step


def client_for(served, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url("/v1"), api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


async def test_openai_client_streams_pcm():
    async with serve(FakeEngine(samples_per_step=SPS)) as s:
        client = client_for(s)
        chunks = []
        async with client.audio.speech.with_streaming_response.create(
            model="orpheus", voice="leo", input="Hello there.", response_format="pcm"
        ) as resp:
            assert resp.headers["content-type"] == "audio/pcm"
            assert resp.headers["x-sample-rate"] == "24000"
            assert resp.headers["x-request-id"]
            async for chunk in resp.iter_bytes():
                chunks.append(chunk)
        pcm = b"".join(chunks)
        assert len(pcm) == s.engine.audio_samples_per_request() * 2
        assert chunk_marks(pcm, SPS) == [(0, k) for k in range(1, 6)]
        req = s.engine.requests[0]
        assert req.audio is True
        assert req.sampling.temperature == 0.6 and req.sampling.repetition_penalty == 1.1
        assert req.prompt_token_ids[0] == 128259 and req.prompt_token_ids[-4:] == [128009, 128260, 128261, 128257]
        assert s.engine.finished == [req.request_id] and s.engine.aborted == []


async def test_openai_client_streams_wav_with_streaming_header():
    async with serve(FakeEngine(samples_per_step=SPS)) as s:
        async with client_for(s).audio.speech.with_streaming_response.create(
            model="orpheus", voice="tara", input="Hi.", response_format="wav"
        ) as resp:
            assert resp.headers["content-type"] == "audio/wav"
            data = await resp.read()
        assert len(data) == 44 + s.engine.audio_samples_per_request() * 2
        assert data[:4] == b"RIFF" and struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
        chunk_marks(data[44:], SPS)


async def test_non_streamed_wav_is_a_whole_file():
    async with serve(FakeEngine(samples_per_step=SPS)) as s:
        async with client_for(s).audio.speech.with_streaming_response.create(
            model="orpheus", voice="tara", input="Hi.", response_format="wav", extra_body={"stream": False}
        ) as resp:
            data = await resp.read()
            assert int(resp.headers["content-length"]) == len(data)
        n = s.engine.audio_samples_per_request()
        assert len(data) == 44 + 2 * n
        with wave.open(io.BytesIO(data)) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 24000, n)


async def test_sampling_extensions_reach_the_engine():
    async with serve() as s:
        async with aiohttp.ClientSession() as http:
            body = {
                "model": "x",
                "input": "Hi.",
                "voice": {"id": "zoe"},
                "response_format": "pcm",
                "seed": 7,
                "temperature": 0.3,
                "top_p": 0.5,
                "top_k": 40,
                "repetition_penalty": 1.3,
                "max_new_tokens": 3,
            }
            async with http.post(s.url("/v1/audio/speech"), json=body) as resp:
                assert resp.status == 200
                assert len(await resp.read()) == s.engine.audio_samples_per_request(3) * 2
        sp = s.engine.requests[0].sampling
        assert (sp.seed, sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens) == (7, 0.3, 0.5, 40, 1.3, 3)
        # [start_of_human] BOS "zoe: Hi." [end tokens]: the voice lands in the prompt template
        assert make_tokenizer().decode(s.engine.requests[0].prompt_token_ids[2:-4]) == "zoe: Hi."


async def read_sse(resp) -> list[dict]:
    events = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            events.append(json.loads(line[6:]))
    return events


async def test_sse_stream_format():
    async with serve(FakeEngine(samples_per_step=SPS)) as s:
        async with aiohttp.ClientSession() as http:
            body = {"model": "x", "input": "Hi.", "voice": "tara", "response_format": "pcm", "stream_format": "sse"}
            async with http.post(s.url("/v1/audio/speech"), json=body) as resp:
                assert resp.status == 200 and resp.content_type == "text/event-stream"
                events = await read_sse(resp)
        deltas = [e for e in events if e["type"] == "speech.audio.delta"]
        assert len(deltas) == 5 and events[-1]["type"] == "speech.audio.done"
        pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
        assert chunk_marks(pcm, SPS) == [(0, k) for k in range(1, 6)]
        usage = events[-1]["usage"]
        assert usage["output_tokens"] == 6
        assert usage["total_tokens"] == usage["input_tokens"] + 6 and usage["input_tokens"] > 5


async def test_sse_wav_puts_the_header_in_the_first_delta():
    async with serve(FakeEngine(samples_per_step=SPS)) as s:
        async with aiohttp.ClientSession() as http:
            body = {"input": "Hi.", "voice": "tara", "response_format": "wav", "stream_format": "sse"}
            async with http.post(s.url("/v1/audio/speech"), json=body) as resp:
                events = await read_sse(resp)
        data = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
        assert data[:4] == b"RIFF" and len(data) == 44 + 2 * s.engine.audio_samples_per_request()


FORMATS = ["mp3", "opus", "aac", "flac", "wav", "pcm", "pcm_16000", "ulaw_8000", "alaw_8000", "mp3_44100_128"]


@pytest.mark.parametrize("name", FORMATS)
async def test_every_response_format_streams_and_decodes(name):
    """The openai client's own call for each format; an independent decoder (FFmpeg) reads the
    body back to the request's duration (a streamed MP3 / AAC adds its encoder delay)."""
    fmt = resolve_format(name)
    async with serve(FakeEngine(samples_per_step=2400)) as s:
        async with client_for(s).audio.speech.with_streaming_response.create(
            model="x", voice="tara", input="Hi.", response_format=name
        ) as resp:
            assert resp.headers["content-type"] == fmt.content_type
            rate = int(resp.headers["x-sample-rate"])
            assert rate == fmt.rate(24000)
            data = await resp.read()
        samples, decoded_rate = decode(data, fmt)
        seconds = s.engine.audio_samples_per_request() / 24000
        assert seconds * decoded_rate <= len(samples) <= seconds * decoded_rate + streamed_slack(fmt, decoded_rate)
        assert s.engine.aborted == []


async def test_default_format_is_mp3_and_a_whole_mp3_is_exact():
    async with serve(FakeEngine(samples_per_step=2400)) as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi.", "stream": False}) as resp:
                assert resp.status == 200 and resp.headers["content-type"] == "audio/mpeg"
                data = await resp.read()
        samples, rate = decode(data, resolve_format("mp3"))
        assert len(samples) == s.engine.audio_samples_per_request()  # the Xing/LAME header trims


async def test_sse_carries_an_encoded_stream():
    async with serve(FakeEngine(samples_per_step=2400)) as s:
        async with aiohttp.ClientSession() as http:
            body = {"input": "Hi.", "response_format": "opus", "stream_format": "sse"}
            async with http.post(s.url("/v1/audio/speech"), json=body) as resp:
                events = [json.loads(line[6:]) for line in (await resp.text()).splitlines() if line.startswith("data: ")]
        data = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
        samples, rate = decode(data, resolve_format("opus"))
        assert len(samples) == s.engine.audio_samples_per_request() * 2  # Ogg Opus trims exactly; 48 kHz out
        assert events[-1]["type"] == "speech.audio.done"


ERROR_CASES = [
    ({"voice": "tara"}, "input"),
    ({"input": "   ", "voice": "tara"}, "input"),
    ({"input": 5, "voice": "tara"}, "input"),
    ({"input": "x" * 101, "voice": "tara"}, "input"),
    ({"input": "Hi", "voice": "alloy"}, "voice"),
    ({"input": "Hi", "voice": {"name": "tara"}}, "voice"),
    ({"input": "Hi", "response_format": "ogg"}, "response_format"),
    ({"input": "Hi", "response_format": "mp3_44100_999"}, "response_format"),
    ({"input": "Hi", "response_format": "pcm_12345"}, "response_format"),
    ({"input": "Hi", "speed": 1.5}, "speed"),
    ({"input": "Hi", "speed": 9}, "speed"),
    ({"input": "Hi", "speed": "fast"}, "speed"),
    ({"input": "Hi", "stream_format": "ogg"}, "stream_format"),
    ({"input": "Hi", "stream": "yes"}, "stream"),
    ({"input": "Hi", "stream": False, "stream_format": "sse"}, "stream"),
    ({"input": "Hi", "instructions": "whisper"}, "instructions"),
    ({"input": "Hi", "temperature": -1}, "temperature"),
    ({"input": "Hi", "temperature": "hot"}, "temperature"),
    ({"input": "Hi", "top_p": 2}, "top_p"),
    ({"input": "Hi", "top_k": -3}, "top_k"),
    ({"input": "Hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"input": "Hi", "max_new_tokens": 0}, "max_new_tokens"),
    ({"input": "Hi", "max_new_tokens": 2.5}, "max_new_tokens"),
    ({"input": "Hi", "seed": -1}, "seed"),
    ({"input": "Hi", "model": 3}, "model"),
    # issue 32: unknown keys are refused (naming the key), types are strict, text is checked
    ({"input": "Hi", "unknown_field": "x"}, "unknown_field"),
    ({"input": "Hi", "max_new_tokens": "5"}, "max_new_tokens"),
    ({"input": "Hi", "max_new_tokens": 10**9}, "max_new_tokens"),
    ({"input": "Hi", "max_new_tokens": True}, "max_new_tokens"),
    ({"input": "Hi", "seed": 2**70}, "seed"),
    ({"input": "hi \ud800 x"}, "input"),
    ({"input": "hi \x07 x"}, "input"),
    ({"input": "Hi", "voice": {"id": "tara", "extra": 1}}, "voice"),
    ({"input": "Hi", "speed": -5}, "speed"),
    ({"input": None}, "input"),
    ({"input": "Hi", "response_format": ""}, "response_format"),  # empty is not the default
    ({"input": "Hi", "user": 7}, "user"),  # OpenAI's user: a string
]


@pytest.mark.parametrize("body,param", ERROR_CASES)
async def test_bad_fields_are_400s_naming_the_field(body, param):
    async with serve(max_input_chars=100) as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), json=body) as resp:
                assert resp.status == 400
                err = (await resp.json())["error"]
        assert err["param"] == param
        assert param in err["message"]
        assert err["type"] == "invalid_request_error"
        assert s.engine.requests == []


async def test_openai_user_is_accepted():
    async with serve() as s:
        async with aiohttp.ClientSession() as http:
            body = {"input": "Hi", "response_format": "pcm", "user": "user-1234"}
            async with http.post(s.url("/v1/audio/speech"), json=body) as resp:
                assert resp.status == 200 and len(await resp.read())


async def test_unknown_voice_lists_the_valid_ones():
    async with serve() as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi", "voice": "alloy"}) as resp:
                msg = (await resp.json())["error"]["message"]
        assert "alloy" in msg and all(v in msg for v in ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"))


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
async def test_bad_json_body(raw):
    async with serve() as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), data=raw, headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 400
                err = (await resp.json())["error"]
        assert err["code"] == "invalid_json" and "JSON" in err["message"]


@pytest.mark.parametrize("as_output", [False, True])
async def test_engine_rejection_names_the_body_field(as_output):
    engine = FakeEngine()
    engine.reject_field = "sampling.max_tokens"
    engine.reject_as_output = as_output
    async with serve(engine) as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi"}) as resp:
                assert resp.status == 400
                err = (await resp.json())["error"]
    assert err["param"] == "max_new_tokens" and err["message"].startswith("max_new_tokens:")


async def test_prompt_longer_than_the_model_is_400():
    async with serve(FakeEngine(max_model_len=20)) as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), json={"input": "Hello there " * 10}) as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["param"] == "input"


async def test_engine_overloaded_is_429_with_retry_after():
    engine = FakeEngine()
    engine.overloaded = True
    async with serve(engine) as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi"}) as resp:
                assert resp.status == 429
                assert int(resp.headers["Retry-After"]) >= 1
                assert (await resp.json())["error"]["code"] == "overloaded"


async def test_admission_refuses_at_the_door():
    engine = FakeEngine(step_delay=0.05)
    async with serve(engine, max_concurrent_requests=1, retry_after_s=3) as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi", "response_format": "pcm"}) as first:
                assert first.status == 200
                async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi"}) as second:
                    assert second.status == 429
                    assert second.headers["Retry-After"] == "3"
                await first.read()
            async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi"}) as third:
                assert third.status == 200  # the slot came back
                await third.read()
            async with http.get(s.url("/metrics")) as m:
                text = await m.text()
        assert 'omnistream_admission_rejected_total{endpoint="/v1/audio/speech"} 1.0' in text
        assert len(engine.requests) == 2


async def test_dead_engine_is_503_and_health_goes_red():
    engine = FakeEngine()
    async with serve(engine) as s:
        async with aiohttp.ClientSession() as http:
            async with http.get(s.url("/health")) as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "ok"
            engine.dead = True
            async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi"}) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "engine_unavailable"
            async with http.get(s.url("/health")) as resp:
                assert resp.status == 503 and (await resp.json())["status"] == "unavailable"
            async with http.get(s.url("/metrics")) as resp:
                assert 'omnistream_engine_healthy{engine="0"} 0.0' in await resp.text()


@pytest.mark.parametrize("handler_cancellation", [True, False])
async def test_client_disconnect_mid_stream_aborts_the_engine_request(handler_cancellation):
    engine = FakeEngine(steps=200, step_delay=0.01, samples_per_step=SPS)
    async with serve(engine, handler_cancellation=handler_cancellation) as s:
        async with aiohttp.ClientSession() as http:
            resp = await http.post(s.url("/v1/audio/speech"), json={"input": "Hi", "response_format": "pcm"})
            assert resp.status == 200
            await resp.content.readexactly(SPS * 2)
            resp.close()  # drop the connection mid-stream
        aborted = await engine.wait_aborted(1)
        assert aborted == [engine.requests[0].request_id]
        assert not engine.active


@pytest.mark.parametrize("path, body", [("/v1/audio/speech", {"input": "Hi", "response_format": "pcm"}),
                                        ("/v1/audio/speech", {"input": "Hi", "response_format": "wav", "stream": False}),
                                        ("/v1/text-to-speech/tara/stream", {"text": "Hi"})])
async def test_client_gone_before_the_first_output_aborts_the_engine_request(path, body):
    """A request queued behind a busy engine: its client leaves before the first output. The
    server (no handler cancellation, as run_app) notices and aborts it, instead of running it
    to its end for nobody."""
    engine = FakeEngine(steps=4, first_delay=30.0, samples_per_step=SPS)
    async with serve(engine, handler_cancellation=False) as s:
        async with aiohttp.ClientSession() as http:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await http.post(s.url(path), json=body)
        aborted = await engine.wait_aborted(1, timeout=5.0)
        assert aborted == [engine.requests[0].request_id] and not engine.active


async def test_generation_failure_mid_stream_cuts_the_audio_short():
    engine = FakeEngine(samples_per_step=SPS)
    engine.fail_at_step = 3
    async with serve(engine) as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi", "response_format": "pcm"}) as resp:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()


async def test_generation_failure_mid_stream_is_an_sse_error_event():
    engine = FakeEngine(samples_per_step=SPS)
    engine.fail_at_step = 3
    async with serve(engine) as s:
        async with aiohttp.ClientSession() as http:
            body = {"input": "Hi", "response_format": "pcm", "stream_format": "sse"}
            async with http.post(s.url("/v1/audio/speech"), json=body) as resp:
                events = await read_sse(resp)
    assert [e["type"] for e in events] == ["speech.audio.delta", "speech.audio.delta", "error"]
    assert events[-1]["error"]["code"] == "generation_failed"


async def test_engine_death_mid_stream():
    engine = FakeEngine(samples_per_step=SPS)
    engine.die_at_step = 2
    async with serve(engine) as s:
        async with aiohttp.ClientSession() as http:
            body = {"input": "Hi", "response_format": "pcm", "stream_format": "sse"}
            async with http.post(s.url("/v1/audio/speech"), json=body) as resp:
                events = await read_sse(resp)
            assert events[-1]["error"]["code"] == "engine_unavailable"
            async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi", "stream": False}) as resp:
                assert resp.status == 503


async def test_32_concurrent_streams_get_their_own_chunks():
    engine = FakeEngine(steps=12, samples_per_step=SPS, step_delay=0.002)
    async with serve(engine) as s:
        client = client_for(s)

        async def one(i: int) -> bytes:
            async with client.audio.speech.with_streaming_response.create(
                model="x", voice="tara", input=f"Stream number {i}.", response_format="pcm"
            ) as resp:
                return b"".join([c async for c in resp.iter_bytes()])

        results = await asyncio.gather(*(one(i) for i in range(32)))
    serials = set()
    for pcm in results:
        marks = chunk_marks(pcm, SPS)
        assert [step for _, step in marks] == list(range(1, 12))  # no loss, dup or reorder
        assert len({serial for serial, _ in marks}) == 1  # nobody else's chunks
        serials.add(marks[0][0])
    assert serials == set(range(32))
