"""The fused small-vocabulary codebook sampler (runner/kernels/codebook_sampling.py, through
runner.models.csm_sampling.FusedCodebooks) against the torch sampler it replaces:
CodecRange(RaceCodebooks(Sampler(backend="torch"))) on the float32 values of the same logits.

Compiled on CUDA; under Triton's interpreter on CPU; skipped without `triton` (CPU CI; the torch
samplers' own checks are tests/models/test_csm_sampling.py). An offline sm_90 compile catches
lowering errors and register spills without a GPU.

What is checked: equal ids for V in {2051, 2048, 1000, 4096}, bf16 and fp32 logits, rows mixing
greedy, temperature alone, top-k 1 / 50 / V, top-p, min-p and their combinations, with several
seeds, frame counters and codebooks (the race key); bf16 rows full of ties at the top-k and
top-p thresholds; a row's id alone, in 3 rows and in 17; the codec range (flagged rows never
draw a code >= limit, unflagged rows can); a strided output written in its column only; padded
rows (row stride > V); rows of -inf / NaN still give a column of the row; the scaling x / T bit
for bit against torch's division; the compiled kernels' one-pass span reduction.
"""

from __future__ import annotations

import textwrap
from dataclasses import replace

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

import triton.language as tl  # noqa: E402

from runner.kernels.codebook_sampling import MAX_VOCAB, _codebook_sample_kernel, _div, codebook_sample  # noqa: E402
from runner.kernels.sampling import _order_key  # noqa: E402
from runner.layers.noise import NOISE_SALTS  # noqa: E402
from runner.layers.sampler import Sampler  # noqa: E402
from runner.layers.sampling_batch import SamplingBatch  # noqa: E402
from runner.models.csm_sampling import CodecRange, FusedCodebooks, RaceCodebooks  # noqa: E402
from streaming.sampling_params import SamplingParams as SP  # noqa: E402

DEVICE = torch.device("cuda" if _CUDA else "cpu")
if not _CUDA:
    interpreted_or_skip(_order_key, "runner.kernels.sampling")  # the kernel calls its key helpers
    interpreted_or_skip(_codebook_sample_kernel, "runner.kernels.codebook_sampling")

K = 32  # codebooks per frame (CSM)


def _mixed_params(v: int) -> list[SP]:
    """17 rows: greedy, temperature alone, each filter alone and combined. Row 6 (codec-range
    flagged in test_matches_torch_sampler) has k above its count of finite logits."""
    return [
        SP(temperature=0.0), SP(temperature=0.9), SP(temperature=1.0), SP(temperature=1.7),
        SP(top_k=1), SP(temperature=0.9, top_k=50), SP(top_k=v - 1), SP(top_k=v),
        SP(top_p=0.8), SP(temperature=0.6, top_p=0.95), SP(min_p=0.1), SP(temperature=1.2, min_p=0.02),
        SP(temperature=0.7, top_k=50, top_p=0.8), SP(temperature=1.3, top_k=20, min_p=0.05),
        SP(top_p=0.5, min_p=0.2), SP(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01), SP(temperature=0.0, top_k=7),
    ]


def _batch(params: list[SP], seed0: int, counter0: int, device: torch.device) -> SamplingBatch:
    n = len(params)
    seeds = [(seed0 * 7919 + 104729 * i) % (1 << 63) for i in range(n)]
    seeds[0] = (1 << 63) - 1  # both 32-bit halves of the seed feed the key
    return SamplingBatch.build(params, list(range(n)), seeds, [counter0 + 3 * i for i in range(n)], [], device)


def _reference(x: torch.Tensor, batch: SamplingBatch, codebook: int, limit: int | None,
               rows: torch.Tensor | None) -> torch.Tensor:
    """The torch sampler on the CPU over the float32 values of x."""
    fields = {f: getattr(batch, f) for f in batch.__dataclass_fields__}
    cpu = SamplingBatch(**{f: v.cpu() if isinstance(v, torch.Tensor) else v for f, v in fields.items()})
    sampler = RaceCodebooks(Sampler("cpu", backend="torch"), cpu, K)
    if limit is not None:
        assert rows is not None
        sampler = CodecRange(sampler, limit, rows.cpu(), x.shape[1])
    return sampler(x.float().cpu().clone(), codebook)


def _fused(x, batch, codebook, limit=None, rows=None, out=None):
    return FusedCodebooks(batch, K, limit, rows)(x, codebook, out)


