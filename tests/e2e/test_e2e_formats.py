"""Every `response_format` through the official `openai` client against the real server: each
body decodes with an independent decoder (FFmpeg via PyAV) to the duration of the `pcm` of the
same seeded request (exactly where the container can trim the encoder's delay, else within
that delay plus one codec frame)."""

from __future__ import annotations

import openai
import pytest

from streaming.encoders import resolve_format
from tests.e2e.helpers import SAMPLE_RATE, speak_openai
from tests.streaming.decode import decode, streamed_slack

pytestmark = pytest.mark.e2e
SEED, TOKENS = 3, 140  # 20 frames of audio unless end-of-speech comes first

FORMATS = ["mp3", "opus", "aac", "flac", "wav", "pcm_16000", "pcm_44100", "ulaw_8000", "mp3_22050_32"]


@pytest.fixture(scope="module")
def pcm_seconds(server) -> float:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=60, max_retries=0)
    headers, chunks = speak_openai(client, "pcm", SEED, TOKENS)
    n = len(b"".join(chunks)) // 2
    assert n > 0
    return n / SAMPLE_RATE


@pytest.mark.parametrize("name", FORMATS)
def test_response_format_decodes_to_the_pcm_duration(client: openai.OpenAI, pcm_seconds: float, name: str):
    fmt = resolve_format(name)
    headers, chunks = speak_openai(client, name, SEED, TOKENS)
    assert headers["content-type"] == fmt.content_type
    assert len([c for c in chunks if c]) >= 1
    samples, rate = decode(b"".join(chunks), fmt)
    expect = pcm_seconds * rate
    assert expect - 1 <= len(samples) <= expect + 1 + streamed_slack(fmt, rate), (len(samples), expect)


def test_the_default_format_is_mp3(client: openai.OpenAI):
    # the openai client sends no response_format unless asked: OpenAI's default, mp3
    resp = client.audio.speech.create(model="omnistream", voice="tara", input="Hi.",
                                      extra_body={"max_new_tokens": 28, "seed": 1})
    assert resp.response.headers["content-type"] == "audio/mpeg"
    samples, _ = decode(resp.content, resolve_format("mp3"))
    assert len(samples) > 0
