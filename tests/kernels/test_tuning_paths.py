"""The generic (untuned) kernel path against the tuned one, run under Triton's interpreter on CPU
(compiled on CUDA); skipped without `triton`.

* the decode attention kernel with GENERIC's launch choices (32-token tiles, 2 stages, no
  chunked block table, no prefetch) computes what it computes with the H200 table's;
* a tiny bf16 model decodes the same greedy tokens on the generic path (every GEMM in cuBLAS /
  F.linear, the generic attention tiles) as on the tuned one (the reference table's Triton
  tiles: default_tile for these shapes, the H200 attention choices).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.triton_interpreter import interpret_without_cuda, interpreted_or_skip

_CUDA = interpret_without_cuda()
triton = pytest.importorskip("triton", reason="triton not installed (CPU torch wheel does not bring it)")

from runner.kernels import attention as triton_attention  # noqa: E402
from runner.kernels.attention import _paged_decode_kernel, paged_decode_attention  # noqa: E402
from runner.kernels.tuning import GENERIC, read_table  # noqa: E402

DEVICE = "cuda" if _CUDA else "cpu"
if not _CUDA:
    interpreted_or_skip(_paged_decode_kernel, "runner.kernels.attention")

H200 = read_table("nvidia_h200")
# the module values paged_decode_attention uses when a caller passes no tuning
_MODULE_NAMES = {"block_n": "DEFAULT_BLOCK_N", "split_block_n": "SPLIT_BLOCK_N", "num_stages": "NUM_STAGES",
                 "num_warps": "_NUM_WARPS", "target_programs_per_sm": "_TARGET_PROGRAMS_PER_SM",
                 "max_splits": "MAX_SPLITS", "table_chunk": "TABLE_CHUNK",
                 "short_wave_programs_per_sm": "SHORT_WAVE_PROGRAMS_PER_SM", "short_wave_stages": "SHORT_WAVE_STAGES",
                 "prefetch_min_splits": "PREFETCH_MIN_SPLITS", "fused_rope_programs_per_sm": "_FUSED_ROPE_PROGRAMS_PER_SM"}


def test_module_values_are_the_h200_table():
    """A caller that passes no tuning gets the reference table's choices, as before."""
    for field, name in _MODULE_NAMES.items():
        assert getattr(triton_attention, name) == getattr(H200.attention, field), name


@pytest.mark.parametrize("batch", [1, 3, 20])
def test_generic_attention_tiles_compute_the_same(batch):
    torch.manual_seed(batch)
    hq, hkv, d, bs = 4, 2, 64, 16
    mb = 8
    nb = batch * mb
    kv = torch.randn(2, nb, bs, hkv, d, dtype=torch.float32, device=DEVICE)
    q = torch.randn(batch, hq, d, dtype=torch.float32, device=DEVICE)
    lens = torch.randint(1, mb * bs, (batch,), dtype=torch.int32)
    tables = torch.randperm(nb)[: batch * mb].view(batch, mb).to(torch.int32)
    args = (q, kv, tables.to(DEVICE), lens.to(DEVICE), d**-0.5)
    # few SMs on CPU (DEFAULT_NUM_SMS = 132): batch 1 splits 32 ways, 20 x 2 programs do not
    tuned = paged_decode_attention(*args, tuning=H200.attention)
    generic = paged_decode_attention(*args, tuning=GENERIC.attention)
    torch.testing.assert_close(generic, tuned, rtol=1e-5, atol=1e-5)
    assert triton_attention.choose_tiling(batch, hkv, 132, 1, GENERIC.attention)[0] == GENERIC.attention.block_n


def test_tiny_model_greedy_tokens_tuned_and_generic(monkeypatch):
    from runner.config import ModelConfig
    from runner.layers.attention import AttentionMetadata, allocate_kv_cache
    from runner.layers.triton_attention import TritonPagedAttention
    from runner.layers.triton_ops import TritonOps
    from runner.models.llama import build_random_model

    hidden, heads, kv_heads, head_dim = 128, 4, 2, 32
    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": hidden, "intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": 256,
    })

    def decode(ops, steps: int = 4) -> list[list[int]]:
        b, bs = 3, 4
        model = build_random_model(cfg, DEVICE, torch.bfloat16, seed=5, attn=TritonPagedAttention(), ops=ops)
        kv = allocate_kv_cache(cfg, 16, bs, DEVICE, torch.bfloat16)
        g = torch.Generator().manual_seed(6)
        for layer_kv in kv:  # three sequences decoding from different lengths, earlier K/V random
            layer_kv.copy_(torch.randn(layer_kv.shape, generator=g).to(layer_kv))
        lens = torch.tensor([5, 9, 2])
        tables = torch.arange(b * 5, dtype=torch.int32).view(b, 5)
        ids, out = torch.tensor([7, 11, 13]), []
        for _ in range(steps):
            pos = lens.clone()
            lens = lens + 1
            slots = tables[torch.arange(b), pos // bs].long() * bs + pos % bs
            meta = AttentionMetadata(query_start_loc=torch.arange(b + 1, dtype=torch.int32).to(DEVICE),
                                     seq_lens=lens.to(torch.int32).to(DEVICE), block_tables=tables.to(DEVICE),
                                     slot_mapping=slots.to(DEVICE), max_query_len=1, max_seq_len=int(lens.max()),
                                     pure_decode=True)
            h, _ = model(ids.to(DEVICE), pos.to(DEVICE), kv, meta, ())
            ids = model.compute_logits(h).argmax(-1).cpu()
            out.append(ids.tolist())
        return out

    tuned = decode(TritonOps())  # reference tables: the tiny shapes take default_tile (Triton GEMMs)
    # the generic path: GENERIC.linear names no tile (cuBLAS for every GEMM, as skinny_linear=False
    # gives) and GENERIC.attention's launch choices
    for field, name in _MODULE_NAMES.items():
        monkeypatch.setattr(triton_attention, name, getattr(GENERIC.attention, field))
    assert all(GENERIC.linear.tile(k, n, hidden, 3) is None for k in (0, 1) for n in (hidden, 192 * 2, 256))
    generic = decode(TritonOps(skinny_linear=False))
    assert generic == tuned


def test_generic_tables_give_valid_launch_choices():
    """Every launch choice GENERIC makes for the batch shapes the engine uses is a valid one."""
    t = GENERIC.attention
    for sms in (16, 78, 132):
        for hkv in (1, 2, 8):
            for b in range(1, 300):
                splits = triton_attention.choose_num_splits(b, hkv, sms, t)
                bn, stages, chunk = triton_attention.choose_tiling(b, hkv, sms, splits, t)
                assert splits & (splits - 1) == 0 and 1 <= splits <= t.max_splits
                assert bn & (bn - 1) == 0 and stages >= 1 and chunk == 0
                assert not triton_attention.prefetches(splits, t)
    assert dataclasses.asdict(t) != dataclasses.asdict(H200.attention)