def _logits(b: int, v: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a spread like a trained head's: a few strong codes above a broad floor
    x = torch.randn(b, v, generator=g) * 2.5
    x += torch.zeros(b, v).bernoulli_(8 / v, generator=g) * 6
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("v", [2051, 2048, 1000, 4096])
def test_matches_torch_sampler(v, dtype):
    params = _mixed_params(v)
    batch = _batch(params, seed0=v, counter0=11, device=DEVICE)
    x = _logits(len(params), v, dtype, seed=v + (dtype == torch.float32))
    limit = min(v, 2048) - 3
    rows = (torch.arange(len(params)) % 3 == 0).to(DEVICE)
    codebook = v % K
    got = _fused(x, batch, codebook, limit, rows)
    assert got.dtype == torch.int64 and got.shape == (len(params),)
    assert got.tolist() == _reference(x, batch, codebook, limit, rows).tolist()
    # no codec range; a later codebook (another race key)
    got = _fused(x, batch, codebook + 1)
    assert got.tolist() == _reference(x, batch, codebook + 1, None, None).tolist()
    assert x.dtype == dtype  # read, not converted


def test_ties_at_the_thresholds():
    """bf16 logits of few distinct values: the k-th value and the top-p boundary sit inside runs
    of equal logits, which are kept whole (or dropped whole) as by the torch sampler."""
    v = 2051
    params = [SP(top_k=k) for k in (1, 2, 5, 50, 300)] + [SP(top_p=p) for p in (0.05, 0.3, 0.8, 0.99)]
    params += [SP(temperature=0.5, top_k=40, top_p=0.6), SP(min_p=0.5), SP(temperature=0.0)]
    batch = _batch(params, seed0=3, counter0=0, device=DEVICE)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-12, 6, (len(params), v), generator=g).to(torch.bfloat16) / 2
    x[:, 100:110] = 3.0  # ten tokens tied at the top
    x = x.to(DEVICE)
    for codebook in (0, 17):
        assert _fused(x, batch, codebook).tolist() == _reference(x, batch, codebook, None, None).tolist()


def test_a_row_alone_and_in_a_batch():
    v = 2051
    params = _mixed_params(v)
    batch = _batch(params, seed0=9, counter0=40, device=DEVICE)
    x = _logits(len(params), v, torch.bfloat16, seed=9)
    rows = (torch.arange(len(params)) % 2 == 0).to(DEVICE)
    whole = _fused(x, batch, 5, 2048, rows).tolist()

    def part(lo: int, hi: int) -> SamplingBatch:
        sub = _batch(params[lo:hi], seed0=0, counter0=0, device=DEVICE)
        return replace(sub, seeds=batch.seeds[lo:hi], counters=batch.counters[lo:hi])

    for lo, hi in [(0, 1), (4, 5), (12, 13), (16, 17), (5, 8), (13, 16)]:
        assert _fused(x[lo:hi], part(lo, hi), 5, 2048, rows[lo:hi]).tolist() == whole[lo:hi], (lo, hi)


def test_codec_range_keeps_flagged_rows_below_the_limit():
    """The spare codes above the limit get the highest logits: unflagged rows draw them (greedy
    always, sampling nearly always), flagged rows never."""
    v, limit = 2051, 2048
    params = [SP(temperature=0.0), SP(temperature=1.0), SP(temperature=1.0, top_k=3), SP(temperature=2.0, top_p=0.9)]
    params = params * 2
    batch = _batch(params, seed0=1, counter0=0, device=DEVICE)
    x = torch.randn(len(params), v, generator=torch.Generator().manual_seed(2))
    x[:, limit:] = 12.0
    x = x.to(DEVICE)
    rows = torch.tensor([True] * 4 + [False] * 4, device=DEVICE)
    seen_above = False
    for codebook in range(4):
        got = _fused(x, batch, codebook, limit, rows).cpu()
        assert (got[:4] < limit).all(), got
        assert got[4] >= limit  # greedy, unflagged
        seen_above |= bool((got[5:] >= limit).all())
    assert seen_above


def test_strided_output_writes_its_column_only():
    v, b = 2051, 5
    params = _mixed_params(v)[:b]
    batch = _batch(params, seed0=4, counter0=2, device=DEVICE)
    x = _logits(b, v, torch.bfloat16, seed=4)
    frames = torch.full((b, K), -7, dtype=torch.int64, device=DEVICE)
    ret = _fused(x, batch, 3, out=frames[:, 3])
    want = _fused(x, batch, 3)
    assert ret.data_ptr() == frames[:, 3].data_ptr()
    assert frames[:, 3].tolist() == want.tolist()
    others = torch.cat([frames[:, :3], frames[:, 4:]], dim=1)
    assert (others == -7).all()


def test_padded_rows_and_degenerate_rows():
    """A [:, :V] view of wider rows (the columns past V are never read); rows of -inf and NaN
    (broken weights) still give a column of the row, as the next step's embedding needs."""
    v = 2051
    wide = _logits(6, v + 13, torch.float32, seed=6)
    wide[:, v:] = 1e4
    x = wide[:, :v]
    params = [SP(temperature=0.0), SP(temperature=1.0), SP(top_k=50), SP(top_p=0.8), SP(temperature=0.0), SP(min_p=0.1)]
    batch = _batch(params, seed0=6, counter0=1, device=DEVICE)
    assert _fused(x, batch, 2).tolist() == _reference(x, batch, 2, None, None).tolist()
    bad = x.clone()
    bad[0:2] = float("-inf")
    bad[2:4] = float("nan")
    bad[4, 7] = float("nan")
    got = _fused(bad, batch, 2).cpu()
    assert ((got >= 0) & (got < v)).all(), got


def test_the_tail_columns_past_the_block():
    """V = 2051 runs as 2048 lanes and a tail of 4 (row_split): the strongest codes in the tail,
    a tail code tied with the block's max (the first index wins, as torch.argmax), and a top-k
    whose threshold falls among tail codes all draw what the torch sampler draws."""
    from runner.kernels.codebook_sampling import row_split

    v = 2051
    assert row_split(v) == (2048, 4) and row_split(2048) == (2048, 0) and row_split(2100) == (4096, 0)
    assert [row_split(n) for n in (1, 2, 17, 65, 70)] == [(1, 0), (2, 0), (32, 0), (64, 1), (64, 8)]
    x = _logits(8, v, torch.float32, seed=8)
    x[0, 2050] = x[1, 2049] = 40.0  # the max in the tail
    x[2, 2048] = x[2, 17] = 40.0  # tied: column 17
    x[3, 2048:] = 30.0  # top-k 3 keeps exactly the tail
    x[4, 2048:] = 30.0
    x[4, 5] = 30.0  # top-k 3 among 4 tied: every tie survives (the kernel's rule and torch's)
    x[5:, 2048:] = float("nan")  # a broken tail is never drawn
    params = [SP(temperature=0.0), SP(top_k=1), SP(temperature=0.0), SP(top_k=3), SP(temperature=0.9, top_k=3),
              SP(temperature=0.0), SP(top_p=0.9), SP(min_p=0.1)]
    batch = _batch(params, seed0=8, counter0=2, device=DEVICE)
    got = _fused(x.to(DEVICE), batch, 3).cpu()
    assert got[:3].tolist() == [2050, 2049, 17] and 2048 <= got[3] < v
    assert (got[5:] < 2048).all()
    assert got.tolist() == _reference(torch.where(x.isnan(), float("-inf"), x), batch, 3, None, None).tolist()


def test_one_pass_span_reduction():
    """The compiled kernels' one-pass (min, max, mass) reduction of a search round; the
    interpreter otherwise runs three built-in ones (module note at _SPAN_REDUCE)."""
    v = 1000
    params = [SP(temperature=0.9, top_k=50), SP(top_p=0.8), SP(temperature=0.7, top_k=20, top_p=0.9)]
    batch = _batch(params, seed0=8, counter0=3, device=DEVICE)
    x = _logits(len(params), v, torch.bfloat16, seed=8)
    b = batch
    got = codebook_sample(x, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.counters, K, 4, NOISE_SALTS,
                          span_reduce=True)
    assert got.tolist() == _reference(x, batch, 4, None, None).tolist()


@triton.jit
def _div_kernel(x_ptr, t, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, _div(x, t, tl.div_rn(1.0, t)), mask=offs < n)


def test_scaling_is_torchs_division():
    """y = x / T bit for bit (a last-ulp difference would move a threshold or a race only
    rarely, so the sampler tests alone would not see it)."""
    # fma(a, a, -RN(a * a)) = 2^-46 with one rounding, 0 with two
    probe = torch.tensor([1.0 + 2.0**-23], dtype=torch.float32)
    sq = torch.empty(1, device=DEVICE)
    _fma_probe[(1,)](probe.to(DEVICE), sq)
    if sq.item() == 0.0:
        pytest.skip("this Triton interpreter's fma rounds twice")
    g = torch.Generator().manual_seed(12)
    x = torch.cat([torch.randn(1 << 15, generator=g) * 10.0 ** torch.randint(-3, 4, (1 << 15,), generator=g),
                   (torch.randn(1 << 15, generator=g) * 4).to(torch.bfloat16).float()]).to(DEVICE)
    out = torch.empty_like(x)
    for t in (0.05, 0.3, 0.7, 0.9, 1.0, 1.3, 1.7, 7.0, 99.5, 0.123456789):
        t32 = float(torch.tensor(t, dtype=torch.float32))
        _div_kernel[(triton.cdiv(x.numel(), 1024),)](x, t32, out, x.numel(), BLOCK=1024)
        # tensor by tensor, as the sampler's torch backend divides (per-row temperatures): CUDA
        # divides by a Python scalar as a multiply by its reciprocal, not correctly rounded
        assert torch.equal(out, x / torch.full_like(x, t32)), t


