"""The request schema's door: error codes and SchemaError, the limits requests are judged
against, and JSON / msgpack decoding with client-named errors (depth bounded before parsing,
lone surrogates and NaN located, msgspec's validation errors turned into the client's field
names). streaming/schema.py builds the request Structs and their judgments on these."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import numpy as np

from streaming.sampling_params import InvalidRequest

T = TypeVar("T")


# ---- errors ------------------------------------------------------------------------------------

# SchemaError.code values (HTTP's `error.code`).
INVALID_JSON = "invalid_json"  # not JSON, or not a JSON object
JSON_TOO_DEEP = "json_too_deep"  # nesting over the limit (refused before parsing)
INVALID_UNICODE = "invalid_unicode"  # not valid Unicode (a lone surrogate): unreadable as text
INVALID_TEXT = "invalid_text"  # valid Unicode the text fields do not take (control characters)
MISSING = "missing_required_parameter"
UNKNOWN = "unknown_parameter"
INVALID_TYPE = "invalid_type"
INVALID_VALUE = "invalid_value"
UNSUPPORTED = "unsupported_value"


class SchemaError(InvalidRequest):
    """A request the schema refuses. `field` is the client's name for the offending field
    (None when the message as a whole is bad); str(e) is "field: why"."""

    def __init__(self, field: str | None, message: str, code: str = INVALID_VALUE):
        super().__init__(field or "request", message)
        if field is None:
            self.args = (message,)
        self.field = field  # type: ignore[assignment]  # InvalidRequest's is str; ours may be None
        self.code = code
        self.detail = message

    @property
    def message(self) -> str:
        return str(self)


# ---- limits the schema judges against ------------------------------------------------------------


@dataclass(frozen=True)
class RequestLimits:
    """What a request is judged against: the served model's sizes and the server's text limit."""

    vocab_size: int
    max_model_len: int
    num_layers: int
    max_input_chars: int
    max_depth: int = 32
    codes_per_frame: int = 1  # > 1: a multi-codebook model (SamplingParams.validate's rules)
    code0_penalty: bool = False  # ... whose code 0 takes repetition_penalty (validate's flag)

    @classmethod
    def of(cls, info: Any, max_input_chars: int, max_depth: int = 32) -> RequestLimits:
        """From the engine's Ready message (streaming.ipc.Ready) and the server's settings."""
        return cls(info.vocab_size, info.max_model_len, info.num_layers, max_input_chars, max_depth,
                   info.codes_per_frame, info.code0_penalty)


# ---- JSON at the door ------------------------------------------------------------------------------

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[list(b"[{")] = 1
_BRACKET_STEP[list(b"]}")] = -1


def json_depth(raw: bytes) -> int:
    """Deepest bracket nesting of a JSON text, brackets inside strings not counted. O(n) and in
    C (regex, translate, numpy), so a hostile 1 MB body costs milliseconds, not recursion."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return int(np.cumsum(_BRACKET_STEP[np.frombuffer(brackets, dtype=np.uint8)], dtype=np.int64).max())


def check_depth(raw: bytes, max_depth: int) -> None:
    # Cheap shortcut for the usual small message: fewer openers than the limit cannot nest deeper.
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return
    depth = json_depth(raw)
    if depth > max_depth:
        raise SchemaError(None, f"JSON nesting is {depth} levels deep; the limit is {max_depth}", JSON_TOO_DEEP)


