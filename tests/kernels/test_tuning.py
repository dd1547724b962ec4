"""Tuning tables as data (runner/kernels/tuning): lookup by device, the generic path, and the
shipped H200 file against the literals it replaced.

Runs without triton (the tables module imports none), so this file is part of the CPU suite;
the interpreter-run comparison of the tuned and the generic path lives in
test_tuning_paths.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from runner.kernels.tuning import (
    GENERIC,
    TABLES_DIR,
    AttentionTuning,
    DepthTuning,
    LinearTables,
    SamplingTuning,
    SnacTuning,
    Tables,
    dumps_table,
    linear_to_json,
    load_tables,
    lookup,
    read_table,
    table_names,
    tables_from_json,
    tables_to_json,
)
from runner.kernels.tuning.tiles import (
    GATED,
    PER_SM,
    PLAIN,
    SAFE_SNAC_TILES,
    LinearTile,
    SnacTiles,
    default_tile,
)

# The tables as Python literals before they became data (runner/kernels/linear.py and
# head_argmax.py at fea339b), copied by hand: the JSON must give exactly these.
OLD_TUNED = {
    (PLAIN, 5120, 3072): ((1, LinearTile(1, 4, 1024, 4, 1)), (16, LinearTile(16, 64, 128, 4, 5)), (32, None),
                          (48, LinearTile(64, 64, 128, 4, 6, tma=True)), (64, LinearTile(64, 64, 128, 4, 6, tma=True))),
    (PLAIN, 3072, 3072): ((1, LinearTile(1, 4, 1024, 4, 1)), (16, LinearTile(16, 32, 128, 4, 5)), (32, None), (64, None)),
    (PLAIN, 16384, 3072): ((1, None), (16, None), (32, None), (64, None)),
    (GATED, 16384, 3072): ((1, LinearTile(16, 64, 128, 4, 4, True)), (16, LinearTile(16, 64, 128, 4, 5, True, PER_SM)),
                           (32, LinearTile(32, 64, 128, 4, 5, True, PER_SM)),
                           (64, LinearTile(64, 64, 128, 4, 4, True, PER_SM, tma=True))),
    (PLAIN, 3072, 8192): ((1, LinearTile(1, 4, 1024, 4, 1)), (16, None), (32, None), (64, None)),
    (PLAIN, 156940, 3072): ((1, LinearTile(1, 4, 1024, 4, 1)), (16, None), (32, None), (64, None)),
}
OLD_SPLIT_TUNED = {
    (3072, 3072): ((8, LinearTile(16, 64, 64, 4, 4, True), 8), (32, LinearTile(32, 64, 128, 4, 4, tma=True), 2),
                   (64, LinearTile(64, 64, 128, 4, 5, tma=True), 2)),
    (3072, 8192): ((8, LinearTile(16, 32, 128, 4, 4, True), 4), (16, LinearTile(16, 32, 128, 4, 4, True), 4),
                   (32, LinearTile(32, 128, 128, 4, 4, tma=True), 4), (64, LinearTile(64, 64, 128, 4, 6, tma=True), 2)),
}
OLD_FOLD_TUNED = {
    (3072, 3072): ((1, None), (8, LinearTile(16, 32, 128, 4, 5)), (16, LinearTile(16, 32, 128, 4, 5)), (32, None),
                   (64, LinearTile(64, 32, 128, 4, 6, tma=True))),
}
OLD_HEAD_TUNED = {
    (156940, 3072): ((1, None), (16, LinearTile(16, 128, 128, 4, 4, tma=True)),
                     (32, LinearTile(32, 128, 128, 4, 4, tma=True)), (64, LinearTile(64, 128, 128, 8, 4, tma=True)),
                     (128, None), (256, None)),
}
# runner/kernels/attention.py's constants, snac.py's CUDA tiles and sampling.py's _CONFIG at fea339b
OLD_ATTENTION = dict(block_n=64, split_block_n=32, num_stages=3, num_warps=4, target_programs_per_sm=2, max_splits=32,
                     table_chunk=128, short_wave_programs_per_sm=2, short_wave_stages=4, prefetch_min_splits=32,
                     fused_rope_programs_per_sm=4)
OLD_SNAC_FP32 = SnacTiles(bm=64, bn=64, bk=32, num_warps=4, num_stages=2)
OLD_SNAC_BF16 = SnacTiles(bm=64, bn=128, bk=32, num_warps=4, num_stages=3, fast_sin=True)
OLD_SAMPLING = {"BLOCK_P": 512, "NP": 8, "BLOCK_S": 2048, "C": 8192, "MAX_PASSES": 40, "num_warps": 8,
                "num_warps_small": 8}


def _old_tile_for(kind: int, n: int, k: int, m: int) -> LinearTile | None:
    """fea339b's runner.kernels.linear.tile_for over OLD_TUNED."""
    rows = OLD_TUNED.get((kind, n, k))
    if rows is None:
        if (PLAIN, n, k) in OLD_TUNED:
            return None
        return default_tile(kind, n, k, m)
    return next((t for max_m, t in rows if m <= max_m), None)


