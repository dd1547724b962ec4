"""Request-body sampling fields -> `SamplingParams`, and engine rejections -> errors that name
the body's field.

Each endpoint spells some fields its own way (`max_new_tokens` on /v1/audio/speech is the
engine's `max_tokens`); a field map {body name: SamplingParams name} covers both directions,
so an invalid value is reported under the name the client sent.
"""

from __future__ import annotations

from typing import Any, Mapping

import msgspec

from server.errors import APIError, invalid_request
from streaming.sampling_params import (
    InvalidRequest,
    SamplingParams,
    decode_sampling_params,
)

SPEECH_FIELDS: Mapping[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
    "max_new_tokens": "max_tokens",
}

COMPLETION_FIELDS: Mapping[str, str] = {
    name: name
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "seed",
        "max_tokens",
        "min_tokens",
        "stop_token_ids",
        "ignore_eos",
    )
}

# Nested `"sampling": {...}` objects (generate WebSocket) use SamplingParams' own names;
# errors name them "sampling.<field>".
NESTED_FIELDS: Mapping[str, str] = {f"sampling.{name}": name for name in SamplingParams.__struct_fields__}


def sampling_from_body(
    body: Mapping[str, Any], defaults: SamplingParams, fields: Mapping[str, str], vocab_size: int
) -> SamplingParams:
    """Defaults overridden by the body's sampling fields (null means "not given", as in
    OpenAI's API), decoded and validated; errors are 400s naming the body's field."""
    overrides = {param: body[name] for name, param in fields.items() if body.get(name) is not None}
    raw = msgspec.structs.asdict(defaults) | overrides
    try:
        params = decode_sampling_params(raw)
        params.validate(vocab_size)
    except InvalidRequest as e:
        raise sampling_error(e.field, str(e), fields) from None
    return params


def nested_sampling(raw: Any, defaults: SamplingParams, vocab_size: int) -> SamplingParams:
    """A `"sampling": {...}` object in SamplingParams' own field names."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise invalid_request("sampling: must be an object", param="sampling")
    unknown = sorted(set(raw) - set(SamplingParams.__struct_fields__))
    if unknown:
        raise invalid_request(f"sampling.{unknown[0]}: unknown sampling field", param=f"sampling.{unknown[0]}")
    return sampling_from_body({f"sampling.{k}": v for k, v in raw.items()}, defaults, NESTED_FIELDS, vocab_size)


def sampling_error(engine_field: str, message: str, fields: Mapping[str, str]) -> APIError:
    """Map an engine-side field ("sampling.max_tokens") back to the body's name."""
    param = body_field(engine_field, fields)
    detail = message.split(": ", 1)[1] if ": " in message else message
    return invalid_request(f"{param}: {detail}", param=param)


def body_field(engine_field: str, fields: Mapping[str, str]) -> str:
    name = engine_field.removeprefix("sampling.")
    for body_name, param in fields.items():
        if param == name or param == engine_field:
            return body_name
    return engine_field


def rejection_error(error: str | None, error_field: str | None, fields: Mapping[str, str], prompt_param: str) -> APIError:
    """An engine output with finish_reason "error" -> the APIError the client should see:
    a 400 naming the body field when the engine rejected a field, else a 500."""
    message = error or "generation failed"
    if error_field is None:
        return APIError(500, f"Generation failed: {message}", type="server_error", code="generation_failed")
    if error_field.startswith("sampling."):
        return sampling_error(error_field, message, fields)
    if error_field in ("prompt", "prompt_token_ids"):
        detail = message.split(": ", 1)[1] if ": " in message else message
        return invalid_request(f"{prompt_param}: {detail}", param=prompt_param)
    return invalid_request(message, param=error_field)

