"""The qkv GEMM with RoPE and the KV write in its epilogue (runner/kernels/qkv_rope.py).

Compiled on CUDA; under Triton's interpreter on CPU; skipped without `triton` (CPU CI). An
offline sm_90 compile catches lowering errors without a GPU.

What is checked:
* q and the cache come out bit for bit as the qkv GEMM (`skinny_linear`, the same tile) followed
  by the RoPE + KV write kernel, for pointer and TMA tiles, one or several row blocks, clamped
  positions; no other cache slot is written;
* TritonOps.qkv_rope_write takes the one launch only where qkv's tile is an MMA tile (else None:
  the caller's linear + rope_write_kv), and never with a bias or with it turned off;
* a model decoding through it gives the logits and KV of the path without it.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.support.triton_interpreter import (
    compile_offline,
    has_nvidia_backend,
    interpret_without_cuda,
    interpreted_or_skip,
)

_CUDA = interpret_without_cuda()
triton = pytest.importorskip("triton", reason="triton not installed (CPU torch wheel does not bring it)")

from runner.config import RopeConfig
from runner.kernels.fused_ops import rope_
from runner.kernels.linear import PLAIN, REFERENCE, LinearTile, skinny_linear
from runner.kernels.qkv_rope import _qkv_rope_kernel, qkv_rope_write
from runner.layers.triton_ops import TritonOps
from runner.models.llama import RotaryEmbedding

DEVICE = "cuda" if _CUDA else "cpu"
if not _CUDA:
    interpreted_or_skip(_qkv_rope_kernel, "runner.kernels.qkv_rope")

HQ, HKV, D, H = 4, 2, 64, 128  # GQA 4/2, head_dim 64, hidden 128
NB, BS, P = 24, 8, 512


def _rand(*shape, seed, dtype=torch.bfloat16, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(DEVICE, dtype)


def _tables(p: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own fp32 [P, D] cos / sin tables (cat(f, f) rows)."""
    rot = RotaryEmbedding(d, p, RopeConfig())
    return rot.cos.to(DEVICE), rot.sin.to(DEVICE)


def _case(m: int, seed: int):
    x = _rand(m, H, seed=seed)
    w = _rand((HQ + 2 * HKV) * D, H, seed=seed + 1, scale=0.05)
    g = torch.Generator().manual_seed(seed + 2)
    positions = torch.randint(0, P, (m,), generator=g)
    positions[0] = P + 7  # past the table (a stale padded row): clamped to its last row
    slots = torch.randperm(NB * BS, generator=g)[:m]  # distinct, scrambled flat slots
    cache = _rand(2, NB, BS, HKV, D, seed=seed + 3)
    return x, w, positions.to(DEVICE), slots.to(DEVICE), cache


def _reference(x, w, tile, cos, sin, positions, slots, cache):
    """The unfused pair: the qkv GEMM with the same tile, then the RoPE + KV write kernel."""
    qkv = skinny_linear(x, w, None, tile)
    m = x.shape[0]
    q, k, v = qkv.split((HQ * D, HKV * D, HKV * D), dim=-1)
    q, k, v = q.view(m, HQ, D), k.view(m, HKV, D), v.view(m, HKV, D)
    q, _ = rope_(q, k, cos, sin, positions.clamp(max=P - 1), v=v, kv_cache=cache, slot_mapping=slots)
    return q


TILES = [LinearTile(16, 32, 64, 4, 2), LinearTile(16, 64, 32, 4, 3), LinearTile(16, 32, 64, 4, 2, tma=True),
         LinearTile(64, 64, 64, 4, 2, tma=True)]


@pytest.mark.parametrize("m", [1, 13, 40])
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t.block_m}x{t.block_n}x{t.block_k}{'-tma' if t.tma else ''}")
def test_equals_gemm_then_rope_write_kv(m, tile):
    cos, sin = _tables(P, D)
    x, w, positions, slots, cache = _case(m, seed=m)
    ref_cache = cache.clone()
    ref_q = _reference(x, w, tile, cos, sin, positions, slots, ref_cache)
    q = qkv_rope_write(x, w, tile, cos, sin, positions, cache, slots, HQ)
    assert q.shape == (m, HQ, D) and q.is_contiguous()
    assert torch.equal(q, ref_q)
    assert torch.equal(cache, ref_cache)  # this token's k (rotated) and v at their slots, the rest untouched


def test_ops_take_it_only_where_qkv_is_an_mma_tile():
    """From shapes alone: qkv's tile an MMA tile (the backend's tables), no bias, on unless turned off."""
    cos, sin = _tables(P, D)
    n = (HQ + 2 * HKV) * D
    tables = REFERENCE.with_entries(tuned={(PLAIN, n, H): ((1, LinearTile(1, 4, 64, 4, 1)), (16, None),
                                                           (64, LinearTile(16, 32, 64, 4, 2)))})
    lin = torch.nn.Linear(H, n, bias=False).to(DEVICE, torch.bfloat16)
    biased = torch.nn.Linear(H, n, bias=True).to(DEVICE, torch.bfloat16)
    cache = _rand(2, NB, BS, HKV, D, seed=5)
    for m, taken in ((1, False), (16, False), (17, True), (64, True), (65, False)):
        x = _rand(m, H, seed=6)
        positions = torch.zeros(m, dtype=torch.int64, device=DEVICE)
        slots = torch.arange(m, dtype=torch.int64, device=DEVICE)
        q = TritonOps(tables=tables).qkv_rope_write(x, lin, HQ, cos, sin, positions, cache, slots)
        assert (q is not None) == taken, m
        off = TritonOps(qkv_rope=False, tables=tables)
        assert off.qkv_rope_write(x, lin, HQ, cos, sin, positions, cache, slots) is None
        assert TritonOps(tables=tables).qkv_rope_write(x, biased, HQ, cos, sin, positions, cache, slots) is None


