"""deploy.bench.variants' spec parser and the tables a variant builds (CPU: no model is built)."""

from __future__ import annotations

import pytest

from deploy.bench.variants import parse_variant, variant_tables
from runner.kernels.tuning.tiles import PLAIN
from runner.kernels.tuning import GENERIC, LinearTile, lookup


def test_a_fold_row_for_a_shape_without_rows_is_added() -> None:
    v = parse_variant("fold:1024:1024:16=16/32/128/4/5,fold:1024:1024:64=64/32/128/4/6/0/0/1,norm_fold=1,tuning=none")
    assert v.switches == {"norm_fold": True, "tuning": "none"}
    t = variant_tables(v, GENERIC).linear
    assert t.fold_tile(1024, 1024, 8) == LinearTile(16, 32, 128, 4, 5)
    assert t.fold_tile(1024, 1024, 64) == LinearTile(64, 32, 128, 4, 6, tma=True)
    assert t.fold_tile(1024, 1024, 65) is None and t.fold_tile(2048, 2048, 8) is None
    assert GENERIC.linear.fold_tile(1024, 1024, 8) is None  # the base tables are not edited


def test_a_tile_row_replaces_the_tables_row_and_keeps_the_others() -> None:
    h200 = lookup("NVIDIA H200", (9, 0))
    before = {m: h200.linear.tile(PLAIN, 1024, 1024, m) for m in (1, 16, 32, 64)}
    t = variant_tables(parse_variant("tile:plain:1024:1024:16=none"), h200).linear
    assert t.tile(PLAIN, 1024, 1024, 16) is None  # cuBLAS at that row
    assert {m: t.tile(PLAIN, 1024, 1024, m) for m in (1, 32, 64)} == {m: before[m] for m in (1, 32, 64)}


def test_attention_fields_and_unknown_names() -> None:
    t = variant_tables(parse_variant("attn:block_n=32"), GENERIC)
    assert t.attention.block_n == 32
    with pytest.raises(ValueError, match="attn:bogus"):
        parse_variant("attn:bogus=1")
    assert parse_variant("default").switches == {} and parse_variant("skip=down").skips == ["down"]


def test_a_mode_switch_keeps_its_word() -> None:
    assert parse_variant("depth_step=on,pdl=0").switches == {"depth_step": "on", "pdl": False}


def test_the_depth_bench_writes_the_shape_in_only_where_the_kernel_won(tmp_path) -> None:
    import json
    import shutil

    from deploy.bench.depth_step import write_depth_row
    from runner.kernels.tuning import TABLES_DIR, read_table, tables_from_json

    path = tmp_path / "nvidia_h200.json"
    shutil.copy(TABLES_DIR / "nvidia_h200.json", path)
    slow = {"kernel_us": 136.9, "layers_us": 118.1}
    fast = {"kernel_us": 100.0, "layers_us": 118.1}
    assert "not in" in write_depth_row(str(path), "csm", slow, "NVIDIA H200")
    t = tables_from_json(json.loads(path.read_text()))
    assert t.depth.one_row == read_table("nvidia_h200").depth.one_row == ()
    write_depth_row(str(path), "qwen3_tts", fast, "NVIDIA H200")
    assert tables_from_json(json.loads(path.read_text())).depth.one_row == ("1024x3072",)
    write_depth_row(str(path), "csm", fast, "NVIDIA H200")
    assert tables_from_json(json.loads(path.read_text())).depth.one_row == ("1024x3072", "1024x8192")
    write_depth_row(str(path), "qwen3_tts", slow, "NVIDIA H200")  # a later run it lost: taken out
    t = tables_from_json(json.loads(path.read_text()))
    assert t.depth.one_row == ("1024x8192",) and t.linear == read_table("nvidia_h200").linear
    assert "depth_step --rows 1 --write-table" in t.provenance["depth"]