def decode_json_object(raw: bytes | str, max_depth: int) -> dict[str, Any]:
    """A JSON text -> a dict, refusing (SchemaError) deep nesting, bad JSON, non-objects, lone
    surrogates and NaN / Infinity (the error names the field holding them)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    check_depth(data, max_depth)
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        raise _diagnose(data, e) from None
    if not isinstance(obj, dict):
        raise SchemaError(None, "the message must be a JSON object", INVALID_JSON)
    return obj


def _diagnose(data: bytes, e: msgspec.DecodeError) -> SchemaError:
    """msgspec refuses lone surrogates and NaN as malformed JSON without saying where; Python's
    lenient parser reads them, so it can point at the field (depth is already bounded)."""
    bad: list[tuple[str, str]] = []

    def constant(name: str) -> float:
        bad.append(("", name))
        return math.nan

    try:
        obj = json.loads(data, parse_constant=constant)
    except (ValueError, UnicodeDecodeError):
        return SchemaError(None, f"the message is not valid JSON: {e}", INVALID_JSON)
    found = _find_bad_leaf(obj, "")
    if found is None:
        return SchemaError(None, f"the message is not valid JSON: {e}", INVALID_JSON)
    path, why = found
    code = INVALID_UNICODE if "surrogate" in why else INVALID_VALUE
    return SchemaError(path or None, why, code)


def _find_bad_leaf(obj: Any, path: str) -> tuple[str, str] | None:
    if isinstance(obj, str):
        if _has_surrogate(obj):
            return path, "not valid Unicode (a lone UTF-16 surrogate such as \\ud800)"
        return None
    if isinstance(obj, float) and not math.isfinite(obj):
        return path, f"must be a finite number, got {obj} (not valid JSON)"
    if isinstance(obj, dict):
        for k, v in obj.items():
            if _has_surrogate(k):
                return path or k.encode("utf-8", "replace").decode(), "a key is not valid Unicode (lone surrogate)"
            found = _find_bad_leaf(v, f"{path}.{k}" if path else k)
            if found is not None:
                return found
    if isinstance(obj, list):
        for v in obj:  # errors inside arrays name the array
            found = _find_bad_leaf(v, path)
            if found is not None:
                return found
    return None


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def convert(obj: Any, type_: type[T], prefix: str = "") -> T:
    """A decoded JSON / msgpack object -> `type_`, strictly typed; ValidationError becomes a
    SchemaError naming the field. `prefix` is prepended to the names (a nested object)."""
    try:
        return msgspec.convert(obj, type_, strict=True, str_keys=True)
    except msgspec.ValidationError as e:
        raise schema_error(e, type_, prefix) from None


def decode(raw: bytes | str, type_: type[T], max_depth: int) -> T:
    """JSON text -> `type_` (one call for an HTTP body or a WebSocket message)."""
    return convert(decode_json_object(raw, max_depth), type_)


_AT = re.compile(r" - at (?:`key` in )?`\$([^`]*)`$")
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
               "object": "an object", "array": "an array", "null": "null"}


def _path_name(path: str) -> str:
    """msgspec's `$.sampling.stop_token_ids[2]` -> `sampling.stop_token_ids` (errors inside an
    array or a map name the array or map)."""
    path = path.lstrip(".")
    return path.split("[", 1)[0].split("`", 1)[0]


def _type_words(spec: str) -> str:
    words = [_TYPE_WORDS.get(t.strip(), t.strip()) for t in spec.split("|") if t.strip() != "null"]
    return " or ".join(words) or "null"


def schema_error(e: msgspec.ValidationError, type_: Any = None, prefix: str = "") -> SchemaError:
    """msgspec's validation message -> a SchemaError in the client's terms. Also for a ZeroMQ
    frame decoded straight into a Struct (msgspec.msgpack.Decoder(type))."""
    msg = str(e)
    at = _AT.search(msg)
    path = _path_name(at.group(1)) if at else ""
    head = msg[: at.start()] if at else msg

    def name(leaf: str = "") -> str | None:
        parts = [p for p in (prefix.rstrip("."), path, leaf) if p]
        return ".".join(parts) or None

    if m := re.match(r"Object contains unknown field `(.*)`$", head):
        param = name(m.group(1))
        accepted = ""
        if not path and isinstance(type_, type) and issubclass(type_, msgspec.Struct):
            accepted = "; accepted: " + ", ".join(_wire_fields(type_))
        return SchemaError(param, f"unknown field{accepted}", UNKNOWN)
    if m := re.match(r"Object missing required field `(.*)`$", head):
        return SchemaError(name(m.group(1)), "this field is required", MISSING)
    if m := re.match(r"Expected `([^`]*)`, got `([^`]*)`$", head):
        got = _TYPE_WORDS.get(m.group(2), m.group(2))
        return SchemaError(name(), f"must be {_type_words(m.group(1))}, got {got}", INVALID_TYPE)
    if head.startswith("Invalid value"):
        return SchemaError(name(), head[0].lower() + head[1:], INVALID_VALUE)
    if head.startswith(("Number out of range", "Integer value out of range")):
        return SchemaError(name(), "number out of range", INVALID_VALUE)
    return SchemaError(name(), head, INVALID_VALUE)


def _wire_fields(type_: type[msgspec.Struct]) -> list[str]:
    names = list(type_.__struct_encode_fields__)
    tag_field = type_.__struct_config__.tag_field
    return ([tag_field] if tag_field else []) + names
