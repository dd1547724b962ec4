"""Tuning tables of the Triton kernels: data files keyed by device, looked up once per backend.

One JSON file per device in this folder (`nvidia_h200.json` ...), written by the tuning
benchmarks (deploy/bench/gemm.py --write-table) and never pasted by hand. A file holds, each
section optional and with one line of provenance:

    name              the key (the file's stem)
    gpu_names         torch.cuda.get_device_name() values it was measured on
    fallback_for_capability  [major, minor]: also used by a GPU of that compute capability
                      that has no file of its own
    linear            {"untuned_shapes": "default_tile" | "cublas", "tiles": {"plain NxK": ROWS}}
                      ROWS = [[max_m, TILE or null], ...] in increasing max_m (null: cuBLAS)
    split             {"tiles": {"NxK": [[max_m, TILE or null, splits], ...]}}
    fold, head        {"tiles": {"NxK": ROWS}}
    attention         AttentionTuning's fields
    snac              {"float32": SNAC_TILES, "bfloat16": SNAC_TILES}
    sampling          SamplingTuning's fields
    depth             {"one_row": ["HxI", ...]}: DepthTuning, the depth decoders that run a
                      one-row sub-step as one persistent kernel

TILE is a LinearTile's fields by name, those at their default left out (groups -1 is written
"per_sm"). A missing section means the generic choice for that op.

Lookup: `load_tables(device, tuning)` once, at backend construction. "auto" takes the file
whose gpu_names holds the device's name, else the file that is the fallback for its compute
capability, else GENERIC; "none" (and any non-CUDA device) takes GENERIC: cuBLAS for every
GEMM (no skinny / split / fold / fused-head tiles) and the always-valid default tiles of
attention, SNAC and sampling.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from types import MappingProxyType

import torch

from runner.kernels.tuning.tiles import (
    GATED,
    KIND_NAMES,
    PER_SM,
    PLAIN,
    SAFE_SNAC_TILES,
    AttentionTuning,
    DepthTuning,
    LinearTile,
    SamplingTuning,
    SnacTiles,
    default_tile,
)

TABLES_DIR = Path(__file__).resolve().parent
TUNING_MODES = ("auto", "none")

Rows = tuple[tuple[int, LinearTile | None], ...]
SplitRows = tuple[tuple[int, LinearTile | None, int], ...]


# ---------------------------------------------------------------- lookups (pure functions)
# Every choice depends on M only through thresholds at graph bucket sizes (1, 16, 32, 64, ...;
# runner/engine/cuda_graphs.py), so an eager step of M rows and the graph replay of M padded to
# its bucket take the same kernel.


def row_tile(rows: Rows, m: int) -> LinearTile | None:
    """The tile of the first row with m <= max_m, or None (past the last row)."""
    for max_m, tile in rows:
        if m <= max_m:
            return tile
    return None


def linear_tile(tuned: Mapping[tuple[int, int, int], Rows], default_tiles: bool, kind: int, n: int, k: int,
                m: int) -> LinearTile | None:
    """The skinny GEMM's tile for `kind` on a weight [n, k] at m rows, or None: cuBLAS (and, for
    GATED, the separate SiLU*mul kernel). A shape the table names takes its rows (a kind it does
    not name: cuBLAS, measured not to pay); another shape `default_tile` where `default_tiles`."""
    rows = tuned.get((kind, n, k))
    if rows is None:
        if not default_tiles or (PLAIN, n, k) in tuned:
            return None
        return default_tile(kind, n, k, m)
    return row_tile(rows, m)


def split_tile(split: Mapping[tuple[int, int], SplitRows], n: int, k: int, m: int) -> tuple[LinearTile, int] | None:
    """(tile, splits) for a plain GEMM [n, k] of 1 < m rows whose consumer sums partials, or None."""
    if m <= 1:
        return None
    for max_m, tile, splits in split.get((n, k), ()):
        if m <= max_m:
            return None if tile is None else (tile, splits)
    return None


@dataclass(frozen=True)
class LinearTables:
    """The decode GEMM tables: `tuned` (kind, N, K) -> rows; `split` (N, K) -> split-K rows for
    o_proj / down feeding the add + RMSNorm; `fold` (N, K) -> residual_linear rows for o_proj
    with the norm finished in gate_up; `head` (V, K) -> head_argmax rows. `default_tiles`:
    shapes absent from `tuned` take `default_tile` (else cuBLAS)."""

    tuned: Mapping[tuple[int, int, int], Rows] = field(default_factory=dict)
    split: Mapping[tuple[int, int], SplitRows] = field(default_factory=dict)
    fold: Mapping[tuple[int, int], Rows] = field(default_factory=dict)
    head: Mapping[tuple[int, int], Rows] = field(default_factory=dict)
    default_tiles: bool = False

    def tile(self, kind: int, n: int, k: int, m: int) -> LinearTile | None:
        return linear_tile(self.tuned, self.default_tiles, kind, n, k, m)

    def split_tile(self, n: int, k: int, m: int) -> tuple[LinearTile, int] | None:
        return split_tile(self.split, n, k, m)

    def fold_tile(self, n: int, k: int, m: int) -> LinearTile | None:
        return row_tile(self.fold.get((n, k), ()), m)

    def head_tile(self, v: int, k: int, m: int) -> LinearTile | None:
        return row_tile(self.head.get((v, k), ()), m)

    def tunes_head(self, v: int, k: int) -> bool:
        """Whether the table names this lm_head shape (a vocabulary-sized GEMM runs in Triton
        only where it was measured; default_tile is for the decoder's GEMMs)."""
        return (PLAIN, v, k) in self.tuned

    def with_entries(self, tuned: Mapping = MappingProxyType({}), split: Mapping = MappingProxyType({}),
                     fold: Mapping = MappingProxyType({}), head: Mapping = MappingProxyType({})) -> LinearTables:
        """These tables with the given entries added or replaced, the rest kept (tests and
        benchmark variants build a backend on them; the tables themselves are never edited)."""
        return replace(self, tuned=MappingProxyType({**self.tuned, **tuned}),
                       split=MappingProxyType({**self.split, **split}), fold=MappingProxyType({**self.fold, **fold}),
                       head=MappingProxyType({**self.head, **head}))


@dataclass(frozen=True)
class SnacTuning:
    """SNAC decoder tiles per model dtype (float32 / bfloat16)."""

    float32: SnacTiles = SAFE_SNAC_TILES
    bfloat16: SnacTiles = SAFE_SNAC_TILES

    def tiles(self, dtype: torch.dtype) -> SnacTiles:
        return self.bfloat16 if dtype == torch.bfloat16 else self.float32


@dataclass(frozen=True)
class Tables:
    """Every kernel's tuning for one device. `name`: the table's key ("generic" for none)."""

    name: str = "generic"
    linear: LinearTables = field(default_factory=LinearTables)
    attention: AttentionTuning = field(default_factory=AttentionTuning)
    snac: SnacTuning = field(default_factory=SnacTuning)
    sampling: SamplingTuning = field(default_factory=SamplingTuning)
    depth: DepthTuning = field(default_factory=DepthTuning)
    gpu_names: tuple[str, ...] = ()
    fallback_for_capability: tuple[int, int] | None = None
    provenance: Mapping[str, str] = field(default_factory=dict)  # section -> one line

    @property
    def tuned(self) -> bool:
        return self.name != GENERIC.name


GENERIC = Tables()


# ---------------------------------------------------------------- device -> table


def _norm(name: str) -> str:
    return " ".join(name.lower().split())


def table_names() -> list[str]:
    """The keys of the tables shipped in this folder."""
    return sorted(p.stem for p in TABLES_DIR.glob("*.json"))


@cache
def read_table(name: str) -> Tables:
    """The shipped table `name` (a file stem, e.g. "nvidia_h200"); read once per process (Tables
    are immutable, so every backend may share one)."""
    path = TABLES_DIR / f"{name}.json"
    if not path.is_file():
        raise KeyError(f"no tuning table {name!r} in {TABLES_DIR} (have {table_names()})")
    return tables_from_json(json.loads(path.read_text()))


def lookup(gpu_name: str, capability: tuple[int, int]) -> Tables:
    """The table for a GPU: by name, else the fallback for its compute capability, else GENERIC."""
    tables = [read_table(n) for n in table_names()]
    for t in tables:
        if _norm(gpu_name) in {_norm(g) for g in t.gpu_names}:
            return t
    for t in tables:
        if t.fallback_for_capability == tuple(capability):
            return t
    return GENERIC


def load_tables(device: torch.device | str, tuning: str = "auto") -> Tables:
    """The tables a backend on `device` uses, chosen once at its construction. tuning "auto": the
    device's table if there is one; "none": GENERIC (cuBLAS / default tiles everywhere)."""
    if tuning not in TUNING_MODES:
        raise ValueError(f"tuning: {tuning!r} is not one of {TUNING_MODES}")
    device = torch.device(device)
    if tuning == "none" or device.type != "cuda":
        return GENERIC
    return lookup(torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device)))


