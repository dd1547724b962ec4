"""streaming.schema: every field's type and bounds, unknown keys, text at the door, JSON depth,
the hidden-layer rule, and the same judgment of a field on every protocol (table-driven)."""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from streaming.sampling_params import SamplingParams
from streaming.schema import (
    INVALID_JSON,
    INVALID_TEXT,
    INVALID_TYPE,
    INVALID_UNICODE,
    JSON_TOO_DEEP,
    MISSING,
    UNKNOWN,
    UNSUPPORTED,
    CompletionRequest,
    GenerateMessage,
    GenerateRequest,
    GenerationOptions,
    RequestLimits,
    SchemaError,
    SessionConfig,
    SpeechRequest,
    check_prompt_length,
    check_speech_options,
    check_speed,
    check_text,
    convert,
    decode,
    decode_json_object,
    generate_job,
    hidden_layers,
    json_depth,
    nested_names,
    sampling_params,
    schema_error,
    voice_name,
)

LIMITS = RequestLimits(vocab_size=1000, max_model_len=4096, num_layers=4, max_input_chars=100)


def refused(fn, *args, **kw) -> SchemaError:
    with pytest.raises(SchemaError) as e:
        fn(*args, **kw)
    assert str(e.value).startswith(f"{e.value.field}: ") or e.value.field is None
    return e.value


# ---- JSON at the door ---------------------------------------------------------------------------


def test_depth_is_counted_outside_strings_only():
    assert json_depth(b'{"a": [1, {"b": [2]}]}') == 4
    assert json_depth(b'{"a": "[[[[[[[[[[{{{{{{"}') == 1
    assert json_depth(b'{"a": "\\"[[[[", "b": []}') == 2  # an escaped quote does not end the string
    assert json_depth(b"123") == 0


@pytest.mark.parametrize("depth", [33, 20_000, 100_000])
def test_deep_json_is_refused_before_parsing(depth):
    raw = b'{"a":' + b"[" * depth + b"]" * depth + b"}"
    t0 = time.perf_counter()
    e = refused(decode_json_object, raw, 32)
    assert time.perf_counter() - t0 < 0.5
    assert e.code == JSON_TOO_DEEP and e.field is None and "32" in str(e)


def test_nesting_at_the_limit_is_fine():
    raw = b'{"a":' + b"[" * 31 + b"]" * 31 + b"}"
    assert decode_json_object(raw, 32) == {"a": json.loads(b"[" * 31 + b"]" * 31)}


@pytest.mark.parametrize("raw", [b"{not json", b'{"a": 1', b"\xff\xfe", b"", b'{"a": 1} x'])
def test_not_json(raw):
    assert refused(decode_json_object, raw, 32).code == INVALID_JSON


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"3", b"null"])
def test_not_an_object(raw):
    e = refused(decode_json_object, raw, 32)
    assert e.code == INVALID_JSON and "object" in str(e)


@pytest.mark.parametrize(
    "raw,param",
    [
        (b'{"input": "hi \\ud800 x"}', "input"),
        (b'{"input": "\\udc00"}', "input"),
        (b'{"sampling": {"x": ["ok", "\\ud83d"]}}', "sampling.x"),
        ('{"text": "lone \\ud800 in a str frame"}', "text"),
    ],
)
def test_lone_surrogates_are_named(raw, param):
    e = refused(decode_json_object, raw, 32)
    assert (e.field, e.code) == (param, INVALID_UNICODE)
    assert "Unicode" in str(e)


def test_surrogate_pairs_are_fine():
    assert decode_json_object(b'{"input": "\\ud83d\\ude00"}', 32) == {"input": "\U0001f600"}


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_is_not_json_and_names_the_field(literal):
    e = refused(decode_json_object, f'{{"input": "hi", "speed": {literal}}}', 32)
    assert e.field == "speed" and "finite" in str(e)


# ---- strict types, unknown keys, messages in the client's terms -----------------------------------


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({"input": "hi", "max_new_tokens": "5"}, "max_new_tokens", INVALID_TYPE),
        ({"input": "hi", "max_new_tokens": 2.5}, "max_new_tokens", INVALID_TYPE),
        ({"input": "hi", "max_new_tokens": True}, "max_new_tokens", INVALID_TYPE),
        ({"input": "hi", "stream": "yes"}, "stream", INVALID_TYPE),
        ({"input": "hi", "speed": "fast"}, "speed", INVALID_TYPE),
        ({"input": 5}, "input", INVALID_TYPE),
        ({"input": "hi", "model": 3}, "model", INVALID_TYPE),
        ({"input": "hi", "voice": 3}, "voice", INVALID_TYPE),
        ({"input": "hi", "colour": "red"}, "colour", UNKNOWN),
    ],
)
def test_speech_body_types(body, param, code):
    e = refused(convert, body, SpeechRequest)
    assert (e.field, e.code) == (param, code)
    assert str(e).startswith(param + ": ")


