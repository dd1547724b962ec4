"""o_proj over a split decode attention's unmerged partials (runner/triton_split_o_proj.py).

Compiled on CUDA; under Triton's interpreter on CPU; skipped without `triton` (CPU CI). An
offline sm_90 compile (with the PDL wait) catches lowering errors without a GPU.

What is checked:
* with an identity weight each head slice's partial is that slice of the merged row, so their
  sum is bit for bit the merge launch's output (the merge arithmetic and rounding are its own);
* with a random weight the partials sum to merged row @ W^T (fp32 tolerance), for several rows
  of different lengths, a seq_len 0 row (zeros) and lengths that leave most splits empty;
* the live-split mask: partials of dead splits poisoned with NaN are never read;
* the tile rule (M = 1 only, no bias, 16-bit) and the model path: a bf16 Llama decoding one
  sequence gives the same logits with the merge in o_proj as with the merge launch, and the
  attention was left unmerged.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import compile_offline, has_nvidia_backend, interpret_without_cuda, patch_interpreter

_CUDA = interpret_without_cuda()  # before any runner Triton module is imported
triton = pytest.importorskip("triton", reason="triton not installed (CPU torch wheel does not bring it)")

from runner.attention import AttentionSplits  # noqa: E402
from runner.triton_attention import paged_decode_attention  # noqa: E402
from runner.triton_fused_ops import TritonOps  # noqa: E402
from runner.triton_split_o_proj import (  # noqa: E402
    TUNED,
    SplitOTile,
    _split_o_proj_kernel,
    default_tile,
    split_o_proj,
    tile_for,
)

DEVICE = "cuda" if _CUDA else "cpu"
if not _CUDA:
    if type(_split_o_proj_kernel).__name__ != "InterpretedFunction":
        pytest.skip("runner.triton_split_o_proj was imported before TRITON_INTERPRET=1; run this file on its own",
                    allow_module_level=True)
    patch_interpreter()

BS = 16
HQ, HKV, D = 8, 2, 32


def _case(seq_lens: list[int], seed: int = 0, dtype=torch.bfloat16):
    """q [B, Hq, D], a cache with scrambled block tables, seq_lens."""
    g = torch.Generator().manual_seed(seed)
    b = len(seq_lens)
    max_blocks = max(1, math.ceil(max(seq_lens) / BS)) + 1
    num_blocks = 1 + sum(math.ceil(s / BS) for s in seq_lens) + 2
    kv = torch.randn(2, num_blocks, BS, HKV, D, generator=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(b, max_blocks, dtype=torch.int32)
    for i, s in enumerate(seq_lens):
        n = math.ceil(s / BS)
        tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    q = torch.randn(b, HQ, D, generator=g)
    return (q.to(DEVICE, dtype), kv.to(DEVICE, dtype), tables.to(DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))


def _both(seq_lens, splits, seed=0, block_n=16):
    """(merged output of the merge launch, the same launch's unmerged AttentionSplits)."""
    q, kv, tables, lens = _case(seq_lens, seed)
    merged = paged_decode_attention(q, kv, tables, lens, D**-0.5, num_splits=splits, block_n=block_n)
    parts = paged_decode_attention(q, kv, tables, lens, D**-0.5, num_splits=splits, block_n=block_n, merge=False)
    return merged, parts


def test_unmerged_launch_returns_its_partials():
    merged, parts = _both([40], splits=4)
    assert isinstance(parts, AttentionSplits)
    assert parts.acc.shape == (1, HQ, 4, D) and parts.m.shape == parts.l.shape == (1, HQ, 4)
    assert (parts.block_n, parts.block_size, parts.dtype) == (16, BS, torch.bfloat16)
    # unsplit, there is nothing to merge: the output as usual
    q, kv, tables, lens = _case([40])
    out = paged_decode_attention(q, kv, tables, lens, D**-0.5, num_splits=1, merge=False)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


@pytest.mark.parametrize("heads", [1, 2, 4])
@pytest.mark.parametrize("seq_lens,splits", [([40], 4), ([7, 0, 100], 8), ([1], 8)],
                         ids=["one-row", "rows-and-padding", "one-token"])
def test_identity_weight_gives_the_merged_row_bit_for_bit(seq_lens, splits, heads):
    """y = x @ I: partial g holds the merged row's head slice g and zeros elsewhere, so the sum of
    the partials is the merged row exactly; any difference is in the merge itself."""
    merged, parts = _both(seq_lens, splits)
    eye = torch.eye(HQ * D, device=DEVICE, dtype=torch.bfloat16)
    out = split_o_proj(parts, eye, SplitOTile(32, heads, 4))
    assert out.parts.shape == (HQ // heads, len(seq_lens), HQ * D) and out.dtype == torch.bfloat16
    got = out.parts.sum(0).to(torch.bfloat16)
    assert torch.equal(got, merged.reshape(len(seq_lens), HQ * D))
    if 0 in seq_lens:
        assert torch.equal(got[seq_lens.index(0)], torch.zeros_like(got[0]))


@pytest.mark.parametrize("tile", [SplitOTile(32, 2, 4), SplitOTile(64, 4, 8), SplitOTile(16, 8, 4)],
                         ids=["bn32-h2", "bn64-h4", "bn16-h8"])
def test_partials_sum_to_o_proj_of_the_merged_row(tile):
    merged, parts = _both([7, 0, 100], splits=8, seed=1)
    g = torch.Generator().manual_seed(2)
    n = 80  # not a multiple of block_n: the masked column block is exercised
    w = (0.05 * torch.randn(n, HQ * D, generator=g)).to(DEVICE, torch.bfloat16)
    out = split_o_proj(parts, w, tile)
    assert out.parts.shape == (HQ // tile.heads, 3, n)
    ref = merged.reshape(3, HQ * D).float() @ w.float().T
    torch.testing.assert_close(out.parts.sum(0), ref, atol=1e-4, rtol=1e-4)


def test_dead_splits_are_never_read():
    """A sequence of 20 tokens in 8 splits of 16-token tiles has 2 live splits: NaN in the other
    six splits' partials must not reach the result."""
    merged, parts = _both([20], splits=8)
    for t in (parts.acc, parts.m, parts.l):
        t[:, :, 2:] = float("nan")
    eye = torch.eye(HQ * D, device=DEVICE, dtype=torch.bfloat16)
    got = split_o_proj(parts, eye, SplitOTile(32, 4, 4)).parts.sum(0).to(torch.bfloat16)
    assert torch.equal(got, merged.reshape(1, HQ * D))


def test_tile_rule():
    assert tile_for(3072, 24, 128, 1) == TUNED[(3072, 24, 128)][0][1]
    assert tile_for(3072, 24, 128, 2) is None
    assert default_tile(256, 8, 32, 1) == SplitOTile(32, 8, 4)  # K slices of at most 512
    assert default_tile(3072, 24, 128, 1) == SplitOTile(32, 4, 4)
    assert default_tile(640, 5, 128, 1) == SplitOTile(32, 1, 4)
    assert default_tile(256, 8, 32, 2) is None
    ops = TritonOps()
    lin = torch.nn.Linear(HQ * D, 64, bias=False, device=DEVICE, dtype=torch.bfloat16)
    assert ops.split_o_proj_tile(1, lin, HQ, D) is not None
    assert ops.split_o_proj_tile(2, lin, HQ, D) is None
    assert TritonOps(split_o_proj=False).split_o_proj_tile(1, lin, HQ, D) is None
    assert TritonOps(split_k=False).split_o_proj_tile(1, lin, HQ, D) is None
    assert ops.split_o_proj_tile(1, lin.float(), HQ, D) is None  # fp32 keeps cuBLAS
    biased = torch.nn.Linear(HQ * D, 64, bias=True, device=DEVICE, dtype=torch.bfloat16)
    assert ops.split_o_proj_tile(1, biased, HQ, D) is None


_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 96,
    "hidden_size": HQ * D,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": HQ,
    "num_key_value_heads": HKV,
    "head_dim": D,
    "max_position_embeddings": 256,
}


@torch.no_grad()
def test_model_decode_same_with_merge_in_o_proj():
    """A bf16 Llama decoding one sequence (pure decode, batch 1: the attention is split) through
    TritonOps + TritonPagedAttention: the logits with o_proj merging the splits equal those of
    the merge launch to bf16 tolerance, and the merge launch really was skipped."""
    from runner.attention import AttentionMetadata, allocate_kv_cache
    from runner.config import ModelConfig
    from runner.models.llama import build_random_model
    from runner.triton_attention import TritonPagedAttention

    cfg = ModelConfig.from_dict(_LLAMA)
    dtype = torch.bfloat16
    seen = []

    class Spy(TritonPagedAttention):
        def forward_decode_rope(self, *a, merge=True, **k):
            out = super().forward_decode_rope(*a, merge=merge, **k)
            seen.append(isinstance(out, AttentionSplits))
            return out

    logits = []
    for split_o in (True, False):
        model = build_random_model(cfg, DEVICE, dtype, seed=3, attn=Spy(), ops=TritonOps(split_o_proj=split_o))
        kv = allocate_kv_cache(cfg, 16, BS, DEVICE, dtype)
        table = torch.arange(1, 9, dtype=torch.int32, device=DEVICE)[None]
        ids = torch.tensor([5, 17, 33, 2, 60, 11, 9, 40, 7, 3], device=DEVICE)
        n = len(ids)
        prefill = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=DEVICE), block_tables=table,
            slot_mapping=torch.arange(BS, BS + n, device=DEVICE), max_query_len=n, max_seq_len=n)
        hidden, _ = model(ids, torch.arange(n, device=DEVICE), kv, prefill)
        tok = model.compute_logits(hidden[-1:]).argmax(-1)
        out = []
        for step in range(2):
            pos = n + step
            meta = AttentionMetadata(
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                seq_lens=torch.tensor([pos + 1], dtype=torch.int32, device=DEVICE), block_tables=table,
                slot_mapping=torch.tensor([BS + pos], device=DEVICE), max_query_len=1, max_seq_len=pos + 1,
                pure_decode=True)
            hidden, _ = model(tok, torch.tensor([pos], device=DEVICE), kv, meta)
            out.append(model.compute_logits(hidden).float())
            tok = out[-1].argmax(-1)
        logits.append(torch.cat(out))
    assert seen == [True] * 2 + [False] * 2  # 2 decode steps of the one layer each
    torch.testing.assert_close(logits[0], logits[1], atol=2e-2, rtol=2e-2)


_COMPILE_SCRIPT = textwrap.dedent(
    """
    from runner import triton_split_o_proj as m
    from tests.triton_interpreter import compile_sm90

    sig = dict(acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", seq_lens_ptr="*i32", w_ptr="*bf16", out_ptr="*fp32",
               B="i32", N="i32", stride_wn="i32", num_q_heads="i32", max_blocks="i32")
    for tile in (m.SplitOTile(64, 4, 8), m.SplitOTile(32, 4, 4), m.SplitOTile(32, 8, 8)):
        consts = dict(HEADS=tile.heads, HEAD_DIM=128, NUM_SPLITS=32, SPLITS_P=32, ATTN_BLOCK_SIZE=16,
                      ATTN_BLOCK_N=32, BLOCK_N=tile.block_n, USE_GDC=True)
        compile_sm90(m._split_o_proj_kernel, sig, consts, num_warps=tile.num_warps, launch_pdl=True)
    print("compiled")
    """
)


@pytest.mark.skipif(not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_kernel_compiles_for_sm90_with_pdl():
    compile_offline(_COMPILE_SCRIPT, timeout=300)