# ---------------------------------------------------------------- JSON form

_TILE_DEFAULTS = {f.name: f.default for f in fields(LinearTile) if f.name not in ("block_m", "block_n", "block_k")}
_KINDS = {v: k for k, v in KIND_NAMES.items()}


def tile_to_json(t: LinearTile | None) -> dict | None:
    if t is None:
        return None
    d = {k: v for k, v in asdict(t).items() if _TILE_DEFAULTS.get(k, object()) != v}
    if d.get("groups") == PER_SM:
        d["groups"] = "per_sm"
    return d


def tile_from_json(d: dict | None) -> LinearTile | None:
    if d is None:
        return None
    d = dict(d)
    if d.get("groups") == "per_sm":
        d["groups"] = PER_SM
    return LinearTile(**d)


def _nk(key: str) -> tuple[int, int]:
    n, k = key.split("x")
    return int(n), int(k)


def _snac_to_json(t: SnacTiles) -> dict:
    d = {f.name: getattr(t, f.name) for f in fields(SnacTiles) if f.name != "per_block"}
    if t.per_block:
        d["per_block"] = [[i, _snac_to_json(b)] for i, b in t.per_block]
    return d


def _snac_from_json(d: dict) -> SnacTiles:
    d = dict(d)
    per_block = tuple((int(i), _snac_from_json(b)) for i, b in d.pop("per_block", ()))
    return SnacTiles(**d, per_block=per_block)