def test_unknown_key_lists_the_accepted_ones():
    e = refused(convert, {"prompt": "x", "tempurature": 1}, CompletionRequest)
    assert e.field == "tempurature" and "temperature" in str(e) and e.code == UNKNOWN


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"prompt": "x", "stream_options": {"other": 1}}, "stream_options.other"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"1": "a"}}, "logit_bias"),
        ({"prompt": "x", "stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"prompt": "x", "hidden_state_layers": "all"}, "hidden_state_layers"),
    ],
)
def test_nested_errors_name_the_dotted_field(body, param):
    assert refused(convert, body, CompletionRequest).field == param


def test_null_means_not_given():
    req = convert({"input": "hi", "voice": None, "temperature": None, "stream": None}, SpeechRequest)
    assert req.voice is None and req.given() == {}


def test_logit_bias_keys_are_token_ids():
    assert convert({"prompt": "x", "logit_bias": {"5": 1.5}}, CompletionRequest).logit_bias == {5: 1.5}


def test_schema_error_from_a_msgpack_decode():
    frame = msgspec.msgpack.encode({"sampling": {"max_tokens": "5"}})
    with pytest.raises(msgspec.ValidationError) as e:
        msgspec.msgpack.decode(frame, type=GenerateRequest)
    err = schema_error(e.value, GenerateRequest)
    assert (err.field, err.code) == ("sampling.max_tokens", INVALID_TYPE)


# ---- text ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,code",
    [
        ("hi \ud800 x", INVALID_UNICODE),
        ("bell \x07", INVALID_TEXT),
        ("nul \x00", INVALID_TEXT),
        ("del \x7f", INVALID_TEXT),
        ("c1 \x85", INVALID_TEXT),
        ("x" * 101, "invalid_value"),
        ("   ", "invalid_value"),
    ],
)
def test_text_is_judged_once(text, code):
    e = refused(check_text, text, "input", 100)
    assert (e.field, e.code) == ("input", code)


def test_text_allows_newlines_tabs_and_any_script():
    assert check_text("a\nb\tc\r\n héllo 日本 \U0001f600", "input", 100) == "a\nb\tc\r\n héllo 日本 \U0001f600"
    assert check_text("", "text", 100, allow_empty=True) == ""


# ---- hidden-state layers: the one rule ---------------------------------------------------------------


@pytest.mark.parametrize(
    "layers,expected",
    [
        (None, []),
        ([], []),
        ([0, 4], [0, 4]),
        ([-1], [4]),
        ([-3], [2]),
        ([-5], [0]),
        ([4, -5, 2], [4, 0, 2]),  # order kept
    ],
)
def test_hidden_layers_accepted(layers, expected):
    assert hidden_layers(layers, 4) == expected


@pytest.mark.parametrize("layers", [[5], [-6], [0, 0], [-1, 4], [1, -4]])
def test_hidden_layers_refused(layers):
    assert refused(hidden_layers, layers, 4).field == "hidden_state_layers"