def test_model_decodes_the_same_with_it(monkeypatch):
    """A bf16 Llama-shaped model with TritonOps and the Triton attention: pure-decode steps
    through qkv_rope_write give the logits and KV cache of the unfused path (qkv_rope=False)."""
    from runner.config import ModelConfig
    from runner.layers.attention import AttentionMetadata, allocate_kv_cache
    from runner.layers.triton_attention import TritonPagedAttention
    from runner.models.llama import build_random_model

    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": H, "intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": D,
        "max_position_embeddings": 256,
    })
    n = (HQ + 2 * HKV) * D
    gemm_tables = REFERENCE.with_entries(tuned={(PLAIN, n, H): ((64, LinearTile(16, 32, 64, 4, 2)),)})
    calls = []
    real = TritonOps.qkv_rope_write

    def counted(self, *a):
        q = real(self, *a)
        calls.append(q is not None)
        return q
    monkeypatch.setattr(TritonOps, "qkv_rope_write", counted)
    b, bs = 3, 4
    runs = []
    for on in (True, False):
        # off: linear + the RoPE + KV write kernel + the attention kernel alone (what the one
        # launch replaces); the attention kernel's own fused RoPE adds this token in another order
        model = build_random_model(cfg, DEVICE, torch.bfloat16, seed=3, attn=TritonPagedAttention(rope_in_attention=False),
                                   ops=TritonOps(qkv_rope=on, tables=gemm_tables))
        kv = allocate_kv_cache(cfg, 16, bs, DEVICE, torch.bfloat16)
        # three sequences decoding from different lengths (their earlier K/V random), 3 steps
        lens = torch.tensor([5, 9, 2])
        tables = torch.arange(b * 5, dtype=torch.int32).view(b, 5)
        g = torch.Generator().manual_seed(4)
        for layer_kv in kv:
            layer_kv.copy_(torch.randn(layer_kv.shape, generator=g).to(layer_kv))
        ids = torch.tensor([7, 11, 13])
        logits = []
        for _ in range(3):
            pos = lens.clone()
            lens = lens + 1
            slots = tables[torch.arange(b), pos // bs].long() * bs + pos % bs
            meta = AttentionMetadata(query_start_loc=torch.arange(b + 1, dtype=torch.int32).to(DEVICE),
                                     seq_lens=lens.to(torch.int32).to(DEVICE), block_tables=tables.to(DEVICE),
                                     slot_mapping=slots.to(DEVICE), max_query_len=1, max_seq_len=int(lens.max()),
                                     pure_decode=True)
            hidden, _ = model(ids.to(DEVICE), pos.to(DEVICE), kv, meta, ())
            out = model.compute_logits(hidden)
            logits.append(out)
            ids = out.argmax(-1).cpu()
        runs.append((logits, kv))
    assert calls and all(calls[: len(calls) // 2]) and not any(calls[len(calls) // 2:])
    for a, r in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, r)
    for a, r in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, r)


_COMPILE_SCRIPT = textwrap.dedent(
    """
    from runner.kernels import qkv_rope as m
    from runner.kernels.linear import REFERENCE, PLAIN
    from tests.support.triton_interpreter import assert_mma_not_serialised, compile_sm90

    # Orpheus-3B's qkv rows that take the fused path: its MMA tiles (2..16 and 33..64 rows)
    tiles = {t for _, t in REFERENCE.tuned[(PLAIN, 5120, 3072)] if t is not None and t.block_m > 1}
    assert tiles
    for tile in tiles:
        ptr = "*bf16"
        sig = dict(x_ptr=ptr, w_ptr=ptr, q_ptr=ptr, kv_ptr=ptr, cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64",
                   slot_ptr="*i64", M="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_qm="i32",
                   stride_kv="i64", stride_slot="i32", stride_kvh="i32", stride_cos="i32", stride_sin="i32",
                   max_pos="i32", x_desc=f"tensordesc<bf16[{tile.block_m}, {tile.block_k}]>",
                   w_desc=f"tensordesc<bf16[{tile.block_n // 2}, {tile.block_k}]>")
        div = ("x_ptr", "w_ptr", "q_ptr", "kv_ptr", "cos_ptr", "sin_ptr", "pos_ptr", "slot_ptr", "K", "stride_xm",
               "stride_wn", "stride_qm", "stride_slot", "stride_kvh", "stride_cos", "stride_sin")
        k = compile_sm90(m._qkv_rope_kernel, sig, dict(Q_HEADS=24, KV_HEADS=8, HEAD_DIM=128, BLOCK_M=tile.block_m,
                         BLOCK_N=tile.block_n // 2, BLOCK_K=tile.block_k, TMA=tile.tma, ROUND=True,
                         LATE_TRIGGER=tile.late_trigger, USE_GDC=True), div, num_warps=tile.num_warps,
                         num_stages=tile.num_stages, launch_pdl=True)
        ptx = k.asm["ptx"]
        assert "griddepcontrol.wait" in ptx and ("cp.async.bulk.tensor" in ptx) == tile.tma
        assert "fma.rn.bf16" not in ptx  # RoPE's products stay out of FMA contraction (runner/kernels/rope.py)
        assert_mma_not_serialised(ptx, tile)  # ptxas must not serialise the K loop's wgmma (C7514)
    print("compiled")
    """
)


@pytest.mark.skipif(not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_kernel_compiles_for_sm90():
    compile_offline(_COMPILE_SCRIPT, timeout=600)
