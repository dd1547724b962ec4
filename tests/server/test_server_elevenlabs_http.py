"""ElevenLabs' HTTP text-to-speech on a FakeEngine, with the requests LiveKit's plugin 1.8.9
(ChunkedStream) and Pipecat's ElevenLabsHttpTTSService send."""

import base64
import json

import aiohttp
import pytest

from streaming.encoders import resolve_format
from tests.streaming.decode import decode, streamed_slack
from tests.support.fake_engine import FakeEngine, chunk_marks, serve

SPS = 2400


async def test_livekit_chunked_stream_request():
    async with serve(FakeEngine(samples_per_step=SPS), api_key="k") as s:
        async with aiohttp.ClientSession() as http:
            url = s.url("/v1/text-to-speech/tara/stream?output_format=mp3_22050_32&enable_logging=true")
            body = {"text": "Hello there.", "model_id": "eleven_turbo_v2_5", "voice_settings": None,
                    "apply_text_normalization": "auto"}
            async with http.post(url, json=body, headers={"xi-api-key": "k"}) as r:
                assert r.status == 200 and r.content_type.startswith("audio/")  # what LiveKit checks
                data = await r.read()
    fmt = resolve_format("mp3_22050_32")
    samples, rate = decode(data, fmt)
    n = s.engine.audio_samples_per_request() * 22050 / 24000
    assert n <= len(samples) <= n + streamed_slack(fmt, rate)


async def test_pipecat_stream_with_timestamps():
    async with serve(FakeEngine(samples_per_step=SPS)) as s:
        async with aiohttp.ClientSession() as http:
            url = s.url("/v1/text-to-speech/tara/stream/with-timestamps")
            body = {"text": "Hello there, friend.", "model_id": "eleven_flash_v2_5", "previous_text": "Hi."}
            async with http.post(url, json=body, params={"output_format": "pcm_24000", "enable_logging": "true"},
                                 headers={"xi-api-key": "x"}) as r:
                assert r.status == 200
                lines = [json.loads(line) async for line in r.content if line.strip()]
    audio = b"".join(base64.b64decode(x["audio_base64"]) for x in lines)
    assert len(chunk_marks(audio, SPS)) == 5
    chars, starts, ends = [], [], []
    for x in lines:
        a = x["alignment"]
        if a:
            chars += a["characters"]
            starts += a["character_start_times_seconds"]
            ends += a["character_end_times_seconds"]
            assert x["normalized_alignment"] == a
    assert "".join(chars) == "Hello there, friend."
    assert starts == sorted(starts) and all(e >= b for b, e in zip(starts, ends))
    assert starts[0] == 0 and ends[-1] == pytest.approx(len(audio) / 2 / 24000, abs=0.002)


async def test_whole_file_and_timestamps_json():
    async with serve(FakeEngine(samples_per_step=SPS)) as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/text-to-speech/tara?output_format=wav_16000"), json={"text": "Hi."}) as r:
                assert r.headers["content-type"] == "audio/wav"
                samples, rate = decode(await r.read(), resolve_format("wav_16000"))
                assert len(samples) == s.engine.audio_samples_per_request() * 2 // 3
            async with http.post(s.url("/v1/text-to-speech/tara/with-timestamps?output_format=pcm_24000"),
                                 json={"text": "Hi."}) as r:
                x = await r.json()
    assert len(base64.b64decode(x["audio_base64"])) == s.engine.audio_samples_per_request() * 2
    assert x["alignment"]["characters"] == ["H", "i", "."]


@pytest.mark.parametrize("path,body,param", [
    ("/stream", {"model_id": "m"}, "text"),
    ("/stream", {"text": "Hi", "voice_settings": {"stability": 5}}, "voice_settings.stability"),
    ("/stream", {"text": "Hi", "voice_settings": {"speed": 1.2}}, "voice_settings.speed"),
    ("/stream", {"text": "Hi", "unknown": 1}, "unknown"),
    ("/stream?output_format=mp3_1_1", {"text": "Hi"}, "output_format"),
    ("/stream?optimize_streaming_latency=9", {"text": "Hi"}, "optimize_streaming_latency"),
])
async def test_bad_requests_name_the_field(path, body, param):
    async with serve() as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/text-to-speech/tara" + path), json=body) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == param
        assert s.engine.requests == []
