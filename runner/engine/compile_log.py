"""Log Triton JIT compilations that happen after start-up.

A compile stalls the engine loop for ~0.5-2 s (every stream waits), so one during serving is a
defect to fix (a missing warm-up, an argument that should not be specialised); the log line
names the kernel and its signature.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import threading
import time
from collections.abc import Iterator


def describe(kw: dict) -> str:
    """'module.kernel: name=spec, ...' from the arguments Triton passes its compile hooks: each
    argument by name with what the variant specialised (`:16` divisible by 16, `=1` a value
    of 1, `=v` a constexpr's value), then the launch options: what tells a second variant of
    a kernel from the first. A key that does not parse as Triton's specialisation list is
    shown as it is."""
    fn = kw.get("fn")
    head = f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}"
    key = str(kw.get("key", ""))
    names = getattr(getattr(fn, "jit_function", None), "arg_names", None)
    spec, options = _split_key(key)
    if names is None or spec is None or len(spec) != len(names):
        return f"{head}: {key}"
    return f"{head}: " + ", ".join(_arg(n, s) for n, s in zip(names, spec)) + f" {options}"


def _split_key(key: str) -> tuple[list | None, str]:
    """Triton's cache key "[(type, spec), ...]{options}" -> (the list, the options text)."""
    end = key.rfind("]") + 1
    try:
        spec = ast.literal_eval(key[:end])
    except (ValueError, SyntaxError):
        return None, key
    return (spec, key[end:]) if isinstance(spec, list) else (None, key)


def _arg(name: str, spec) -> str:
    if not (isinstance(spec, tuple) and len(spec) == 2):
        return f"{name}?{spec}"
    ty, s = spec
    if ty == "constexpr":
        return f"{name}={s}"
    return f"{name}:{ty}" + {"D": ":16", None: "", "": ""}.get(s, f":{s}")


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Collect `describe` of every Triton compile while the block runs (tests and benchmarks
    that must see none after warm-up); the hook installed before, if any, still runs."""
    from triton import knobs

    old = knobs.runtime.jit_post_compile_hook
    compiled: list[str] = []

    def after(**kw) -> bool:
        compiled.append(describe(kw))
        return bool(old(**kw)) if old is not None else False

    knobs.runtime.jit_post_compile_hook = after
    try:
        yield compiled
    finally:
        knobs.runtime.jit_post_compile_hook = old


def install(log: logging.Logger) -> bool:
    """Hook Triton's JIT (no-op without triton). Returns whether the hook is installed."""
    try:
        from triton import knobs
    except ImportError:
        return False
    started: dict[int, float] = {}

    def before(**kw) -> bool:
        started[threading.get_ident()] = time.perf_counter()
        return False  # False: compile as usual

    def after(**kw) -> bool:
        t0 = started.pop(threading.get_ident(), None)
        dt = time.perf_counter() - t0 if t0 is not None else float("nan")
        log.warning("compiled Triton kernel in %.2f s after start-up: %s", dt, describe(kw))
        return False

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after
    return True