SECTIONS = ("linear", "split", "fold", "head", "attention", "snac", "sampling", "depth")


def tables_from_json(raw: dict) -> Tables:
    """A table file's contents -> Tables (sections left out: the generic choice)."""
    prov = {s: raw[s]["provenance"] for s in SECTIONS if s in raw and "provenance" in raw[s]}

    def rows(section: str) -> dict:
        return {_nk(key): tuple((int(m), tile_from_json(t)) for m, t in rr)
                for key, rr in raw.get(section, {}).get("tiles", {}).items()}

    lin = raw.get("linear", {})
    tuned = {}
    for key, rr in lin.get("tiles", {}).items():
        kind, nk = key.split()
        tuned[(_KINDS[kind], *_nk(nk))] = tuple((int(m), tile_from_json(t)) for m, t in rr)
    untuned = lin.get("untuned_shapes", "cublas")
    if untuned not in ("cublas", "default_tile"):
        raise ValueError(f"linear.untuned_shapes: {untuned!r} is not 'cublas' or 'default_tile'")
    split = {_nk(key): tuple((int(m), tile_from_json(t), int(s)) for m, t, s in rr)
             for key, rr in raw.get("split", {}).get("tiles", {}).items()}
    linear = LinearTables(MappingProxyType(tuned), MappingProxyType(split), MappingProxyType(rows("fold")),
                          MappingProxyType(rows("head")), untuned == "default_tile")

    def params(section: str) -> dict:
        return {k: v for k, v in raw.get(section, {}).items() if k != "provenance"}

    snac = params("snac")
    cap = raw.get("fallback_for_capability")
    return Tables(
        name=raw["name"],
        linear=linear,
        attention=AttentionTuning(**params("attention")),
        snac=SnacTuning(**{k: _snac_from_json(v) for k, v in snac.items()}),
        sampling=SamplingTuning(**params("sampling")),
        depth=DepthTuning(one_row=tuple(params("depth").get("one_row", ()))),
        gpu_names=tuple(raw.get("gpu_names", ())),
        fallback_for_capability=tuple(cap) if cap else None,
        provenance=MappingProxyType(prov),
    )


