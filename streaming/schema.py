"""One request schema for every protocol: HTTP bodies, WebSocket messages and ZeroMQ frames are
decoded into the msgspec Structs below and judged by the functions below, so a field has the same
type, bounds, default and error message wherever it arrives. The JSON / msgpack door
(streaming/schema_door.py) and the speech requests (streaming/speech_schema.py) live in modules
of their own; this module re-exports both and is what callers import.

Rules (docs/api.md "Request schema"):

- Types are strict: `max_tokens: "5"` or `stream: "yes"` is refused, never coerced. `null` means
  "not given" (as in OpenAI's API), so every optional field is `T | None = None`.
- Unknown keys are refused everywhere, naming the key (`forbid_unknown_fields`).
- Every error is a `SchemaError` whose `field` (the wire's `param`) is the client's own name for
  the field, dotted for nested ones (`sampling.top_p`, `stream_options.include_usage`).
- Text is checked once at the door: valid Unicode (a JSON `\\ud800` escape is refused), no
  control characters other than \\n \\t \\r, at most `max_input_chars` characters.
- JSON nesting deeper than `max_depth` is refused before any parser recurses into it.
- `max_tokens` (speech: `max_new_tokens`) is at most the model's max_model_len; on the text
  endpoints an explicit `max_tokens` must also fit beside the prompt (`check_prompt_length`).
- Hidden-state layers: HF indexing over the L+1 states (0 = embeddings, i = input of layer i,
  L = final normed output); -1..-(L+1) count from the end (-1 = L). Indices are normalised to
  0..L and a layer named twice (after normalising: [0, 0], [-1, L]) is refused.

The transport-specific parts (aiohttp, ZeroMQ sockets) stay in the server; this module only
needs msgspec and numpy so the clients and both processes can import it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from streaming.sampling_params import InvalidRequest, SamplingParams
from streaming.schema_door import (  # noqa: F401  (re-exported: this module is the schema's public face)
    INVALID_JSON,
    INVALID_TEXT,
    INVALID_TYPE,
    INVALID_UNICODE,
    INVALID_VALUE,
    JSON_TOO_DEEP,
    MISSING,
    UNKNOWN,
    UNSUPPORTED,
    RequestLimits,
    SchemaError,
    _has_surrogate,
    check_depth,
    convert,
    decode,
    decode_json_object,
    json_depth,
    schema_error,
)
from streaming.speech_schema import (  # noqa: F401  (re-exported, as the door's names)
    AUTO_LANGUAGE,
    SPEECH_NAMES,
    SPEECH_STREAM_MESSAGES,
    SPEED_RANGE,
    InputDone,
    InputFlush,
    InputText,
    SessionClose,
    SessionConfig,
    SpeechOptions,
    SpeechRequest,
    SpeechSampling,
    check_language,
    check_speech_options,
    check_speed,
    voice_name,
)

T = TypeVar("T")

# ---- text ------------------------------------------------------------------------------------------

# C0 and C1 control characters and DEL, except tab, newline and carriage return.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def check_text(value: str, param: str, max_chars: int, *, allow_empty: bool = False) -> str:
    """A client's text, judged once: valid Unicode, no control characters but \\n \\t \\r, at
    most max_chars characters, and (unless allow_empty) not blank."""
    if _has_surrogate(value):
        raise SchemaError(param, "not valid Unicode (a lone UTF-16 surrogate such as \\ud800)", INVALID_UNICODE)
    if m := _CONTROL.search(value):
        raise SchemaError(param, f"control character U+{ord(m.group()):04X} at index {m.start()}; "
                                 "only \\n, \\t and \\r are allowed", INVALID_TEXT)
    if len(value) > max_chars:
        raise SchemaError(param, f"{len(value)} characters is over the limit of {max_chars}")
    if not allow_empty and not value.strip():
        raise SchemaError(param, "must not be empty")
    return value


def token_ids(value: list[int], param: str, vocab_size: int) -> list[int]:
    if not value:
        raise SchemaError(param, "must be a non-empty list of token ids")
    for i, t in enumerate(value):
        if not 0 <= t < vocab_size:
            raise SchemaError(param, f"token id {t} at index {i} is outside the vocabulary [0, {vocab_size})")
    return list(value)


# ---- hidden-state layers -----------------------------------------------------------------------------


def hidden_layers(value: list[int] | None, num_layers: int, param: str = "hidden_state_layers") -> list[int]:
    """The one rule for every protocol: indices in -(L+1)..L over the L+1 hidden states,
    negative ones counted from the end, normalised to 0..L; a layer named twice is refused.
    None or [] = no hidden states."""
    if not value:
        return []
    n = num_layers
    out: list[int] = []
    for x in value:
        if not -(n + 1) <= x <= n:
            raise SchemaError(
                param,
                f"layer {x} is out of range [-{n + 1}, {n}] (0 = embeddings, i = input of layer i, "
                f"{n} = final normed output; negative counts from the end, -1 = {n})",
            )
        norm = x if x >= 0 else n + 1 + x
        if norm in out:
            raise SchemaError(param, f"layer {x} names layer {norm} twice; indices must be unique")
        out.append(norm)
    return out


# ---- sampling --------------------------------------------------------------------------------------------


class GenerationOptions(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Sampling fields in SamplingParams' own names, all optional (None = the endpoint's default).
    The nested `"sampling": {...}` object of the generate stream and ZeroMQ."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None

    def given(self) -> dict[str, Any]:
        """{SamplingParams field: value} for the fields the client set."""
        return {f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not None}


SAMPLING_FIELDS: tuple[str, ...] = GenerationOptions.__struct_fields__


def nested_names(prefix: str = "sampling.") -> dict[str, str]:
    """{SamplingParams field: client name} for a nested sampling object."""
    return {f: prefix + f for f in SAMPLING_FIELDS}


def sampling_params(
    given: Mapping[str, Any],
    defaults: SamplingParams,
    limits: RequestLimits,
    names: Mapping[str, str] | None = None,
) -> SamplingParams:
    """`defaults` overridden by `given` ({SamplingParams field: value}), judged with the bounds of
    SamplingParams.validate plus max_tokens <= the model's max_model_len. `names` maps a
    SamplingParams field to the client's name for it (errors name that). A default over the
    model's length is capped, never blamed on the client."""
    names = names or {}
    merged = msgspec.structs.asdict(defaults) | dict(given)
    limit = limits.max_model_len
    if "max_tokens" in given and given["max_tokens"] > limit:
        param = names.get("max_tokens", "max_tokens")
        raise SchemaError(param, f"must be at most the model's length {limit}, got {given['max_tokens']}")
    merged["max_tokens"] = min(merged["max_tokens"], limit)
    for f in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        v = merged[f]
        if isinstance(v, float) and not math.isfinite(v):
            raise SchemaError(names.get(f, f), f"must be a finite number, got {v}")
    top_k = merged["top_k"]
    if top_k > limits.vocab_size:  # also keeps it inside msgpack's integers on the IPC path
        raise SchemaError(names.get("top_k", "top_k"), f"must be in [0, {limits.vocab_size}] (0 disables), got {top_k}")
    params = SamplingParams(**merged)
    try:
        params.validate(limits.vocab_size, limits.codes_per_frame, limits.code0_penalty)
    except InvalidRequest as e:
        field = e.field.removeprefix("sampling.")
        detail = str(e).split(": ", 1)[1] if ": " in str(e) else str(e)
        raise SchemaError(names.get(field, field), detail) from None
    return params


