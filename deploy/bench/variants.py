"""Greedy decode per kernel variant, each on a freshly built model in the same run (the engine
section `variants`): kernel switches, tile-table rows, attention constants, and `skip=OP`
variants that time the step without one per-layer op (its critical-path cost). A variant's tables
are built for its model (the registry's `tables=`), never patched into module state."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from deploy.bench.common import (
    KERNELS,
    NEW,
    ORPHEUS_3B,
    build_orpheus_model,
    log,
    parse_tile,
)
from deploy.bench.steps import run_engine


def parse_tile_override(item: str) -> tuple[tuple[int, int, int], int, object]:
    """'tile:KIND:N:K:MAX_M=bm/bn/bk/warps/stages[/late[/groups[/tma]]]' (or '=none': cuBLAS) -> the (kind, N, K) key,
    the row's max_m and its tile; KIND is plain or gated."""
    from runner.kernels.tuning.tiles import GATED, PLAIN

    lhs, rhs = item.removeprefix("tile:").split("=")
    kind, n, k, max_m = lhs.split(":")
    tile = None if rhs == "none" else parse_tile([int(f) for f in rhs.split("/")])
    return ({"plain": PLAIN, "gated": GATED}[kind], int(n), int(k)), int(max_m), tile


SKIPPABLE = ("norm", "norm_in", "norm_post", "attn", "qkv", "o", "gate_up", "down")


def skip_op(model, name: str) -> None:
    """Timing-only: make one per-layer op of `model` launch nothing (a same-shaped empty tensor
    instead of its result), so that step time minus this variant's step time is what that op
    costs on the step's critical path, PDL overlap included. Tokens become meaningless; shapes,
    the graphs and every other kernel stay as they are. `name` is one of SKIPPABLE."""
    ops, attn, cfg = model.ops, model.attn, model.cfg
    if name in ("norm", "norm_post", "o", "gate_up"):
        # the folded o_proj + norm + gate_up launches none of the ops patched below: time the
        # unfolded path (a `norm_fold=1` step has no post-attention norm launch to skip; the
        # bench's model always has TritonOps)
        ops.norm_fold = False
    if name in ("attn", "qkv"):
        # likewise the qkv GEMM with RoPE and the KV write (ops.qkv_rope_write): time the
        # separate qkv GEMM and attention launches it replaces
        ops.qkv_rope = False
    weight_shapes = {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size),
                     "o": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
                     "down": (cfg.hidden_size, cfg.intermediate_size)}  # nn.Linear [N, K]
    if name == "norm":
        def add_rmsnorm(x, residual, weight, eps):
            return residual, residual
        ops.add_rmsnorm = add_rmsnorm
    elif name in ("norm_in", "norm_post"):  # one of the layer's two norms (the final norm stays)
        which = "input_layernorm" if name == "norm_in" else "post_attention_layernorm"
        skipped = {getattr(layer, which).weight.data_ptr() for layer in model.layers}
        add_rmsnorm_all = ops.add_rmsnorm

        def add_rmsnorm(x, residual, weight, eps):
            if weight.data_ptr() in skipped:
                return residual, residual
            return add_rmsnorm_all(x, residual, weight, eps)
        ops.add_rmsnorm = add_rmsnorm
    elif name == "attn":
        def no_attention(q, *a, **k):
            return torch.empty(q.shape, dtype=q.dtype, device=q.device)
        attn.forward_decode_rope = attn.forward_prewritten_kv = no_attention
    elif name in ("qkv", "o", "down"):
        linear = ops.linear

        def skipped_linear(x, lin, into_norm=False, _shape=weight_shapes[name]):
            if tuple(lin.weight.shape) == _shape:
                return torch.empty(x.shape[0], _shape[0], dtype=x.dtype, device=x.device)
            return linear(x, lin, into_norm)
        ops.linear = skipped_linear
    elif name == "gate_up":
        def mlp(x, gate_up, down, into_norm=False):
            act = torch.empty(x.shape[0], cfg.intermediate_size, dtype=x.dtype, device=x.device)
            return ops.linear(act, down, into_norm)
        ops.mlp = mlp
    else:
        raise ValueError(f"skip={name}: one of {SKIPPABLE}")


def parse_split_override(item: str) -> tuple[tuple[int, int], tuple]:
    """'split:N:K=MAX_M:bm/bn/bk/warps/stages[/late[/groups[/tma]]]/splits+MAX_M:none+...' -> the (N, K) `split` key
    and its rows (all of them, in increasing MAX_M; 'none': not split up to that M)."""
    lhs, rhs = item.removeprefix("split:").split("=")
    n, k = map(int, lhs.split(":"))
    rows = []
    for cell in rhs.split("+"):
        max_m, spec = cell.split(":")
        if spec == "none":
            rows.append((int(max_m), None, 1))
        else:
            *t, splits = map(int, spec.split("/"))
            rows.append((int(max_m), parse_tile(t), splits))
    return (n, k), tuple(rows)