def linear_to_json(linear: LinearTables) -> dict[str, dict]:
    """The linear / split / fold / head sections of a table file (provenance not included)."""

    def rows(table: Mapping) -> dict:
        return {f"{n}x{k}": [[m, tile_to_json(t)] for m, t in rr] for (n, k), rr in table.items()}

    return {
        "linear": {"untuned_shapes": "default_tile" if linear.default_tiles else "cublas",
                   "tiles": {f"{KIND_NAMES[kind]} {n}x{k}": [[m, tile_to_json(t)] for m, t in rr]
                             for (kind, n, k), rr in linear.tuned.items()}},
        "split": {"tiles": {f"{n}x{k}": [[m, tile_to_json(t), s] for m, t, s in rr]
                            for (n, k), rr in linear.split.items()}},
        "fold": {"tiles": rows(linear.fold)},
        "head": {"tiles": rows(linear.head)},
    }


def tables_to_json(t: Tables) -> dict:
    """Tables -> a table file's contents (tables_from_json's inverse)."""
    out: dict = {"name": t.name, "gpu_names": list(t.gpu_names)}
    if t.fallback_for_capability:
        out["fallback_for_capability"] = list(t.fallback_for_capability)
    out |= linear_to_json(t.linear)
    out["attention"] = asdict(t.attention)
    out["snac"] = {"float32": _snac_to_json(t.snac.float32), "bfloat16": _snac_to_json(t.snac.bfloat16)}
    out["sampling"] = asdict(t.sampling)
    if t.depth.one_row or "depth" in t.provenance:
        out["depth"] = {"one_row": list(t.depth.one_row)}
    for section, line in t.provenance.items():
        out[section] = {"provenance": line, **out[section]}
    return out


def with_linear_rows(raw: dict, tuned: Mapping[tuple[int, int, int], Rows], provenance: str) -> dict:
    """A table file's contents with `tuned` ((kind, N, K) -> rows, a tile sweep's winners) put into
    its linear section: those entries replaced, the others and every other section kept; the
    section's provenance line becomes `provenance`."""
    old = raw.get("linear", {})
    rows = linear_to_json(LinearTables(tuned))["linear"]["tiles"]
    linear = {"provenance": provenance, "untuned_shapes": old.get("untuned_shapes", "default_tile"),
              "tiles": {**old.get("tiles", {}), **rows}}
    return {**raw, "linear": linear}


def with_split_rows(raw: dict, split: Mapping[tuple[int, int], SplitRows], provenance: str) -> dict:
    """`with_linear_rows` for the split section: the swept (N, K) entries replaced, the rest kept."""
    rows = linear_to_json(LinearTables(split=split))["split"]["tiles"]
    return {**raw, "split": {"provenance": provenance, "tiles": {**raw.get("split", {}).get("tiles", {}), **rows}}}


def dumps_table(raw: dict) -> str:
    """A table file's text: one tile row per line, so a diff shows which rows changed."""

    def enc(v, indent: int) -> str:
        pad = " " * indent
        flat = json.dumps(v, separators=(", ", ": "))
        if isinstance(v, dict) and v and (len(flat) > 100 or any(isinstance(x, (dict, list)) for x in v.values())):
            items = [f"{pad} {json.dumps(k)}: {enc(x, indent + 1)}" for k, x in v.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
            items = [f"{pad} {json.dumps(x, separators=(', ', ': '))}" for x in v]
            return "[\n" + ",\n".join(items) + "\n" + pad + "]"
        return flat

    return enc(raw, 0) + "\n"


def write_table(path: str | Path, raw: dict) -> None:
    Path(path).write_text(dumps_table(raw))


__all__ = [
    "GATED",
    "GENERIC",
    "PER_SM",
    "PLAIN",
    "TUNING_MODES",
    "AttentionTuning",
    "LinearTables",
    "LinearTile",
    "SamplingTuning",
    "SnacTiles",
    "SnacTuning",
    "Tables",
    "default_tile",
    "dumps_table",
    "linear_to_json",
    "load_tables",
    "lookup",
    "read_table",
    "table_names",
    "tables_from_json",
    "tables_to_json",
    "with_linear_rows",
    "write_table",
]
