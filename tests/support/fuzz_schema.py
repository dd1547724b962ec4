"""Hypothesis strategies built from streaming.schema's Structs, and the encoders that put what
they draw on the wire (JSON text, msgpack frames), hostile parts included.

A field's value is drawn from its declared type (msgspec.inspect): mostly valid-ish values
(small numbers, short text, the right shapes) mixed with hostile ones: wrong types, numbers
out of range, NaN and infinities, huge integers, text with lone surrogates and control
characters, very long text, and markers for deep nesting that the encoders expand into raw
brackets (so no Python recursion builds them). Objects may carry unknown keys.

Valid-ish integers stay small on purpose: a drawn request that is valid really runs on the
engine, and the fuzz module must stay fast on a 2-core CI machine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st


@dataclass(frozen=True)
class Deep:
    """`levels` nested arrays, expanded by the encoders (json: [[[...]]]; msgpack: fixarrays)."""

    levels: int


HUGE_INTS = [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]
NON_FINITE = [math.nan, math.inf, -math.inf]
NASTY_TEXT = [
    "", " ", "\ud800", "hi \ud800 x", "a\udfffb", "\x00", "x\x1b[31my", "\x7f", "\u0085", "\u202eevil",
    "\ufeffbom", "\U0001f600" * 5, "e\u0301" * 20, "\n\t\r", "x" * 5000, "Hello there.",
]

# Small JSON-ish values of any type (for wrong types and unknown keys).
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 50), st.floats(allow_nan=False, width=32),
    st.text(max_size=8), st.sampled_from(HUGE_INTS),
)
json_any = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)

hostile_text = st.one_of(
    st.sampled_from(NASTY_TEXT),
    st.text(max_size=30),  # any Unicode hypothesis draws (no surrogates)
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x9F), max_size=12),  # controls
    st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=3),  # lone surrogates
)
deep = st.builds(Deep, st.sampled_from([33, 64, 1000, 20000]))


def _valid(t: mi.Type) -> st.SearchStrategy:
    """Values of the declared type, kept small (a valid request really runs)."""
    if isinstance(t, mi.UnionType):
        return st.one_of([_valid(x) for x in t.types])
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.IntType):
        return st.one_of(st.integers(0, 24), st.sampled_from([-1, 0, 1, 2, 4096, 4097]))
    if isinstance(t, mi.FloatType):
        return st.one_of(st.floats(0.0, 2.0), st.sampled_from([0.0, 0.25, 1.0, 4.0, -0.5, 1e-9, 101.0]))
    if isinstance(t, mi.StrType):
        return st.one_of(st.sampled_from(["tara", "pcm", "wav", "sse", "audio", "Hello.", "hi"]), st.text(max_size=12))
    if isinstance(t, mi.ListType):
        return st.lists(_valid(t.item_type), max_size=4)
    if isinstance(t, mi.DictType):
        return st.dictionaries(_valid(t.key_type), _valid(t.value_type), max_size=3)
    if isinstance(t, mi.StructType):
        return struct_object(t.cls)
    return json_any  # AnyType and the rest


def _hostile(t: mi.Type) -> st.SearchStrategy:
    return st.one_of(json_any, st.sampled_from(HUGE_INTS), st.sampled_from(NON_FINITE), hostile_text, deep)


def field_value(t: mi.Type) -> st.SearchStrategy:
    # Weighted towards valid-ish values: most of a request must pass for the rest to be judged.
    return st.one_of(_valid(t), _valid(t), _valid(t), _hostile(t))


def struct_object(cls: type[msgspec.Struct], *, tag: bool = True, extra_keys: bool = True,
                  overrides: dict[str, st.SearchStrategy] | None = None) -> st.SearchStrategy[dict]:
    """A dict with any subset of `cls`'s fields (tag field set to its tag when `tag`), each
    drawn by field_value (or `overrides[name]`), sometimes with unknown keys."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    fields = {f.encode_name: field_value(f.type) for f in info.fields}
    fields.update(overrides or {})
    base = st.fixed_dictionaries({}, optional=fields)
    if tag and info.tag_field is not None:
        base = base.map(lambda d, k=info.tag_field, v=info.tag: {k: v, **d})
    if not extra_keys:
        return base
    unknown = st.dictionaries(st.one_of(st.text(max_size=10), st.sampled_from(["\ud800", "type", "x" * 300])),
                              json_any, max_size=2)
    return st.one_of(base, base, base, st.tuples(base, unknown).map(lambda p: {**p[1], **p[0]}))


# ---- JSON text ---------------------------------------------------------------------------------


def _deep_json(n: int) -> str:
    return "[" * n + "]" * n


def to_json(obj: Any, ascii_only: bool = True) -> str:
    """JSON text of a drawn object: NaN/Infinity written as Python does (not JSON), lone
    surrogates as \\udXXX escapes (ascii_only; otherwise the raw surrogate would be unsendable,
    so such text falls back to escapes), Deep markers expanded."""
    deeps: dict[str, int] = {}

    def hook(o: Any) -> Any:
        if isinstance(o, Deep):
            key = f"@@deep{len(deeps)}@@"
            deeps[key] = o.levels
            return key
        raise TypeError(type(o))

    text = json.dumps(obj, ensure_ascii=ascii_only, default=hook)
    if not ascii_only:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return to_json(obj, True)
    for key, n in deeps.items():
        text = text.replace(f'"{key}"', _deep_json(n))
    return text


def json_body(obj_strategy: st.SearchStrategy[dict]) -> st.SearchStrategy[bytes]:
    """A request body: the drawn object as JSON, sometimes truncated, sometimes garbage bytes,
    sometimes a JSON value that is not an object."""
    encoded = st.tuples(obj_strategy, st.booleans()).map(lambda p: to_json(p[0], p[1]).encode("utf-8"))
    return st.one_of(
        encoded, encoded, encoded, encoded,
        st.tuples(encoded, st.integers(0, 40)).map(lambda p: p[0][: p[1]]),  # cut short
        st.binary(max_size=64),
        st.sampled_from([b"", b"null", b"[]", b"42", b'"x"', b"{", b"\xff\xfe", b"{}" * 3,
                         _deep_json(100_000).encode(), b'{"a":' * 30_000]),
        json_any.map(lambda v: to_json(v).encode()),
    )


# ---- msgpack ---------------------------------------------------------------------------------------


def _msgpack_str(raw: bytes) -> msgspec.Raw:
    n = len(raw)
    head = bytes([0xA0 | n]) if n < 32 else (b"\xd9" + bytes([n]) if n < 256 else b"\xda" + n.to_bytes(2, "big"))
    return msgspec.Raw(head + raw)


def _for_msgpack(obj: Any) -> Any:
    """Make a drawn object msgpack-encodable, keeping it hostile: lone surrogates become
    invalid-UTF-8 str payloads, integers past msgpack's range floats, Deep raw fixarrays."""
    if isinstance(obj, Deep):
        return msgspec.Raw(b"\x91" * obj.levels + b"\xc0")
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
            return obj
        except UnicodeEncodeError:
            return _msgpack_str(obj.encode("utf-8", "surrogatepass"))
    if isinstance(obj, bool) or obj is None or isinstance(obj, float):
        return obj
    if isinstance(obj, int):
        return obj if -(2**63) <= obj < 2**64 else float(obj)
    if isinstance(obj, list):
        return [_for_msgpack(v) for v in obj]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            key = k.encode("utf-8", "replace").decode() if isinstance(k, str) else _for_msgpack(k)
            out[key] = _for_msgpack(v)
        return out
    return obj


def to_msgpack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(_for_msgpack(obj))


# ---- one mistake at a time (every mistake must be named) ------------------------------------------

# Candidate values of every JSON type; a field's mistakes are the ones its type refuses.
WRONG_TYPED = [7, 2.5, "x", True, [1], {"k": 1}, None, 2**70]


def _refuses(t: mi.Type, value: Any) -> bool:
    """Whether a field of type `t` refuses `value` on type alone (strict, as the server decodes)."""
    if isinstance(t, mi.UnionType):
        return all(_refuses(x, value) for x in t.types)
    if isinstance(t, mi.NoneType):
        return value is not None
    if isinstance(t, mi.BoolType):
        return not isinstance(value, bool)
    if isinstance(t, mi.IntType):
        # a huge int is an int to the type (msgspec.convert of parsed JSON does not bound it);
        # each int field's own range check names it, where the field is used at all
        return isinstance(value, bool) or not isinstance(value, int)
    if isinstance(t, mi.FloatType):
        return isinstance(value, bool) or not isinstance(value, (int, float))
    if isinstance(t, mi.StrType):
        return not isinstance(value, str)
    if isinstance(t, mi.ListType):
        return not isinstance(value, list) or any(_refuses(t.item_type, v) for v in value)
    if isinstance(t, (mi.DictType, mi.StructType)):
        return not isinstance(value, dict)  # a struct's own keys get their mistakes one level down
    return False  # Any


def field_mistakes(cls: type[msgspec.Struct], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted wire path, value) for every field of `cls` (nested Structs included) and every
    WRONG_TYPED value its type refuses, plus an unknown key at each level. The server must
    answer each with an error naming exactly that path."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    out: list[tuple[str, Any]] = [(prefix + "no_such_field", 1)]
    for f in info.fields:
        if f.encode_name == info.tag_field:
            continue
        path = prefix + f.encode_name
        out += [(path, v) for v in WRONG_TYPED if _refuses(f.type, v)]
        members = f.type.types if isinstance(f.type, mi.UnionType) else (f.type,)
        for m in members:
            if isinstance(m, mi.StructType):
                out += field_mistakes(m.cls, path + ".")
    return out


def with_path(base: dict, path: str, value: Any) -> dict:
    """`base` with `value` at the dotted `path` (intermediate objects created)."""
    out = json.loads(json.dumps(base))
    node = out
    *parents, last = path.split(".")
    for p in parents:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[last] = value
    return out