# `attn:NAME=INT` names: AttentionTuning's fields, and the module constants they replaced
_ATTN_ALIASES = {"PREFETCH_MIN_SPLITS": "prefetch_min_splits", "TABLE_CHUNK": "table_chunk",
                 "SHORT_WAVE_PROGRAMS_PER_SM": "short_wave_programs_per_sm", "SHORT_WAVE_STAGES": "short_wave_stages",
                 "NUM_STAGES": "num_stages", "DEFAULT_BLOCK_N": "block_n", "SPLIT_BLOCK_N": "split_block_n",
                 "_NUM_WARPS": "num_warps"}


def _put_row(rows: tuple, max_m: int, tile) -> tuple:
    """`rows` ((max_m, tile), ...) with the row at max_m taking `tile` (added in max_m order
    where there is none: a shape the table does not name yet)."""
    return tuple(sorted({**dict(rows), max_m: tile}.items()))


@dataclass
class Variant:
    """One `;`-separated item of --variants (see run_decode_variants for the syntax)."""

    spec: str
    switches: dict = field(default_factory=dict)  # RunnerConfig kernel switches (and "tuning")
    tiles: list = field(default_factory=list)  # ((kind, N, K), max_m, tile)
    folds: list = field(default_factory=list)
    heads: list = field(default_factory=list)
    splits: dict = field(default_factory=dict)  # (N, K) -> rows
    attn: dict = field(default_factory=dict)  # AttentionTuning fields
    skips: list = field(default_factory=list)
    attn_splits: int | None = None
    fp32_greedy: bool = False
    torch_argmax: bool = False
    swept: bool = False


def parse_variant(spec: str) -> Variant:
    import dataclasses

    from runner.kernels.tuning import AttentionTuning

    attn_fields = {f.name for f in dataclasses.fields(AttentionTuning)}
    v = Variant(spec)
    for kv in filter(None, (x.strip() for x in spec.split(","))):
        if kv == "fp32_greedy":
            v.fp32_greedy = True
        elif kv == "torch_argmax":
            v.torch_argmax = True
        elif kv.startswith("tuning="):
            v.switches["tuning"] = kv.removeprefix("tuning=")
        elif kv.startswith("tile:"):
            v.tiles.append(parse_tile_override(kv))
        elif kv.startswith("fold:"):
            v.folds.append(parse_tile_override("tile:plain:" + kv.removeprefix("fold:")))
        elif kv.startswith("head:"):
            v.heads.append(parse_tile_override("tile:plain:" + kv.removeprefix("head:")))
        elif kv.startswith("split:"):
            key, rows = parse_split_override(kv)
            v.splits[key] = rows
        elif kv == "swept":
            v.swept = True
        elif kv.startswith("skip="):
            v.skips.append(kv.removeprefix("skip="))
        elif kv.startswith("attn:"):
            name, value = kv.removeprefix("attn:").split("=")
            name = _ATTN_ALIASES.get(name, name)
            if name not in attn_fields:
                raise ValueError(f"attn:{name}: not one of {sorted(attn_fields)}")
            v.attn[name] = int(value)
        elif kv.startswith("attn_splits="):
            v.attn_splits = int(kv.removeprefix("attn_splits="))
        elif kv != "default":
            k, val = kv.split("=")
            v.switches[k] = bool(int(val)) if val.isdigit() else val  # a bool switch, or a mode (depth_step=on)
    return v


def variant_tables(v: Variant, tables, swept_rows: dict | None = None):
    """`tables` (runner.kernels.tuning.Tables) with the variant's rows and attention fields put
    in (a new value; nothing shared is edited). `swept_rows`: the `tuned` rows of a sweep, for
    the `swept` variant."""
    import dataclasses

    lin = tables.linear
    if v.swept:
        if swept_rows is None:
            raise ValueError("variant 'swept' needs the gemm section in the same run (deploy.bench.tune)")
        lin = dataclasses.replace(lin, tuned=swept_rows)
    tuned, fold, head = dict(lin.tuned), dict(lin.fold), dict(lin.head)
    for key, max_m, tile in v.tiles:
        tuned[key] = _put_row(tuned.get(key, ()), max_m, tile)
    for (_, n, k), max_m, tile in v.folds:
        fold[(n, k)] = _put_row(fold.get((n, k), ()), max_m, tile)
    for (_, n, k), max_m, tile in v.heads:
        head[(n, k)] = _put_row(head.get((n, k), ()), max_m, tile)
    lin = dataclasses.replace(lin, tuned=tuned, split={**lin.split, **v.splits}, fold=fold, head=head)
    return dataclasses.replace(tables, linear=lin, attention=dataclasses.replace(tables.attention, **v.attn))


