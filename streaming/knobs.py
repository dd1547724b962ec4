"""Config fields that carry their command-line help, so a CLI derives from the config
dataclasses and every default is stated once (in the dataclass)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any


def knob(default: Any, help: str, *, flag: str | None = None) -> Any:
    """A dataclass field with its one default and its help; `flag` overrides the derived option
    name (--no-<name> for a True bool, --<name> otherwise)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag})


def _scalar(tp: Any) -> type:
    """int | None -> int; the type argparse converts a string with."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                  skip: tuple[str, ...] = ()) -> None:
    """One option per field of the dataclass cls that has help (knob()); dest = the field name,
    default = the dataclass default."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        tp = _scalar(hints[f.name])
        name = f.metadata.get("flag")
        if tp is bool:
            flag = name or (f"--no-{f.name}" if f.default else f"--{f.name}").replace("_", "-")
            action = "store_false" if f.default else "store_true"
            note = " (on by default; this turns it off)" if f.default else ""
            parser.add_argument(flag, dest=f.name, action=action, default=f.default, help=f.metadata["help"] + note)
        else:
            flag = name or f"--{f.name}".replace("_", "-")
            note = f" (default: {f.default})" if f.default is not None else ""
            parser.add_argument(flag, dest=f.name, type=tp, default=f.default, help=f.metadata["help"] + note)


def from_arguments(cls: type, ns: argparse.Namespace, **extra: Any) -> Any:
    """The dataclass cls from the parsed options add_arguments added (plus extra fields)."""
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in vars(ns).items() if k in names}
    return cls(**kw, **extra)
