"""Start-up configuration: the speech profile (omnistream.json), server settings, build_app checks."""

import json

import aiohttp
import pytest

from tests.support.fake_engine import FakeEngine, make_tokenizer, serve


def test_speech_profile_defaults_to_orpheus(tmp_path):
    from server.tts.voices import SpeechProfile

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 156940}))  # Orpheus-3B's vocabulary
    p = SpeechProfile.load(tmp_path)
    assert p.voices == ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe") and p.default_voice == "tara"
    assert (p.sampling.temperature, p.sampling.top_p, p.sampling.repetition_penalty, p.sampling.max_tokens) == (0.6, 0.8, 1.1, 1200)
    tok = make_tokenizer()
    ids = p.build_prompt(tok, "dan", "Hi there.").ids
    assert ids == [128259, tok.bos_token_id, *tok.encode("dan: Hi there."), 128009, 128260, 128261, 128257]


def test_speech_profile_reads_omnistream_json(tmp_path):
    from server.tts.voices import SpeechProfile

    (tmp_path / "omnistream.json").write_text(
        json.dumps({"voices": ["anna", "ben"], "text_template": "<{voice}> {text}", "prefix_token_ids": [1],
                    "suffix_token_ids": [], "add_bos": False, "sampling": {"temperature": 0.9, "max_tokens": 50},
                    "codec": {"path": "snac", "audio_token_offset": 128266}})
    )
    p = SpeechProfile.load(tmp_path)
    assert p.voices == ("anna", "ben") and p.default_voice == "anna" and not p.add_bos
    assert p.sampling.temperature == 0.9 and p.sampling.max_tokens == 50
    tok = make_tokenizer()
    assert p.build_prompt(tok, "ben", "yo").ids == [1, *tok.encode("<ben> yo")]


@pytest.mark.parametrize(
    "content,word",
    [
        ({"voicez": ["a"]}, "voicez"),
        ({"voices": ["a"], "default_voice": "b"}, "default_voice"),
        ({"text_template": "{voice}"}, "text_template"),
        ({"text_template": "{speaker}: {text}"}, "text_template"),
        ({"sampling": {"top_p": 5}}, "top_p"),
        ({"sampling": {"temp": 1}}, "temp"),
    ],
)
def test_bad_omnistream_json_fails_at_start_up(tmp_path, content, word):
    from server.tts.voices import SpeechProfile

    (tmp_path / "omnistream.json").write_text(json.dumps(content))
    with pytest.raises(ValueError) as e:
        SpeechProfile.load(tmp_path)
    assert word in str(e.value) and "omnistream.json" in str(e.value)


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"port": 70000}, "port"),
        ({"api_key": ""}, "api_key"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
        ({"max_ws_message_bytes": 10}, "max_ws_message_bytes"),
        ({"segment_min_clause_chars": 50, "segment_max_chars": 40}, "segment_max_chars"),
        ({"max_open_sessions": 0}, "max_open_sessions"),
        ({"max_requests_per_client": -1}, "max_requests_per_client"),
        ({"http_header_timeout_s": 0}, "http_header_timeout_s"),
        ({"http_body_timeout_s": -1}, "http_body_timeout_s"),
        ({"ws_inactivity_timeout_s": 0}, "ws_inactivity_timeout_s"),
        ({"ws_inactivity_timeout_s": 60, "ws_max_inactivity_timeout_s": 30}, "ws_max_inactivity_timeout_s"),
    ],
)
def test_settings_are_validated_at_start_up(kw, field):
    from server.settings import ServerSettings

    with pytest.raises(ValueError) as e:
        ServerSettings(**kw)
    assert field in str(e.value)


def test_slow_client_limits_are_serve_options():
    import argparse

    from server.settings import ServerSettings
    from streaming.knobs import add_arguments, from_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, ServerSettings)
    args = parser.parse_args(["--http-header-timeout-s", "5", "--http-body-timeout-s", "7", "--ws-inactivity-timeout-s",
                              "9", "--ws-max-inactivity-timeout-s", "60", "--max-open-sessions", "10",
                              "--max-requests-per-client", "3"])
    s = from_arguments(ServerSettings, args)
    assert (s.http_header_timeout_s, s.http_body_timeout_s, s.ws_inactivity_timeout_s) == (5, 7, 9)
    assert (s.ws_max_inactivity_timeout_s, s.max_open_sessions, s.max_requests_per_client) == (60, 10, 3)
    d = ServerSettings()
    assert (d.http_header_timeout_s, d.http_body_timeout_s, d.ws_inactivity_timeout_s) == (10.0, 30.0, 20.0)
    assert (d.ws_max_inactivity_timeout_s, d.max_open_sessions, d.max_requests_per_client) == (180.0, 1024, 0)


def test_settings_validate_the_sampling_override():
    from server.settings import ServerSettings
    from streaming.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="top_p"):
        ServerSettings(speech_sampling=SamplingParams(top_p=0))
    assert ServerSettings(speech_sampling=SamplingParams(temperature=0.1)).speech_sampling.temperature == 0.1


def test_build_app_checks_tokenizer_and_sample_rate():
    from server.app import build_app
    from server.settings import ServerSettings
    from server.tokenizer import TextTokenizer
    from server.tts.voices import SpeechProfile

    tok = make_tokenizer()
    no_bos = TextTokenizer(tok._tok, bos_token_id=None)
    with pytest.raises(ValueError, match="BOS"):
        build_app(FakeEngine(), no_bos, SpeechProfile(), ServerSettings())
    with pytest.raises(ValueError, match="Hz"):
        build_app(FakeEngine(sample_rate=16000), tok, SpeechProfile(), ServerSettings())


async def test_operator_sampling_override_applies_to_speech():
    from streaming.sampling_params import SamplingParams

    override = SamplingParams(temperature=0.2, top_p=0.9, repetition_penalty=1.2, max_tokens=4)
    async with serve(speech_sampling=override) as s:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url("/v1/audio/speech"), json={"input": "Hi", "top_p": 0.7}) as resp:
                await resp.read()
    sp = s.engine.requests[0].sampling
    assert (sp.temperature, sp.top_p, sp.repetition_penalty, sp.max_tokens) == (0.2, 0.7, 1.2, 4)
