"""The info endpoints (models, voices, health, metrics, index) and the API key, on a FakeEngine."""

import aiohttp
import openai

from tests.support.fake_engine import FakeEngine, serve

SPS = 240  # samples per fake step


def client_for(served, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url("/v1"), api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


async def test_api_key_guards_http_but_not_probes():
    async with serve(api_key="sekret") as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi"}) as resp:
                assert resp.status == 401
                assert (await resp.json())["error"]["code"] == "invalid_api_key"
            async with http.get(s.url("/v1/models"), headers={"Authorization": "Bearer wrong"}) as resp:
                assert resp.status == 401
            async with http.get(s.url("/v1/models?api_key=sekret")) as resp:
                assert resp.status == 401  # query keys are for WebSocket upgrades only
            async with http.get(s.url("/v1/models"), headers={"Authorization": "Bearer sekret"}) as resp:
                assert resp.status == 200
            async with http.get(s.url("/v1/audio/voices"), headers={"xi-api-key": "sekret"}) as resp:
                assert resp.status == 200
            for path in ("/health", "/metrics", "/"):
                async with http.get(s.url(path)) as resp:
                    assert resp.status == 200, path
        async with client_for(s, api_key="sekret").audio.speech.with_streaming_response.create(
            model="x", voice="tara", input="Hi.", response_format="pcm"
        ) as resp:
            assert len(await resp.read()) > 0


async def test_info_endpoints_and_metrics():
    async with serve(FakeEngine(samples_per_step=SPS)) as s:
        async with aiohttp.ClientSession() as http:
            async with http.get(s.url("/v1/models")) as resp:
                models = await resp.json()
            assert models["object"] == "list" and models["data"][0]["id"] == "fake-orpheus"
            async with http.get(s.url("/v1/models/fake-orpheus")) as resp:
                assert resp.status == 200
            async with http.get(s.url("/v1/models/gpt-4")) as resp:
                assert resp.status == 404 and (await resp.json())["error"]["param"] == "model"
            async with http.get(s.url("/v1/audio/voices")) as resp:
                voices = await resp.json()
            assert [v["voice_id"] for v in voices["voices"]][:2] == ["tara", "leah"] and voices["default_voice"] == "tara"
            async with http.get(s.url("/nope")) as resp:
                assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
            async with http.get(s.url("/v1/audio/speech")) as resp:
                assert resp.status == 405 and (await resp.json())["error"]["code"] == "method_not_allowed"
            async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi", "response_format": "pcm"}) as resp:
                await resp.read()
            async with http.get(s.url("/"), headers={"X-Request-Id": "abc-123"}) as resp:
                assert resp.headers["X-Request-Id"] == "abc-123"
                assert "<html" in await resp.text()
            async with http.get(s.url("/metrics")) as resp:
                text = await resp.text()
        assert 'omnistream_http_requests_total{endpoint="/v1/audio/speech",status="200"} 1.0' in text
        assert 'omnistream_http_requests_total{endpoint="/v1/models/{model}",status="404"} 1.0' in text
        assert 'omnistream_time_to_first_audio_seconds_count{endpoint="/v1/audio/speech"} 1.0' in text
        assert 'omnistream_engine_requests_total{engine="0"} 1.0' in text
        assert 'omnistream_engine_healthy{engine="0"} 1.0' in text
        assert 'omnistream_active_streams{endpoint="/v1/audio/speech"} 0.0' in text