def run_decode_variants(variants: str, batches, swept: list | None = None) -> dict:
    """Greedy decode step time per kernel variant, each on a freshly built model (one run, same
    GPU state): `variants` = ';'-separated variants, each ','-separated RunnerConfig kernel
    overrides and tile-table rows, e.g. "default;rope_in_attention=0;tile:plain:3072:3072:1=1/8/1024/4/1".
    Every variant's model is built on the run's tuning tables (bench_tables: the device's, or
    --tuning none's generic ones, with --tuned's rows) with its own entries put in, never by
    editing module state: `tuning=none` starts from the generic tables (cuBLAS GEMMs, default
    attention / sampling launches); `tile:...` puts a row into the `tuned` (kind, N, K) rows
    (replacing the row of that MAX_M, or adding it: a shape without rows gets them);
    `split:N:K=...` replaces a `split` entry (parse_split_override); `fold:N:K:MAX_M=bm/bn/bk/warps/stages[/late]`
    (or `=none`) puts that row into the `fold` rows; `head:V:K:MAX_M=...` (or `=none`) into the
    `head` rows; `swept` takes the `tuned` rows from this run's gemm sweep (`swept`, its
    "tuned" rows); `skip=OP` times the step without one per-layer op (skip_op: its critical-path
    cost); `attn:NAME=INT` sets a field of the attention tuning (AttentionTuning: table_chunk,
    prefetch_min_splits, short_wave_programs_per_sm, short_wave_stages, num_stages, block_n,
    split_block_n, num_warps, ...; the old constant names are accepted); `attn_splits=N`
    fixes the decode attention's split count at every batch size; `fp32_greedy` takes greedy ids
    as argmax over the fp32 logits copy (the path before greedy_ids);
    `torch_argmax` takes them with torch.argmax instead of runner/kernels/argmax.py (at row counts
    where the `head` rows leave the head unfused)."""
    from triton.runtime.errors import OutOfResources

    from deploy.bench.common import bench_tables
    from streaming.sampling_params import SamplingParams

    base = dict(KERNELS)

    def reset() -> None:  # every variant starts from the run's options, and the run ends there
        KERNELS.clear()
        KERNELS.update(base)

    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    out = {}
    try:
        for spec in variants.split(";"):
            reset()
            v = parse_variant(spec)
            KERNELS.update(v.switches)
            swept_rows = None
            if v.swept and swept is not None:
                from deploy.bench.gemm import load_tuned_rows

                swept_rows = load_tuned_rows(swept)
            tables = variant_tables(v, bench_tables(), swept_rows)
            model = build_orpheus_model(tables)
            for name in v.skips:
                skip_op(model, name)
            if v.attn_splits is not None:
                model.attn.num_splits = v.attn_splits  # the one backend every layer shares
            if v.fp32_greedy:
                model.greedy_ids = lambda h, m=model: m.compute_logits(h).argmax(dim=-1)
            if v.torch_argmax:  # greedy ids by torch's reduction, not runner/kernels/argmax.py
                model.ops.argmax = lambda x: x.argmax(dim=-1)
            try:
                res = run_engine(model, batches, graphs=True, async_sched=True, sampling=greedy)
            except OutOfResources as e:  # a tile that does not fit is this variant's result, not the run's end
                log(f"  variant {spec}: {e}")
                del model
                torch.cuda.empty_cache()
                continue
            key = spec if spec not in out else f"{spec} #{sum(k.split(' #')[0] == spec for k in out) + 1}"
            out[key] = {B: r["step_ms"] for B, r in res.items()}
            log(f"  variant {key}: " + ", ".join(f"B={B} {v:.3f} ms" for B, v in out[key].items()))
            del model
            torch.cuda.empty_cache()
    finally:
        reset()
    return out


def render_variants(variants: dict, num_layers: int = ORPHEUS_3B["num_hidden_layers"]) -> list[str]:
    """Greedy decode ms/step per variant and batch; for `skip=OP` variants also the op's
    critical-path cost per layer: (mean of the `default` runs - the variant) / num_layers, in us."""
    batches = sorted({B for r in variants.values() for B in r}, key=int)
    base = {B: statistics.mean(r[B] for k, r in variants.items() if k.split(" #")[0] == "default" and B in r)
            for B in batches if any(k.split(" #")[0] == "default" and B in r for k, r in variants.items())}
    lines = ["", "Decode variants, greedy ms/step (skip=OP: that op's critical-path cost, us per layer):", "",
             "| variant | " + " | ".join(f"B={B}" for B in batches) + " |", "| --- |" + " --- |" * len(batches)]
    for k, r in variants.items():
        cells = []
        for B in batches:
            if B not in r:
                cells.append("")
            elif k.startswith("skip=") and B in base:
                cells.append(f"{r[B]:.3f} ({1e3 * (base[B] - r[B]) / num_layers:.1f} us)")
            else:
                cells.append(f"{r[B]:.3f}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines
