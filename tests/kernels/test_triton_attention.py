"""Triton paged decode attention vs a float64 reference and vs TorchPagedAttention.

On CUDA the kernels run compiled, over the full shape matrix, plus CUDA-graph capture/replay.
Without CUDA they run under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) on a small
subset so the file stays well under 30 s; without `triton` installed (CPU CI: the CPU torch
wheel does not bring it) the whole file is skipped.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap

import pytest
import torch

from tests.support.triton_interpreter import (
    compile_offline,
    has_nvidia_backend,
    interpret_without_cuda,
    interpreted_or_skip,
)

_CUDA = interpret_without_cuda()  # before runner.kernels.attention is imported
triton = pytest.importorskip("triton", reason="triton not installed (CPU torch wheel does not bring it)")

from runner.kernels.attention import (  # noqa: E402
    REFERENCE,
    _paged_decode_kernel,
    choose_block_n,
    choose_num_splits,
    paged_decode_attention,
)
from runner.kernels.gpu_info import num_sms  # noqa: E402
from runner.layers.attention import (  # noqa: E402
    NO_PLAN_BACKENDS,
    AttentionMetadata,
    TorchPagedAttention,
)
from runner.layers.triton_attention import TritonPagedAttention  # noqa: E402

DEVICE = "cuda" if _CUDA else "cpu"
INTERPRET = not _CUDA
BS = 16  # cache block size of the target deployment


if INTERPRET:
    interpreted_or_skip(_paged_decode_kernel, "runner.kernels.attention")

_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _make_case(
    b: int, hq: int, hkv: int, d: int, seq_lens: list[int], dtype: torch.dtype, *, poison: bool, seed: int = 0
):
    """Random q, cache and scrambled block tables for `b` sequences of lengths `seq_lens`.

    Block 0 is the padding block (table entries past a row's live blocks). With `poison`, block 0
    and every slot past a sequence's length in its last block hold NaN: any read of dead KV that
    leaks into the result shows up as NaN. (TorchPagedAttention needs poison=False: it gathers
    whole blocks and relies on masking.)
    """
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(1, math.ceil(max(seq_lens) / BS)) + 1  # +1: a padded column in every row
    num_blocks = 1 + sum(math.ceil(s / BS) for s in seq_lens) + 5  # 5 never-used blocks
    kv = torch.randn(2, num_blocks, BS, hkv, d, generator=gen)
    q = torch.randn(b, hq, d, generator=gen)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # scrambled, block 0 excluded
    tables = torch.zeros(b, max_blocks, dtype=torch.int32)
    for i, s in enumerate(seq_lens):
        n = math.ceil(s / BS)
        tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
        if poison and s % BS:
            kv[:, tables[i, n - 1], s % BS :] = float("nan")
    if poison:
        kv[:, 0] = float("nan")
    return (
        q.to(DEVICE, dtype),
        kv.to(DEVICE, dtype),
        tables.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    )


def _reference(q, kv, tables, seq_lens, scale) -> torch.Tensor:
    """float64 attention over only the live positions of each sequence; zeros for seq_len 0."""
    b, hq, d = q.shape
    _, nb, bs, hkv, _ = kv.shape
    flat = kv.double().view(2, nb * bs, hkv, d)
    out = torch.zeros(b, hq, d, dtype=torch.float64, device=q.device)
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = tables[i, pos // bs].long() * bs + pos % bs
        k = flat[0][slots].repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = flat[1][slots].repeat_interleave(hq // hkv, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[i].double(), k) * scale).softmax(-1)
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out


def _check(out, ref, dtype) -> None:
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= _TOL[dtype], f"max abs error {err} > {_TOL[dtype]}"


# (B, Hq, Hkv, D, dtype, seq_lens, num_splits); None = choose_num_splits.
_SEQS = [1, 7, 16, 17, 300, 1000]
if INTERPRET:
    # Each interpreted tile costs ~10 ms per program: few KV heads, short sequences.
    CASES = [
        (3, 4, 2, 32, torch.float32, [0, 7, 300], 1),
        (3, 4, 2, 32, torch.float32, [17, 0, 300], 3),
        (8, 4, 2, 64, torch.float32, [1, 7, 16, 17, 0, 33, 64, 1000], None),
        (1, 6, 2, 32, torch.float32, [300], None),  # group 3: padded to 16 rows
        (1, 2, 2, 128, torch.bfloat16, [1000], 1),  # group 1 (MHA)
        (3, 4, 2, 128, torch.bfloat16, [16, 300, 1], None),
        (1, 24, 8, 128, torch.bfloat16, [17], None),  # Orpheus-3B heads
        (3, 4, 2, 64, torch.float16, [7, 0, 300], 2),
    ]
else:
    # Every (heads, D) pair in fp32 and bf16 with split-K (B*Hkv <= 64 < 132 SMs: auto splits),
    # fp16 and the unsplit kernel on the target shape, then a batch-size sweep. ~35 compiles.
    _B8 = [0, 1, 7, 16, 17, 300, 1000, 33]
    CASES = [
        (8, hq, hkv, d, dtype, _B8, None)
        for hq, hkv in [(8, 8), (24, 8), (4, 2)]
        for d in (32, 64, 128)
        for dtype in (torch.float32, torch.bfloat16)
    ] + [
        (8, 24, 8, 128, torch.float16, _B8, None),
        (8, 24, 8, 128, torch.float16, _B8, 1),
        (8, 8, 8, 128, torch.bfloat16, _B8, 1),
        (8, 4, 2, 64, torch.bfloat16, _B8, 1),
        (8, 24, 8, 128, torch.bfloat16, _B8, 1),
    ] + [
        (b, 24, 8, 128, torch.bfloat16, seqs, splits)
        for b, seqs in [(1, [1000]), (1, [1]), (3, [7, 300, 17]), (3, [1000, 16, 0])]
        for splits in (1, 4, None)
    ] + [(b, 24, 8, 128, torch.bfloat16, _B8 * (b // 8), None) for b in (16, 32, 64)]  # split, short wave, above

def _case_id(c) -> str:
    b, hq, hkv, d, dtype, seqs, splits = c
    return f"B{b}-{hq}/{hkv}-D{d}-{str(dtype).split('.')[-1]}-S{'auto' if splits is None else splits}-{seqs[0]}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_decode_matches_reference(case):
    b, hq, hkv, d, dtype, seqs, splits = case
    q, kv, tables, seq_lens = _make_case(b, hq, hkv, d, seqs, dtype, poison=True)
    scale = d**-0.5
    out = paged_decode_attention(q, kv, tables, seq_lens, scale, num_splits=splits)
    assert out.dtype == dtype
    _check(out, _reference(q, kv, tables, seq_lens, scale), dtype)


@pytest.mark.parametrize("splits", [1, 3])
def test_empty_rows_are_zero(splits):
    q, kv, tables, seq_lens = _make_case(3, 4, 2, 32, [0, 5, 0], torch.float32, poison=True)
    out = torch.full_like(q, float("nan"))  # `out` is written in place, padding rows included
    res = paged_decode_attention(q, kv, tables, seq_lens, 0.2, out=out, num_splits=splits)
    assert res.data_ptr() == out.data_ptr()
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    _check(out, _reference(q, kv, tables, seq_lens, 0.2), torch.float32)


def test_strided_inputs():
    """q as a column slice of a fused projection, table as a column slice of a wider buffer."""
    q, kv, tables, seq_lens = _make_case(3, 4, 2, 32, [9, 40, 1], torch.float32, poison=True)
    wide_q = torch.randn(3, 7, 32, device=DEVICE)
    wide_q[:, 2:6] = q
    wide_t = torch.full((3, tables.shape[1] + 3), 10**6, dtype=torch.int32, device=DEVICE)
    wide_t[:, : tables.shape[1]] = tables
    out = paged_decode_attention(wide_q[:, 2:6], kv, wide_t[:, : tables.shape[1]], seq_lens, 0.2, num_splits=2)
    _check(out, _reference(q, kv, tables, seq_lens, 0.2), torch.float32)


def test_choose_num_splits_and_block_n():
    # Enough programs already: no split, long tiles.
    assert choose_num_splits(33, 8, 132) == 1 and choose_block_n(33, 8, 132) == 64
    # B=1, 8 KV heads: ceil(264 / 8) = 33 splits wanted, capped at max_splits.
    assert choose_num_splits(1, 8, 132) == REFERENCE.max_splits and choose_block_n(1, 8, 132) == 32
    # rounded down to a power of two (a bounded set of compiled variants): ceil(264 / 32) = 9 -> 8
    assert choose_num_splits(4, 8, 132) == 8
    assert choose_num_splits(16, 8, 132) == 2
    assert {choose_num_splits(b, 8, 132) for b in range(1, 40)} == {1, 2, 4, 8, 16, 32}


def test_choose_tiling():
    """(tile, stages, table chunk) by batch on 8 KV heads and 132 SMs: the 32-split batch 1 and
    the batches past a short wave keep the per-tile table; split batches read it in chunks; up
    to batch 32 (a graph bucket, so eager steps and replays agree) 32-token tiles, 4 stages."""
    from runner.kernels.attention import choose_tiling

    NUM_STAGES, SHORT_WAVE_STAGES, TABLE_CHUNK = (REFERENCE.num_stages, REFERENCE.short_wave_stages,
                                                  REFERENCE.table_chunk)

    def tiling(b):
        return choose_tiling(b, 8, 132, choose_num_splits(b, 8, 132))

    assert tiling(1) == (32, NUM_STAGES, 0)
    assert tiling(2) == tiling(8) == tiling(16) == (32, NUM_STAGES, TABLE_CHUNK)
    assert tiling(17) == tiling(32) == (32, SHORT_WAVE_STAGES, TABLE_CHUNK)
    assert tiling(33) == tiling(64) == tiling(256) == (64, NUM_STAGES, 0)


def test_fused_rope_batch_sizes():
    """RoPE fused into pure-decode steps while B * Hkv programs fit in about one wave (graph
    buckets 1..64 on 8 KV heads and an H200's 132 SMs, the CPU default); never when off."""
    dev = torch.device(DEVICE)
    attn = TritonPagedAttention()
    sms = num_sms(dev)
    assert [b for b in range(1, 1025) if attn.decode_rope_fused(b, 8, dev)] == list(range(1, 4 * sms // 8 + 1))
    assert not TritonPagedAttention(rope_in_attention=False).decode_rope_fused(1, 8, dev)


def test_split_choice_ignores_table_width():
    """An eager step's table is as wide as its longest sequence, a graph replay's is full width:
    the same rows give the same values either way (same splits, same tiles)."""
    q, kv, tables, seq_lens = _make_case(2, 4, 2, 32, [300, 9], torch.float32, poison=True)
    wide = torch.zeros(2, tables.shape[1] + 20, dtype=torch.int32, device=DEVICE)
    wide[:, : tables.shape[1]] = tables
    a = paged_decode_attention(q, kv, tables, seq_lens, 0.2)
    b = paged_decode_attention(q, kv, wide, seq_lens, 0.2)
    assert torch.equal(a, b)


def _decode_meta(seq_lens: torch.Tensor, tables: torch.Tensor) -> AttentionMetadata:
    """Decode metadata: one new token per sequence at position seq_len - 1."""
    b = seq_lens.shape[0]
    pos = (seq_lens.long() - 1).clamp(min=0)
    slots = tables[torch.arange(b, device=seq_lens.device), pos // BS].long() * BS + pos % BS
    return AttentionMetadata(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=seq_lens.device),
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=slots,
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_decode_matches_torch_backend(dtype):
    b, hq, hkv, d = 3, 4, 2, 64
    q, kv, tables, seq_lens = _make_case(b, hq, hkv, d, [7, 300, 17], dtype, poison=False)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(b, hkv, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(b, hkv, d, generator=gen).to(DEVICE, dtype)
    meta = _decode_meta(seq_lens, tables)
    kv_t = kv.clone()
    out = TritonPagedAttention().forward(q, k, v, kv, meta, d**-0.5)
    ref = TorchPagedAttention().forward(q, k, v, kv_t, meta, d**-0.5)
    assert torch.equal(kv, kv_t)  # same KV write
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref.float()).abs().max().item() <= tol


def _chunked_case(q_lens: list[int], seq_lens: list[int], seed: int, **meta_kw):
    """q/k/v for sequences computing their last q_len positions, the paged cache and metadata."""
    hq, hkv, d = 4, 2, 32
    _, kv, tables, _ = _make_case(len(seq_lens), hq, hkv, d, seq_lens, torch.float32, poison=False)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(q_lens), h, d, generator=gen).to(DEVICE) for h in (hq, hkv, hkv))
    slots = [int(tables[i, p // BS]) * BS + p % BS
             for i, (ql, sl) in enumerate(zip(q_lens, seq_lens)) for p in range(sl - ql, sl)]
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        **meta_kw,
    )
    return q, k, v, kv, tables, meta


def test_backend_prefill_delegates_to_torch():
    q, k, v, kv, _, meta = _chunked_case([5, 3], [20, 9], seed=2)
    kv_t = kv.clone()
    out = TritonPagedAttention().forward(q, k, v, kv, meta, 0.3)
    ref = TorchPagedAttention(NO_PLAN_BACKENDS).forward(q, k, v, kv_t, meta, 0.3)
    assert torch.equal(out, ref) and torch.equal(kv, kv_t)


def test_backend_mixed_step_decodes_with_the_kernel():
    """Decode rows first, then prefill chunks (meta.num_decodes): the decode rows go through the
    Triton kernel, the prefill rows through the torch path over the prefill sequences alone;
    the result and the KV writes equal the torch backend over the whole batch."""
    seq_lens = [40, 7, 300, 20, 9]
    q_lens = [1, 1, 1, 5, 3]  # three decodes, two prefill chunks
    q, k, v, kv, tables, meta = _chunked_case(q_lens, seq_lens, seed=3, num_decodes=3, prefill_max_seq_len=20)
    kv_t = kv.clone()
    out = TritonPagedAttention().forward(q, k, v, kv, meta, 0.3)
    ref = TorchPagedAttention().forward(q, k, v, kv_t, meta, 0.3)
    assert torch.equal(kv, kv_t)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)

    # Every query row as a decode row (token_seq_lens = position + 1, its sequence's table):
    # causal attention over the paged context, chunks with a cached prefix included.
    pos = [p for ql, sl in zip(q_lens, seq_lens) for p in range(sl - ql, sl)]
    rows_of = [i for i, ql in enumerate(q_lens) for _ in range(ql)]
    tok_meta = AttentionMetadata(
        **{f: getattr(meta, f) for f in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "max_query_len", "max_seq_len")},
        token_seq_lens=torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=DEVICE),
        token_block_tables=tables[torch.tensor(rows_of, device=DEVICE)].contiguous(),
    )
    kv_r = kv_t.clone()
    rows = TritonPagedAttention().forward(q, k, v, kv_r, tok_meta, 0.3)
    assert torch.equal(kv_r, kv_t)
    torch.testing.assert_close(rows, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("splits", [1, None])
def test_cuda_graph_replay_follows_new_metadata(splits):
    """Capture one decode step (KV write + kernel) and replay it with new seq_lens/tables/q."""
    b, hq, hkv, d, dtype = 4, 24, 8, 128, torch.bfloat16
    max_blocks, num_blocks = 64, 300  # static shapes of the captured batch
    scale = d**-0.5
    backend = TritonPagedAttention(num_splits=splits)
    kv = torch.randn(2, num_blocks, BS, hkv, d, device=DEVICE, dtype=dtype)
    q = torch.zeros(b, hq, d, device=DEVICE, dtype=dtype)
    k = torch.zeros(b, hkv, d, device=DEVICE, dtype=dtype)
    v = torch.zeros(b, hkv, d, device=DEVICE, dtype=dtype)
    seq_lens = torch.ones(b, dtype=torch.int32, device=DEVICE)
    tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=DEVICE)
    meta = _decode_meta(seq_lens, tables)  # slot_mapping tensor refilled in place below

    def fill(lens: list[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        new_tables = torch.zeros(b, max_blocks, dtype=torch.int32)
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        for i, n in enumerate(lens):
            new_tables[i, : math.ceil(n / BS)] = torch.tensor(
                [perm.pop() for _ in range(math.ceil(n / BS))], dtype=torch.int32
            )
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        tables.copy_(new_tables)
        meta.slot_mapping.copy_(_decode_meta(seq_lens, tables).slot_mapping)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen).to(dtype))

    fill([5, 17, 1, 0], seed=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compile kernels outside the capture
        backend.forward(q, k, v, kv, meta, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, kv, meta, scale)

    for seed, lens in enumerate([[1000, 3, 0, 64], [1, 0, 513, 999], [0, 0, 0, 16]], start=1):
        fill(lens, seed)
        kv_before = kv.clone()
        graph.replay()
        torch.cuda.synchronize()
        # The replay wrote this step's k/v at slot_mapping. Rows with seq_len 0 all point at
        # block 0 (the scratch block; which of them lands last is unspecified): compare the rest.
        live = seq_lens > 0
        ref_kv = kv_before.view(2, -1, hkv, d)
        ref_kv[0][meta.slot_mapping[live]] = k[live]
        ref_kv[1][meta.slot_mapping[live]] = v[live]
        assert torch.equal(kv[:, 1:], ref_kv.view_as(kv)[:, 1:])
        ref = _reference(q, kv, tables, seq_lens, scale)
        _check(out, ref, dtype)
        for i, n in enumerate(lens):
            if n == 0:
                assert torch.equal(out[i], torch.zeros_like(out[i]))


def _rope_tables(positions: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE tables ([P, D] fp32, cat(f, f) rows), built by the model's own class."""
    from runner.config import RopeConfig
    from runner.models.llama import RotaryEmbedding

    rot = RotaryEmbedding(d, positions, RopeConfig())
    return rot.cos.to(DEVICE), rot.sin.to(DEVICE)


@pytest.mark.parametrize(
    "dtype,splits,hq,hkv,d,lens",
    [(torch.bfloat16, 1, 4, 2, 64, [7, 300, 17]), (torch.bfloat16, 3, 4, 2, 64, [16, 1, 300]),
     (torch.float16, None, 6, 2, 32, [33, 5]), (torch.float32, 2, 4, 2, 32, [64, 9])]
    + ([] if INTERPRET else [(torch.bfloat16, None, 24, 8, 128, [1, 100, 350, 1000]),
                             (torch.bfloat16, 1, 24, 8, 128, [1, 100, 350, 1000]),
                             (torch.bfloat16, None, 24, 8, 128, [1, 100, 350, 1000, 64, 65, 16, 17] * 4)]),
)
def test_fused_rope_equals_rope_kernel_then_decode(dtype, splits, hq, hkv, d, lens):
    """RoPE + KV write inside the decode kernel (pure decode) against the RoPE + KV write kernel
    followed by the plain decode kernel: the same cache bit for bit (both round RoPE like torch,
    without FMA contraction); the same output bit for bit when not split (write first, read
    back), else up to the fp32 summation order of the current token's softmax step. q/k/v are
    strided column views of one fused qkv row, as in the model."""
    from runner.kernels.attention import DecodeRope
    from runner.kernels.fused_ops import rope_

    b = len(lens)
    _, kv, tables, seq_lens = _make_case(b, hq, hkv, d, lens, dtype, poison=True)
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
    q, k, v = (t.view(b, -1, d) for t in qkv.split((hq * d, hkv * d, hkv * d), dim=-1))
    cos, sin = _rope_tables(2048, d)
    meta = _decode_meta(seq_lens, tables)
    pos = seq_lens.long() - 1

    kv_ref, q_ref, k_ref = kv.clone(), q.clone(), k.clone()
    rope_(q_ref, k_ref, cos, sin, pos, v=v, kv_cache=kv_ref, slot_mapping=meta.slot_mapping)
    ref = paged_decode_attention(q_ref, kv_ref, tables, seq_lens, d**-0.5, num_splits=splits)

    q_in = q.clone()
    out = paged_decode_attention(q, kv, tables, seq_lens, d**-0.5, num_splits=splits,
                                 rope=DecodeRope(k, v, cos, sin, pos, meta.slot_mapping))
    assert torch.equal(q, q_in)  # the unrotated q is read, not rotated in place
    assert torch.equal(kv.nan_to_num(7.0), kv_ref.nan_to_num(7.0))
    ulp = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]  # ~ one output ulp
    assert (out.float() - ref.float()).abs().max().item() <= ulp
    if (splits or choose_num_splits(b, hkv, num_sms(kv.device))) == 1:
        assert torch.equal(out, ref)
    _check(out, _reference(q_ref, kv_ref, tables, seq_lens, d**-0.5), dtype)


@pytest.mark.parametrize("lens,splits", [([7, 300, 17, 0], 3), ([1, 2, 33, 64, 65], 2), ([200], 32),
                                         ([16, 17, 1, 33, 0, 300], 32)])
def test_prefetch_before_the_wait_changes_nothing(lens, splits):
    """The split pure-decode kernel with its first tile, block table and RoPE rows loaded before
    the PDL wait (the first tile peeled off the loop): output and cache bit for bit those of the
    kernel that loads them in the loop. Covers empty splits, a padding row (seq_len 0), one-
    and multi-tile splits and the current position at a tile's first and last slot."""
    from runner.kernels import attention as triton_attention
    from runner.kernels.attention import DecodeRope

    hq, hkv, d = 4, 2, 32
    b = len(lens)
    _, kv, tables, seq_lens = _make_case(b, hq, hkv, d, lens, torch.bfloat16, poison=True)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, h, d, generator=gen).to(DEVICE, torch.bfloat16) for h in (hq, hkv, hkv))
    cos, sin = _rope_tables(512, d)
    meta = _decode_meta(seq_lens, tables)
    pos = (seq_lens.long() - 1).clamp(min=0)
    outs, caches = [], []
    assert triton_attention.prefetches(32) and not triton_attention.prefetches(1)
    tuning = dataclasses.replace(REFERENCE, prefetch_min_splits=2)  # also multi-tile splits
    for prefetch in (False, True):
        cache = kv.clone()
        outs.append(paged_decode_attention(q, cache, tables, seq_lens, d**-0.5, num_splits=splits, block_n=16,
                                           rope=DecodeRope(k, v, cos, sin, pos, meta.slot_mapping),
                                           prefetch=prefetch, tuning=tuning))
        caches.append(cache)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0].nan_to_num(7.0), caches[1].nan_to_num(7.0))
    assert not torch.equal(caches[0].nan_to_num(7.0), kv.nan_to_num(7.0))  # this step's k/v were written


@pytest.mark.parametrize("lens,splits,fused", [([7, 300, 17, 0], 1, False), ([1, 33, 64, 65, 200], 3, True),
                                               ([130, 0, 96], 1, True), ([300, 31], 2, False)])
def test_table_chunks_change_nothing(lens, splits, fused):
    """The block table read in chunks ahead of the tile loop (TABLE_CHUNK; here 2 entries, i.e.
    32 positions and 2 tiles per chunk, so rows walk several chunks and splits start mid-chunk)
    against each tile loading its own entries: output and cache bit for bit, split or not, with
    the fused RoPE + KV write or without; dead KV (NaN poison) never read."""
    from runner.kernels.attention import DecodeRope

    hq, hkv, d = 4, 2, 32
    b = len(lens)
    _, kv, tables, seq_lens = _make_case(b, hq, hkv, d, lens, torch.bfloat16, poison=True)
    gen = torch.Generator().manual_seed(b)
    q, k, v = (torch.randn(b, h, d, generator=gen).to(DEVICE, torch.bfloat16) for h in (hq, hkv, hkv))
    cos, sin = _rope_tables(512, d)
    meta = _decode_meta(seq_lens, tables)
    rope = DecodeRope(k, v, cos, sin, (seq_lens.long() - 1).clamp(min=0), meta.slot_mapping) if fused else None
    outs, caches = [], []
    for chunk in (0, 2):
        cache = kv.clone()
        outs.append(paged_decode_attention(q, cache, tables, seq_lens, d**-0.5, num_splits=splits, block_n=16,
                                           rope=rope, table_chunk=chunk))
        caches.append(cache)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0].nan_to_num(7.0), caches[1].nan_to_num(7.0))
    if not fused:
        _check(outs[1], _reference(q, kv, tables, seq_lens, d**-0.5), torch.bfloat16)