def test_h200_file_holds_the_old_literals_exactly():
    t = read_table("nvidia_h200")
    # the Orpheus rows as they were; the rows added since are CSM-1B's shapes (gemm --shapes csm)
    # and those of Qwen3-TTS 1.7B that CSM does not share (gemm --shapes qwen3_tts --new-only)
    assert {key: rows for key, rows in t.linear.tuned.items() if key in OLD_TUNED} == OLD_TUNED
    csm = {(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (1536, 1024), (1024, 1024), (16384, 1024),
           (1024, 8192), (1024, 2048)}  # backbone qkv, o, gate_up, down; depth decoder's and its projector
    heads = {(2051, 2048), (2051, 1024)}  # gemm --shapes csm times them too
    qwen3 = {(4096, 2048), (12288, 2048), (2048, 6144), (4096, 1024), (6144, 1024), (1024, 3072), (2048, 1024)}
    added = {(n, k) for _, n, k in set(t.linear.tuned) - set(OLD_TUNED)}
    assert csm | qwen3 <= added <= csm | heads | qwen3
    assert {key: rows for key, rows in t.linear.split.items() if key in OLD_SPLIT_TUNED} == OLD_SPLIT_TUNED
    # split rows added since: CSM's o / down of both stacks (gemm --shapes csm --split)
    assert set(t.linear.split) - set(OLD_SPLIT_TUNED) <= {(2048, 2048), (2048, 8192), (1024, 1024), (1024, 8192)}
    assert {key: rows for key, rows in t.linear.fold.items() if key in OLD_FOLD_TUNED} == OLD_FOLD_TUNED
    # fold rows added since: CSM's o_proj of both stacks (csm --sections frames --variants)
    assert set(t.linear.fold) - set(OLD_FOLD_TUNED) <= {(2048, 2048), (1024, 1024)}
    assert dict(t.linear.head) == OLD_HEAD_TUNED
    assert t.linear.default_tiles  # shapes of other models keep default_tile on the H200, as before
    assert t.attention == AttentionTuning(**OLD_ATTENTION)
    assert t.snac == SnacTuning(float32=OLD_SNAC_FP32, bfloat16=OLD_SNAC_BF16)
    assert t.sampling == SamplingTuning(**OLD_SAMPLING)
    # one line of provenance per table, no run ids
    assert set(t.provenance) == {"linear", "split", "fold", "head", "attention", "snac", "sampling", "depth"}
    # the depth section (added with runner/kernels/depth_row.py): empty since Qwen3-TTS's GEMM rows
    # made its layer path faster than the one-row kernel (deploy.bench.depth_step --write-table)
    assert t.depth == DepthTuning(one_row=())
    assert not t.depth.one_row_fits(1024, 3072) and not t.depth.one_row_fits(1024, 8192)
    assert all("\n" not in line and "-run" not in line for line in t.provenance.values())


def test_h200_lookups_choose_the_old_tiles():
    """Same tile for every (kind, shape, M) the engine asks: the Orpheus-3B shapes, a shape of
    another model (default_tile), at and between the bucket thresholds."""
    lin = read_table("nvidia_h200").linear
    shapes = set(OLD_TUNED) | {(GATED, 5120, 3072), (PLAIN, 96, 200), (GATED, 256, 512), (PLAIN, 2048, 512)}
    for kind, n, k in shapes:
        for m in range(80):
            assert lin.tile(kind, n, k, m) == _old_tile_for(kind, n, k, m), (kind, n, k, m)
    for m in range(80):
        for (n, k), rows in OLD_SPLIT_TUNED.items():
            want = None if m <= 1 else next(((t, s) for max_m, t, s in rows if m <= max_m), None)
            assert lin.split_tile(n, k, m) == want
        assert lin.fold_tile(3072, 3072, m) == next((t for max_m, t in OLD_FOLD_TUNED[(3072, 3072)] if m <= max_m), None)
        assert lin.head_tile(156940, 3072, m) == next((t for max_m, t in OLD_HEAD_TUNED[(156940, 3072)] if m <= max_m),
                                                      None)
    assert lin.tunes_head(156940, 3072) and not lin.tunes_head(96, 64)


def test_lookup_by_name_then_capability_else_generic():
    assert lookup("NVIDIA H200", (9, 0)).name == "nvidia_h200"
    assert lookup("nvidia  h200", (9, 0)).name == "nvidia_h200"  # case and spacing do not matter
    # an sm90 part without a file of its own takes the table that is the fallback for sm90
    assert lookup("NVIDIA H100 80GB HBM3", (9, 0)).name == "nvidia_h200"
    # the name wins over the capability: a (hypothetical) H200 reported at another capability
    assert lookup("NVIDIA H200", (10, 0)).name == "nvidia_h200"
    for name, cap in (("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA GeForce RTX 4090", (8, 9)), ("NVIDIA B200", (10, 0))):
        assert lookup(name, cap) is GENERIC, name
    assert "nvidia_h200" in table_names()


def test_load_tables_modes():
    assert load_tables("cpu") is GENERIC  # no GPU: nothing tuned (the interpreter runs generic tiles)
    assert load_tables("cpu", "none") is GENERIC
    with pytest.raises(ValueError, match="tuning"):
        load_tables("cpu", "fast")
    if torch.cuda.is_available():
        assert load_tables("cuda", "none") is GENERIC
        name, cap = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
        assert load_tables("cuda") == lookup(name, tuple(cap))


def test_generic_tables_are_cublas_and_default_tiles():
    g = GENERIC
    assert not g.tuned and read_table("nvidia_h200").tuned
    for kind in (PLAIN, GATED):
        for n, k in ((5120, 3072), (96, 200), (16384, 3072), (2048, 1024)):
            for m in (1, 2, 16, 17, 64):
                assert g.linear.tile(kind, n, k, m) is None
                assert g.linear.split_tile(n, k, m) is None and g.linear.fold_tile(n, k, m) is None
    assert g.linear.head_tile(156940, 3072, 64) is None and not g.linear.tunes_head(156940, 3072)
    assert g.attention == AttentionTuning()
    assert g.attention.prefetch_min_splits > g.attention.max_splits  # never prefetches
    assert g.attention.table_chunk == 0 and g.attention.short_wave_programs_per_sm == 0
    for bn in (g.attention.block_n, g.attention.split_block_n):
        assert bn & (bn - 1) == 0
    assert g.snac.tiles(torch.bfloat16) == g.snac.tiles(torch.float32) == SAFE_SNAC_TILES
    assert not SAFE_SNAC_TILES.fast_sin
    assert g.sampling == SamplingTuning()


def test_json_round_trips():
    path = TABLES_DIR / "nvidia_h200.json"
    text = path.read_text()
    raw = json.loads(text)
    t = tables_from_json(raw)
    assert tables_to_json(t) == raw
    assert dumps_table(tables_to_json(t)) == text  # the file is exactly what the writer writes
    assert tables_from_json(tables_to_json(_named("x"))) == _named("x")
    # the linear sections alone (what the gemm sweep writes) read back as the same LinearTables
    sections = linear_to_json(t.linear)
    back = tables_from_json({"name": "sweep", **sections})
    assert back.linear == t.linear
    assert back.attention == GENERIC.attention and back.snac == GENERIC.snac  # sections left out: generic


def _named(name: str) -> Tables:
    return Tables(name=name, linear=LinearTables({(PLAIN, 64, 128): ((1, LinearTile(1, 8, 128)), (16, None))},
                                                 default_tiles=False),
                  gpu_names=("Some GPU",), fallback_for_capability=None)


def test_every_shipped_table_reads():
    for name in table_names():
        t = read_table(name)
        assert t.name == name and t.gpu_names


def test_a_sweep_writes_its_rows_into_the_table():
    """What deploy/bench/gemm.py --write-table does: the swept entries replace theirs in the
    linear section, every other entry and section stays, and the file reads back."""
    from runner.kernels.tuning import with_linear_rows

    raw = json.loads((TABLES_DIR / "nvidia_h200.json").read_text())
    swept = {(PLAIN, 3072, 3072): ((1, LinearTile(1, 8, 512, 4, 1)), (16, None), (32, None), (64, None)),
             (PLAIN, 4096, 4096): ((1, None), (64, LinearTile(64, 64, 128, 8, 4, tma=True)))}
    out = tables_from_json(with_linear_rows(raw, swept, "a sweep"))
    assert out.provenance["linear"] == "a sweep"
    old = read_table("nvidia_h200")
    want = {**old.linear.tuned, **swept}
    assert dict(out.linear.tuned) == want and out.linear.default_tiles
    assert out.linear.split == old.linear.split and out.linear.head == old.linear.head
    assert out.attention == old.attention and out.snac == old.snac and out.gpu_names == old.gpu_names
    fresh = tables_from_json(with_linear_rows({"name": "new_gpu", "gpu_names": ["New GPU"]}, swept, "a sweep"))
    assert dict(fresh.linear.tuned) == swept and fresh.attention == GENERIC.attention


def test_a_split_sweep_writes_its_rows_into_the_table():
    """What deploy/bench/gemm.py --split --write-table does to the split section: the swept
    (N, K) entries added or replaced, the others and every other section kept."""
    from runner.kernels.tuning import with_split_rows

    raw = json.loads((TABLES_DIR / "nvidia_h200.json").read_text())
    swept = {(1024, 8192): ((16, LinearTile(16, 32, 128, 4, 4), 4), (32, None, 1), (64, None, 1)),
             (3072, 3072): ((64, LinearTile(64, 64, 128, 4, 6, tma=True), 2),)}
    out = tables_from_json(with_split_rows(raw, swept, "a split sweep"))
    old = read_table("nvidia_h200")
    assert out.provenance["split"] == "a split sweep"
    assert dict(out.linear.split) == {**old.linear.split, **swept}
    assert out.linear.split_tile(1024, 8192, 9) == (LinearTile(16, 32, 128, 4, 4), 4)
    assert out.linear.split_tile(1024, 8192, 20) is None and out.linear.split_tile(1024, 8192, 1) is None
    assert out.linear.tuned == old.linear.tuned and out.linear.fold == old.linear.fold


def test_new_only_sweeps_the_shapes_the_table_lacks(tmp_path):
    """deploy/bench/gemm.py --new-only: a model's shapes that another model already has rows for
    (Qwen3-TTS's o 2048x2048 and projector 1024x2048 are CSM's too) are not swept again."""
    pytest.importorskip("triton", reason="deploy/bench/gemm.py imports the Triton GEMM")
    from deploy.bench.gemm import SHAPE_SETS, new_shapes

    from runner.kernels.tuning import with_linear_rows

    path = tmp_path / "t.json"
    path.write_text(json.dumps(json.loads((TABLES_DIR / "nvidia_h200.json").read_text())))
    qwen = SHAPE_SETS["qwen3_tts"]
    new = new_shapes(path, qwen)
    assert {"o", "depth_o"} <= set(qwen) - set(new) and {"qkv", "depth_gate_up", "depth_down"} <= set(new)
    assert new_shapes(path, SHAPE_SETS["orpheus"]) == {}
    raw = with_linear_rows(json.loads(path.read_text()), {(PLAIN, n, k): ((1, None),) for n, k, _ in new.values()}, "x")
    path.write_text(json.dumps(raw))
    assert new_shapes(path, qwen) == {}