# ---- completions and the generate stream ----------------------------------------------------------------


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None


class CompletionRequest(GenerationOptions, forbid_unknown_fields=True):
    """POST /v1/completions: OpenAI's fields (the unsupported ones are named and refused by the
    handler) plus extensions; the sampling fields are GenerationOptions' (flat, as OpenAI's)."""

    model: str | None = None
    prompt: str | list[Any] | None = None  # a string, token ids, or a one-element list of either
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    stop: str | list[str] | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    return_hidden_states: bool | None = None
    hidden_state_layers: list[int] | None = None
    skip_special_tokens: bool | None = None

    def given_sampling(self) -> dict[str, Any]:
        return {f: v for f in SAMPLING_FIELDS if (v := getattr(self, f)) is not None}


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A generate request's fields on every protocol (WS /v1/generate/stream, ZeroMQ): the
    prompt as token ids or text, sampling in SamplingParams' names, hidden-state layers."""

    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    sampling: GenerationOptions | None = None
    hidden_state_layers: list[int] | None = None


class GenerateMessage(GenerateRequest, tag_field="type", tag="generate"):
    """WS /v1/generate/stream's request message (`type` may be left out)."""


class CancelMessage(msgspec.Struct, tag_field="type", tag="cancel", forbid_unknown_fields=True):
    pass


@dataclass(frozen=True)
class GenerateJob:
    prompt_token_ids: list[int] | None  # None: `prompt_text` is to be tokenized by the caller
    prompt_text: str | None
    sampling: SamplingParams
    hidden_state_layers: list[int]
    asked_max_tokens: int | None  # sampling.max_tokens when the client gave it

    def check_prompt(self, n_tokens: int, limits: RequestLimits, param: str) -> None:
        """check_prompt_length for this job's prompt (ids, or the text once tokenized)."""
        check_prompt_length(n_tokens, limits, param, self.asked_max_tokens, "sampling.max_tokens")


def generate_job(req: GenerateRequest, defaults: SamplingParams, limits: RequestLimits) -> GenerateJob:
    """Judge a GenerateRequest (any protocol). The text prompt is checked, not tokenized."""
    text: str | None = None
    ids: list[int] | None = None
    if req.prompt_token_ids is not None and req.prompt is not None:
        raise SchemaError("prompt", "give prompt_token_ids or prompt, not both")
    if req.prompt_token_ids is not None:
        ids = token_ids(req.prompt_token_ids, "prompt_token_ids", limits.vocab_size)
    elif req.prompt is not None:
        text = check_text(req.prompt, "prompt", limits.max_input_chars)
    else:
        raise SchemaError("prompt_token_ids", "give prompt_token_ids (token ids) or prompt (text)", MISSING)
    given = req.sampling.given() if req.sampling is not None else {}
    sampling = sampling_params(given, defaults, limits, nested_names())
    layers = hidden_layers(req.hidden_state_layers, limits.num_layers)
    job = GenerateJob(ids, text, sampling, layers, given.get("max_tokens"))
    if ids is not None:
        job.check_prompt(len(ids), limits, "prompt_token_ids")
    return job


def check_prompt_length(n_tokens: int, limits: RequestLimits, param: str,
                        asked: int | None = None, asked_param: str = "max_tokens") -> None:
    """The prompt leaves room under the model's length; when the client asked for `asked` new
    tokens explicitly (`asked_param`), they must fit beside it too (OpenAI's completions refuse
    prompt + max_tokens over the context). A default is cut at the model's length instead."""
    limit = limits.max_model_len
    if n_tokens >= limit:
        raise SchemaError(param, f"{n_tokens} tokens; the model takes fewer than {limit}")
    if asked is not None and n_tokens + asked > limit:
        raise SchemaError(asked_param, f"the prompt takes {n_tokens} of the model's {limit} positions, "
                                       f"so at most {limit - n_tokens} new tokens fit; got {asked}")