@pytest.mark.parametrize("splits", [1, 2])
def test_fused_rope_backend_path_and_empty_rows(splits):
    """TritonPagedAttention.forward_decode_rope: the pure-decode path; a seq_len 0 row (graph
    padding) writes nothing and yields zeros, whether the kernel writes first or folds."""
    hq, hkv, d = 4, 2, 32
    _, kv, tables, seq_lens = _make_case(3, hq, hkv, d, [9, 0, 40], torch.bfloat16, poison=False)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, h, d, generator=gen).to(DEVICE, torch.bfloat16) for h in (hq, hkv, hkv))
    cos, sin = _rope_tables(64, d)
    meta = _decode_meta(seq_lens, tables)
    meta.slot_mapping[1] = 0  # the padding row's scratch slot (block 0)
    meta.pure_decode = True
    pos = (seq_lens.long() - 1).clamp(min=0)
    kv_before = kv.clone()
    out = TritonPagedAttention(num_splits=splits).forward_decode_rope(q, k, v, cos, sin, pos, kv, meta, d**-0.5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(kv[:, 0], kv_before[:, 0])  # nothing written for the empty row
    kv_ref = kv_before.clone()
    q_ref, k_ref = q.clone(), k.clone()
    from runner.kernels.fused_ops import rope_

    rope_(q_ref, k_ref, cos, sin, pos, v=v, kv_cache=kv_ref, slot_mapping=meta.slot_mapping)
    live = torch.tensor([0, 2], device=DEVICE)
    ref = paged_decode_attention(q_ref[live], kv_ref, tables[live], seq_lens[live], d**-0.5, num_splits=splits)
    assert (out[live].float() - ref.float()).abs().max().item() <= 1.6e-2
    kv_ref[:, 0] = kv_before[:, 0]
    assert torch.equal(kv, kv_ref)


_COMPILE_SCRIPT = textwrap.dedent(
    """
    from runner.kernels import attention as m
    from tests.support.triton_interpreter import compile_sm90

    sig = dict(q_ptr="*bf16", kv_ptr="*bf16", bt_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*bf16",
               part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32",
               scale_log2e="fp32", stride_qb="i32", stride_qh="i32", stride_qd="i32", stride_kv="i64",
               stride_blk="i32", stride_tok="i32", stride_kvh="i32", stride_kvd="i32", stride_btb="i32",
               stride_btc="i32", stride_ob="i32", stride_oh="i32", stride_od="i32", num_q_heads="i32",
               max_blocks="i32", knew_ptr="*bf16", vnew_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32",
               pos_ptr="*i64", slot_ptr="*i64", stride_knb="i32", stride_knh="i32", stride_vnb="i32",
               stride_vnh="i32", stride_cos="i32", stride_sin="i32", max_pos="i32")
    for splits in (1, 32):
        for fused in (False, True):
            consts = dict(GROUP=3, GROUP_P=16, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=64, NUM_SPLITS=splits,
                          DOT_PREC="tf32", LOOP_STAGES=3, USE_GDC=True, FUSED_ROPE=fused, ROUND=True,
                          FOLD_CURRENT=fused and splits > 1)
            for prefetch in (False, True) if fused and splits > 1 else (False,):
                for table_p in (0, 128):
                    compile_sm90(m._paged_decode_kernel, sig, dict(consts, PREFETCH=prefetch, TABLE_P=table_p),
                                 num_warps=4, num_stages=3, launch_pdl=True)
    merge_sig = dict(part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", out_ptr="*bf16",
                     stride_ob="i32", stride_oh="i32", stride_od="i32", num_q_heads="i32")
    compile_sm90(m._merge_splits_kernel, merge_sig, dict(HEAD_DIM=128, NUM_SPLITS=32, SPLITS_P=32, USE_GDC=True),
                 num_warps=4, launch_pdl=True)
    print("compiled")
    """
)


@pytest.mark.skipif(not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_kernels_compile_for_sm90_with_pdl():
    compile_offline(_COMPILE_SCRIPT, timeout=300)


@pytest.mark.parametrize("hkv", [1, 2, 8])
def test_launch_classes_name_every_unfused_variant_once(hkv):
    """Every batch size's unfused launch (split count, tile length, stages, table chunk) is the
    launch of exactly one of launch_classes' batch sizes, the smallest with it."""
    from runner.kernels.attention import choose_tiling, launch_classes
    from runner.kernels.tuning import read_table

    for t in (REFERENCE, read_table("nvidia_h200").attention):
        def launch(b, t=t):
            splits = choose_num_splits(b, hkv, 132, t)
            return (splits, *choose_tiling(b, hkv, 132, splits, t))

        classes = launch_classes(hkv, 132, t)
        assert len({launch(b) for b in classes}) == len(classes) and classes[0] == 1
        assert {launch(b) for b in range(1, 2000)} == {launch(b) for b in classes}
        assert all(launch(b) != launch(b - 1) for b in classes[1:])  # each the smallest of its variant
    fixed = launch_classes(hkv, 132, REFERENCE, num_splits=1)  # a backend's own split count (unsplit())
    tiles = lambda b: choose_tiling(b, hkv, 132, 1, REFERENCE)  # noqa: E731
    assert {tiles(b) for b in range(1, 2000)} == {tiles(b) for b in fixed} and len(set(map(tiles, fixed))) == len(fixed)


def test_warm_up_runs_each_unfused_variant_once(monkeypatch):
    """TritonPagedAttention.warm_up (Engine.warm_up, via ModelRunner.warm_attention) launches one
    decode per launch class on the model's cache and writes nothing to it."""
    import runner.layers.triton_attention as ta
    from runner.kernels.attention import launch_classes

    seen = []
    real = ta.paged_decode_attention

    def record(q, kv_cache, block_tables, seq_lens, *a, **k):
        seen.append((q.shape[0], k.get("num_splits")))
        if INTERPRET and len(seen) > 1:  # the interpreter runs one launch for real: ~1500 programs cost ~50 s
            return torch.empty_like(q)
        return real(q, kv_cache, block_tables, seq_lens, *a, **k)

    monkeypatch.setattr(ta, "paged_decode_attention", record)
    kv = torch.randn(2, 3, BS, 8, 16, device=DEVICE, dtype=torch.bfloat16)
    before = kv.clone()
    backend = TritonPagedAttention(tuning=REFERENCE)
    backend.warm_up(kv, num_q_heads=16)
    assert seen == [(b, None) for b in launch_classes(8, num_sms(DEVICE), REFERENCE)]
    assert torch.equal(kv, before)
    seen.clear()
    backend.unsplit().warm_up(kv, num_q_heads=16)
    assert seen == [(b, 1) for b in launch_classes(8, num_sms(DEVICE), REFERENCE, num_splits=1)]
