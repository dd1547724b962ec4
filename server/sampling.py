"""The server's side of streaming.schema: the limits a request is judged against (from the engine
and the settings), and engine rejections -> errors that name the client's field.

Each endpoint spells some fields its own way (`max_new_tokens` on the speech endpoints is
SamplingParams' `max_tokens`; the generate stream nests them under `sampling.`); a name map
{SamplingParams field: client name} turns an engine-side field back into the client's.
"""

from __future__ import annotations

from collections.abc import Mapping

from server.context import ServerContext
from server.errors import APIError, invalid_request
from streaming.schema import SPEECH_NAMES, RequestLimits, nested_names

# {SamplingParams field: the client's name}; a field missing from a map keeps its own name.
SPEECH_FIELDS: Mapping[str, str] = SPEECH_NAMES
COMPLETION_FIELDS: Mapping[str, str] = {}
NESTED_FIELDS: Mapping[str, str] = nested_names("sampling.")


def request_limits(ctx: ServerContext) -> RequestLimits:
    return RequestLimits.of(ctx.engine.info, ctx.settings.max_input_chars, ctx.settings.max_json_depth)


def body_field(engine_field: str, names: Mapping[str, str]) -> str:
    """An engine-side field ("sampling.max_tokens") -> the client's name for it."""
    name = engine_field.removeprefix("sampling.")
    return names.get(name, name)


def sampling_error(engine_field: str, message: str, names: Mapping[str, str]) -> APIError:
    param = body_field(engine_field, names)
    detail = message.split(": ", 1)[1] if ": " in message else message
    return invalid_request(f"{param}: {detail}", param=param)


def rejection_error(error: str | None, error_field: str | None, names: Mapping[str, str], prompt_param: str) -> APIError:
    """An engine output with finish_reason "error" -> the APIError the client should see:
    a 400 naming the client's field when the engine rejected a field, else a 500."""
    message = error or "generation failed"
    if error_field is None:
        return APIError(500, f"Generation failed: {message}", type="server_error", code="generation_failed")
    if error_field.startswith("sampling."):
        return sampling_error(error_field, message, names)
    if error_field in ("prompt", "prompt_token_ids"):
        detail = message.split(": ", 1)[1] if ": " in message else message
        return invalid_request(f"{prompt_param}: {detail}", param=prompt_param)
    return invalid_request(message, param=error_field)