# ---- sampling ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given,param",
    [
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"max_tokens": 4097}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": float("inf")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 10**30}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop_token_ids": [1000]}, "stop_token_ids"),
        ({"logit_bias": {1000: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ],
)
def test_sampling_bounds_name_the_clients_field(given, param):
    for names, prefix in (({}, ""), (nested_names(), "sampling.")):
        e = refused(sampling_params, given, SamplingParams(), LIMITS, names)
        assert e.field == prefix + param
    if param == "max_tokens":  # the speech endpoints' name for it
        assert refused(sampling_params, given, SamplingParams(), LIMITS, {"max_tokens": "max_new_tokens"}).field == "max_new_tokens"


def test_sampling_defaults_over_the_model_length_are_capped_not_blamed():
    params = sampling_params({}, SamplingParams(max_tokens=10_000), LIMITS)
    assert params.max_tokens == LIMITS.max_model_len
    assert sampling_params({"max_tokens": 4096}, SamplingParams(), LIMITS).max_tokens == 4096


def test_code0_penalty_at_the_door_follows_the_engine():
    """A multi-codebook engine whose Ready says code0_penalty (Qwen3-TTS) takes repetition_penalty
    and still refuses frequency / presence; one without (CSM) refuses all three."""
    from streaming.ipc import Ready

    info = Ready(model="m", vocab_size=1000, hidden_size=8, num_layers=4, max_model_len=4096, max_num_seqs=2,
                 codes_per_frame=16, code0_penalty=True)
    qwen = RequestLimits.of(info, 100)
    csm = RequestLimits.of(msgspec.structs.replace(info, code0_penalty=False), 100)
    assert sampling_params({"repetition_penalty": 1.05}, SamplingParams(), qwen).repetition_penalty == 1.05
    assert refused(sampling_params, {"repetition_penalty": 1.05}, SamplingParams(), csm).field == "repetition_penalty"
    for f in ("frequency_penalty", "presence_penalty"):
        assert refused(sampling_params, {f: 0.5}, SamplingParams(), qwen).field == f


def test_generation_options_given():
    opts = convert({"temperature": 0, "stop_token_ids": [1]}, GenerationOptions)
    assert opts.given() == {"temperature": 0.0, "stop_token_ids": [1]}


# ---- speech options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("speed", [float("nan"), -5.0, 0.1, 9.0, 1.5])
def test_speed(speed):
    e = refused(check_speed, speed)
    assert e.field == "speed" and (e.code == UNSUPPORTED) == (speed == 1.5)


def test_voice_forms():
    assert voice_name("tara") == "tara" and voice_name({"id": "leo"}) == "leo" and voice_name(None) is None
    for bad in ({"name": "tara"}, {"id": 3}, {"id": "tara", "x": 1}):
        assert refused(voice_name, bad).field == "voice"


def test_elevenlabs_message_shapes():
    from server.tts.elevenlabs_messages import ElevenLabsInput

    msg = convert({"text": " ", "voice_settings": {"stability": 0.5, "speed": 1.0},
                   "generation_config": {"chunk_length_schedule": [50]}, "xi_api_key": "k"}, ElevenLabsInput)
    assert msg.text == " " and msg.voice_settings.speed == 1.0
    assert refused(convert, {"text": "x", "voice_settings": {"pitch": 2}}, ElevenLabsInput).field == "voice_settings.pitch"
    assert refused(convert, {"text": "x", "bogus": 1}, ElevenLabsInput).field == "bogus"


# ---- one field, one judgment on every protocol ----------------------------------------------------------
# Each row is a (client field, value) and whether it is refused; the same row is run through the
# HTTP speech body and the WS session.config (speech), and through the HTTP completions body, the
# WS generate message and a ZeroMQ-style msgpack GenerateRequest (generation).


def judge_speech_http(field: str, value) -> str | None:
    try:
        req = convert({"input": "hi", field: value}, SpeechRequest)
        check_speech_options(req)
        voice_name(req.voice)
        sampling_params(req.given(), SamplingParams(max_tokens=1200), LIMITS, {"max_tokens": "max_new_tokens"})
    except SchemaError as e:
        return e.field
    return None


def judge_session_config(field: str, value) -> str | None:
    try:
        msg = decode(json.dumps({"type": "session.config", field: value}), SessionConfig, 32)
        check_speech_options(msg)
        voice_name(msg.voice)
        sampling_params(msg.given(), SamplingParams(max_tokens=1200), LIMITS, {"max_tokens": "max_new_tokens"})
    except SchemaError as e:
        return e.field
    return None


SPEECH_ROWS = [
    ("speed", 1.0, None),
    ("speed", -5, "speed"),
    ("speed", "fast", "speed"),
    ("speed", 1.5, "speed"),
    ("instructions", "whisper", "instructions"),
    ("instructions", "", None),
    ("colour", "red", "colour"),
    ("voice", {"id": "tara"}, None),
    ("voice", {"name": "tara"}, "voice"),
    ("max_new_tokens", "5", "max_new_tokens"),
    ("max_new_tokens", 10**9, "max_new_tokens"),
    ("max_new_tokens", 100, None),
    ("temperature", -1, "temperature"),
    ("temperature", 0.5, None),
    ("top_k", 2.5, "top_k"),
    ("seed", 7, None),
    ("seed", -7, "seed"),
    ("model", None, None),
]


@pytest.mark.parametrize("field,value,param", SPEECH_ROWS)
def test_speech_fields_are_judged_alike_on_http_and_session_config(field, value, param):
    assert judge_speech_http(field, value) == param
    assert judge_session_config(field, value) == param


def test_nan_speed_is_refused_on_both_speech_protocols():
    body = '{"input": "hi", "speed": NaN}'
    assert refused(decode, body, SpeechRequest, 32).field == "speed"
    assert refused(decode, '{"type": "session.config", "speed": NaN}', SessionConfig, 32).field == "speed"
    assert refused(check_speed, float("nan")).field == "speed"  # msgpack can carry a NaN


def judge_completions(field: str, value) -> str | None:
    try:
        req = convert({"prompt": [1, 2], field: value}, CompletionRequest)
        sampling_params(req.given_sampling(), SamplingParams(max_tokens=16), LIMITS)
        hidden_layers(req.hidden_state_layers, LIMITS.num_layers)
    except SchemaError as e:
        return e.field
    return None


def judge_generate_ws(field: str, value) -> str | None:
    msg = {"prompt_token_ids": [1, 2]}
    if field == "hidden_state_layers":
        msg[field] = value
    else:
        msg["sampling"] = {field: value}
    try:
        generate_job(decode(json.dumps(msg), GenerateMessage, 32), SamplingParams(), LIMITS)
    except SchemaError as e:
        return e.field
    return None


def judge_zmq(field: str, value) -> str | None:
    msg = {"prompt_token_ids": [1, 2]}
    if field == "hidden_state_layers":
        msg[field] = value
    else:
        msg["sampling"] = {field: value}
    try:
        frame = msgspec.msgpack.encode(msg)
        try:
            req = msgspec.msgpack.decode(frame, type=GenerateRequest)
        except msgspec.ValidationError as e:
            raise schema_error(e, GenerateRequest) from None
        generate_job(req, SamplingParams(), LIMITS)
    except SchemaError as e:
        return e.field
    return None


GENERATE_ROWS = [
    ("max_tokens", 5, None),
    ("max_tokens", "5", "max_tokens"),
    ("max_tokens", 10**9, "max_tokens"),
    ("max_tokens", 5.0, "max_tokens"),
    ("temperature", 0, None),
    ("temperature", "hot", "temperature"),
    ("top_p", 2, "top_p"),
    ("ignore_eos", 1, "ignore_eos"),
    ("stop_token_ids", [-1], "stop_token_ids"),
    ("stop_token_ids", [5], None),
    ("seed", 2**63, "seed"),
    ("tempurature", 1, "tempurature"),
    ("hidden_state_layers", [-1, -3], None),
    ("hidden_state_layers", [0, 0], "hidden_state_layers"),
    ("hidden_state_layers", [-1, 4], "hidden_state_layers"),
    ("hidden_state_layers", [5], "hidden_state_layers"),
    ("hidden_state_layers", ["0"], "hidden_state_layers"),
]


@pytest.mark.parametrize("field,value,param", GENERATE_ROWS)
def test_generation_fields_are_judged_alike_on_every_protocol(field, value, param):
    flat = judge_completions(field, value)
    nested_param = None if param is None else (param if field == "hidden_state_layers" else f"sampling.{param}")
    assert flat == param
    assert judge_generate_ws(field, value) == nested_param
    assert judge_zmq(field, value) == nested_param


def test_generate_job_prompt_rules():
    job = generate_job(GenerateRequest(prompt="hello", hidden_state_layers=[-1]), SamplingParams(), LIMITS)
    assert (job.prompt_token_ids, job.prompt_text, job.hidden_state_layers) == (None, "hello", [4])
    assert refused(generate_job, GenerateRequest(), SamplingParams(), LIMITS).code == MISSING
    assert refused(generate_job, GenerateRequest(prompt_token_ids=[]), SamplingParams(), LIMITS).field == "prompt_token_ids"
    assert refused(generate_job, GenerateRequest(prompt_token_ids=[1000]), SamplingParams(), LIMITS).field == "prompt_token_ids"
    assert refused(generate_job, GenerateRequest(prompt="a\x00b"), SamplingParams(), LIMITS).field == "prompt"
    assert refused(generate_job, GenerateRequest(prompt="x", prompt_token_ids=[1]), SamplingParams(), LIMITS).field == "prompt"
    long = GenerateRequest(prompt_token_ids=[1] * 4096)
    assert refused(generate_job, long, SamplingParams(), LIMITS).field == "prompt_token_ids"


def test_an_explicit_max_tokens_must_fit_beside_the_prompt():
    # LIMITS.max_model_len is 4096: a 4000-token prompt leaves room for 96 new tokens
    fits = generate_job(GenerateRequest(prompt_token_ids=[1] * 4000, sampling=GenerationOptions(max_tokens=96)),
                        SamplingParams(), LIMITS)
    assert fits.sampling.max_tokens == 96
    over = GenerateRequest(prompt_token_ids=[1] * 4000, sampling=GenerationOptions(max_tokens=97))
    e = refused(generate_job, over, SamplingParams(), LIMITS)
    assert e.field == "sampling.max_tokens" and "at most 96 new tokens" in str(e)
    # a default (256 here) is cut at the model's length, never blamed on the client
    job = generate_job(GenerateRequest(prompt_token_ids=[1] * 4000), SamplingParams(), LIMITS)
    assert job.asked_max_tokens is None
    # a text prompt is judged once tokenized, naming the same field
    text = generate_job(GenerateRequest(prompt="hi", sampling=GenerationOptions(max_tokens=100)), SamplingParams(), LIMITS)
    assert refused(text.check_prompt, 3997, LIMITS, "prompt").field == "sampling.max_tokens"
    text.check_prompt(3996, LIMITS, "prompt")
    assert refused(check_prompt_length, 10, LIMITS, "prompt", 4087).field == "max_tokens"
    check_prompt_length(10, LIMITS, "prompt", 4086)