@triton.jit
def _fma_probe(a_ptr, out_ptr):
    a = tl.load(a_ptr)
    tl.store(out_ptr, tl.fma(a, a, -(a * a)))


def test_rejects_what_the_kernel_cannot_hold():
    batch = _batch([SP()], seed0=0, counter0=0, device=DEVICE)
    with pytest.raises(ValueError, match="V <="):
        _fused(torch.zeros(1, MAX_VOCAB + 1, device=DEVICE), batch, 0)
    with pytest.raises(ValueError, match="column stride"):
        _fused(torch.zeros(8, 2, device=DEVICE)[:, :1].t(), batch, 0)
    assert FusedCodebooks.max_vocab() == MAX_VOCAB


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os, subprocess, tempfile

    import triton.backends.nvidia as nv

    from runner.kernels import codebook_sampling as m
    from runner.layers.noise import NOISE_SALTS
    from tests.support.triton_interpreter import compile_sm90

    def local_memory_ops(cubin):  # spills: the row did not stay in registers
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            sass = subprocess.run([os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump"), "-sass", path],
                                  capture_output=True, text=True, check=True).stdout
        return sass.count("STL") + sass.count("LDL")

    sig = dict(x_ptr="*bf16", stride_x="i32", rows_ptr="*i1", limit="i32", temp_ptr="*fp32", topk_ptr="*i64",
               topp_ptr="*fp32", minp_ptr="*fp32", seed_ptr="*i64", ctr_ptr="*i64", num_codebooks="i32",
               codebook="i32", out_ptr="*i64", stride_o="i32", V="i32")
    # CSM's 2051 (2048 + a tail of 4), Qwen3-TTS's 2048, the largest, a small one
    for x_type, v, rng in (("*bf16", 2051, True), ("*fp32", 2051, False), ("*fp16", 2048, True),
                           ("*bf16", m.MAX_VOCAB, True), ("*bf16", 1000, False)):
        block, tail = m.row_split(v)
        k = compile_sm90(m._codebook_sample_kernel, dict(sig, x_ptr=x_type),
                         dict(HAS_RANGE=rng, BLOCK=block, TAIL=max(tail, 1), HAS_TAIL=tail > 0, NP=m._NP,
                              SPAN_REDUCE=True, SALT0=NOISE_SALTS[0], SALT1=NOISE_SALTS[1], SALT2=NOISE_SALTS[2]),
                         num_warps=m.num_warps(block), maxnreg=m.max_registers(m.num_warps(block)))
        assert local_memory_ops(k.asm["cubin"]) == 0, (x_type, v, rng)
    print("compiled")
    """
)


@pytest.mark.skipif(not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_kernel_compiles_for_sm90_without_spills():
    compile_offline(_COMPILE_SCRIPT, timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
def test_cuda_kernel_matches_the_torch_sampler_at_scale():
    """Many rows, every codebook of a frame, bf16 head outputs; also replayed in a CUDA graph."""
    v, b = 2051, 64
    base = _mixed_params(v)
    params = [base[i % len(base)] for i in range(b)]
    batch = _batch(params, seed0=77, counter0=100, device=DEVICE)
    rows = (torch.arange(b) % 2 == 0).to(DEVICE)
    sampler = FusedCodebooks(batch, K, 2048, rows)
    frames = torch.empty(b, K, dtype=torch.int64, device=DEVICE)
    xs = [_logits(b, v, torch.bfloat16, seed=1000 + c) for c in range(K)]
    for c in range(K):
        sampler(xs[c], c, frames[:, c])
        assert frames[:, c].tolist() == _reference(xs[c], batch, c, 2048, rows).tolist(), c
    graph_frames = torch.zeros_like(frames)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in range(K):
            sampler(xs[c], c, graph_frames[:, c])
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_frames, frames)
