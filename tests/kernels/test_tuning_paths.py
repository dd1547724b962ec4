"""The generic (untuned) kernel path against the tuned one, run under Triton's interpreter on CPU
(compiled on CUDA); skipped without `triton`.

* the backends the registry builds carry the tables it looked up: RunnerConfig.tuning "none"
  gives TritonOps / TritonPagedAttention / TritonSampling the generic tables, whose GEMM
  lookups name no Triton tile (cuBLAS for every GEMM);
* the decode attention kernel with GENERIC's launch choices (32-token tiles, 2 stages, no
  chunked block table, no prefetch) computes what it computes with the H200 table's;
* a tiny model decodes the same greedy tokens on the generic path as on the tuned one (the H200
  table: default_tile for these shapes, its attention choices), in fp32 and bf16, and the
  generic path launches no Triton GEMM.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.triton_interpreter import interpret_without_cuda, interpreted_or_skip

_CUDA = interpret_without_cuda()
triton = pytest.importorskip("triton", reason="triton not installed (CPU torch wheel does not bring it)")

from runner.config import RunnerConfig  # noqa: E402
from runner.kernels import attention as triton_attention  # noqa: E402
from runner.kernels import linear as triton_linear  # noqa: E402
from runner.kernels.attention import _paged_decode_kernel, paged_decode_attention  # noqa: E402
from runner.kernels.tuning import GENERIC, Tables, load_tables, read_table  # noqa: E402
from runner.layers import ATTENTION_BACKENDS, OPS_BACKENDS, make_sampling  # noqa: E402

DEVICE = "cuda" if _CUDA else "cpu"
if not _CUDA:
    interpreted_or_skip(_paged_decode_kernel, "runner.kernels.attention")

H200 = read_table("nvidia_h200")
# the Triton GEMM launchers TritonOps calls (runner/layers/triton_ops.py's module names)
TRITON_GEMMS = ("skinny_linear", "residual_linear", "head_argmax", "qkv_rope_write")


def test_reference_is_the_h200_table():
    """A caller that passes no tables (tests, benchmarks) gets the reference table's choices."""
    assert triton_attention.REFERENCE == H200.attention
    assert triton_linear.REFERENCE == H200.linear


def triton_backends(tuning: str, tables: Tables | None = None):
    """(attention, ops) as the registry builds them on CUDA, here on DEVICE: from `tables`, else
    load_tables(DEVICE, tuning) (on CPU that is GENERIC whatever the tuning)."""
    runner = RunnerConfig(device=DEVICE, tuning=tuning)
    dev = torch.device(DEVICE)
    tables = tables if tables is not None else load_tables(dev, tuning)
    return ATTENTION_BACKENDS["triton"](runner, dev, tables), OPS_BACKENDS["triton"](runner, dev, tables)


def test_registry_hands_the_backends_their_tables():
    """tuning "none": the backends hold GENERIC's parts, and GENERIC's GEMM lookups name no tile
    for any shape or row count (skinny, split-K, norm fold, fused head): cuBLAS everywhere."""
    attn, ops = triton_backends("none")
    assert load_tables(DEVICE, "none") is GENERIC
    assert ops.tables is GENERIC.linear and attn.tuning is GENERIC.attention
    assert make_sampling("triton", DEVICE, "none").tuning is GENERIC.sampling
    lin = ops.tables
    shapes = [(n, k) for n in (64, 96, 256, 3072, 5120, 16384, 156940) for k in (128, 192, 3072, 8192)]
    for m in range(1, 80):
        for n, k in shapes:
            assert lin.tile(0, n, k, m) is None and lin.tile(1, n, k, m) is None
            assert lin.split_tile(n, k, m) is None and lin.fold_tile(n, k, m) is None
            assert lin.head_tile(n, k, m) is None and not lin.tunes_head(n, k)
    attn, ops = triton_backends("auto", H200)
    assert ops.tables is H200.linear and attn.tuning is H200.attention


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_greedy_tokens_tuned_and_generic(dtype, monkeypatch):
    """The registry's backends from the H200 table against those of tuning "none": the same greedy
    tokens; "none" launches no Triton GEMM (bf16, where the tuned path runs default_tile GEMMs;
    fp32 GEMMs stay in cuBLAS on both, so there only the attention tiles differ)."""
    import runner.layers.triton_ops as tops
    from runner.config import ModelConfig
    from runner.layers.attention import AttentionMetadata, allocate_kv_cache
    from runner.models.llama import build_random_model

    calls: list[str] = []
    for name in TRITON_GEMMS:
        real = getattr(tops, name)
        monkeypatch.setattr(tops, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    hidden, heads, kv_heads, head_dim = 128, 4, 2, 32
    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": hidden, "intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": 256,
    })

    def decode(attn, ops, steps: int = 4) -> list[list[int]]:
        b, bs = 3, 4
        model = build_random_model(cfg, DEVICE, dtype, seed=5, attn=attn, ops=ops)
        kv = allocate_kv_cache(cfg, 16, bs, DEVICE, dtype)
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

    tuned = decode(*triton_backends("auto", H200))
    assert bool(calls) == (dtype == torch.bfloat16)  # bf16: the tiny shapes take default_tile
    calls.clear()
    generic = decode(*triton_backends("none"))
    assert calls == []  # "none": every GEMM in cuBLAS / F.linear
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
