"""Fused Triton elementwise kernels (runner/kernels/fused_ops.py, through runner/layers/triton_ops.py
TritonOps) vs the torch reference ops (runner/layers/ops.py TorchOps), and a whole tiny model run
with each; the registry's choice of backend per device (runner/layers/__init__.py).

On CUDA the kernels run compiled. Without CUDA they run under Triton's interpreter
(TRITON_INTERPRET=1, CPU tensors); without `triton` (CPU CI: the CPU torch wheel does not bring
it) the file is skipped. Where `triton`'s NVIDIA backend is installed, the kernels are also
compiled offline for sm_90 (no GPU needed) so a compile error shows up before a GPU run.

Tolerances: the kernels replicate every rounding of the torch path, so
* residual sums and 16-bit RoPE are bit-identical (products of two 16-bit floats are exact in
  fp32; the same sums are rounded once, RTNE, like torch);
* RMSNorm and SiLU may differ where fp32 reduction order / exp / rsqrt move a value across a
  rounding boundary of the model dtype: at most ~2 ulp there, on a small fraction of elements;
* fp32 RoPE may differ by an ulp or two (FMA contraction on the GPU).
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

_CUDA = interpret_without_cuda()  # before any runner module with Triton kernels is imported
triton = pytest.importorskip("triton", reason="triton not installed (CPU torch wheel does not bring it)")

from runner.config import ModelConfig  # noqa: E402
from runner.kernels.fused_ops import _rmsnorm_kernel  # noqa: E402
from runner.layers import make_attention, make_ops  # noqa: E402
from runner.layers.attention import (  # noqa: E402
    AttentionMetadata,
    TorchPagedAttention,
    allocate_kv_cache,
)
from runner.layers.ops import TorchOps  # noqa: E402
from runner.layers.triton_attention import TritonPagedAttention  # noqa: E402
from runner.layers.triton_ops import TritonOps  # noqa: E402
from runner.models.llama import build_empty_model  # noqa: E402
from runner.models.loader import load_model  # noqa: E402

DEVICE = "cuda" if _CUDA else "cpu"
INTERPRET = not _CUDA


if INTERPRET:
    interpreted_or_skip(_rmsnorm_kernel, "runner.kernels.fused_ops")

TORCH_OPS, TRITON_OPS = TorchOps(), TritonOps()
DTYPES = [torch.bfloat16, torch.float32, torch.float16]
_ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # ulp(x) <= this * |x|


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def _assert_close_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: float, max_frac: float) -> None:
    """|out - ref| <= `ulps` ulp of ref everywhere, and for 16-bit dtypes at most `max_frac` of
    the elements not bit-identical (catches a systematically wrong rounding, e.g. truncation)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    u = _ULP[ref.dtype]
    o, r = out.double(), ref.double()
    bound = ulps * u * r.abs() + 1e-30
    bad = (o - r).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements beyond {ulps} ulp; max err {(o - r).abs().max().item()}"
    frac = (out != ref).double().mean().item()
    assert ref.dtype == torch.float32 or frac <= max_frac, f"{frac:.2%} of elements differ"


def _rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(DEVICE, dtype)


# --- RMSNorm ---------------------------------------------------------------------------------

# Near-boundary flips are rare (fp32 reduction order / rsqrt): allow 2 ulp on < 1% of elements.
_NORM_ULPS = {torch.float32: 8.0, torch.bfloat16: 2.0, torch.float16: 2.0}


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("t,n", [(1, 64), (7, 96), (64, 256), (1, 3072), (7, 3072), (64, 1000)])
def test_add_rmsnorm(t, n, dtype):
    x = _rand(t, n, dtype=dtype, seed=0)
    res = _rand(t, n, dtype=dtype, seed=1, scale=4.0)
    w = (1.0 + _rand(n, dtype=torch.float32, seed=2, scale=0.1)).to(dtype)
    x0, res0 = x.clone(), res.clone()
    normed, new_res = TRITON_OPS.add_rmsnorm(x, res, w, 1e-6)
    ref_normed, ref_res = TORCH_OPS.add_rmsnorm(x, res, w, 1e-6)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched
    assert torch.equal(new_res, ref_res)  # the add rounds exactly like torch's
    _assert_close_ulps(normed, ref_normed, _NORM_ULPS[dtype], max_frac=0.01)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("t,n", [(1, 64), (7, 3072), (64, 128)])
def test_rmsnorm(t, n, dtype):
    x = _rand(t, n, dtype=dtype, seed=3, scale=3.0)
    w = (1.0 + _rand(n, dtype=torch.float32, seed=4, scale=0.1)).to(dtype)
    _assert_close_ulps(TRITON_OPS.rmsnorm(x, w, 1e-5), TORCH_OPS.rmsnorm(x, w, 1e-5), _NORM_ULPS[dtype], 0.01)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_dt)
@pytest.mark.parametrize("t,d", [(1, 32), (7, 64), (64, 128)])
def test_per_head_rmsnorm_on_strided_view(t, d, dtype):
    """Qwen3's q/k norms: [T, H, D] columns of the fused qkv output, normalised over D."""
    hq, hkv = 6, 2
    qkv = _rand(t, (hq + 2 * hkv) * d, dtype=dtype, seed=5, scale=2.0)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    w = (1.0 + _rand(d, dtype=torch.float32, seed=6, scale=0.1)).to(dtype)
    for x in (q, k):
        out = TRITON_OPS.rmsnorm(x, w, 1e-6)
        assert out.shape == x.shape and out.is_contiguous()
        _assert_close_ulps(out, TORCH_OPS.rmsnorm(x, w, 1e-6), _NORM_ULPS[dtype], 0.01)


# --- RoPE ------------------------------------------------------------------------------------


def _tables(p: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [P, D] cos/sin in RotaryEmbedding's cat(f, f) layout."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(p).float()[:, None] * inv[None, :]
    emb = torch.cat((f, f), dim=-1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


def _qkv_views(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """q, k, v as column views of one fused projection output (row stride (hq + 2 hkv) * d)."""
    qkv = _rand(t, (hq + 2 * hkv) * d, dtype=dtype, seed=seed)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    return qkv, q, k, v


def _check_rope(out: torch.Tensor, ref: torch.Tensor, x_in: torch.Tensor) -> None:
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)  # FMA contraction on the GPU
    elif out.is_cuda:
        # Compiled for the GPU, x*cos + rot(x)*sin may contract into an FMA before the one
        # rounding to bf16/fp16: the torch path rounds the products first. The two differ by
        # at most about one rounding of the products' size (which can be far above the
        # result's own ulp where they cancel) plus one ulp of the result.
        eps = torch.finfo(ref.dtype).eps
        half = x_in.shape[-1] // 2
        x = x_in.float()
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        bound = eps * (x.abs() + rot.abs()) + ref.float().abs() * eps + torch.finfo(ref.dtype).tiny
        err = (out.float() - ref.float()).abs()
        assert bool((err <= bound).all()), (err / bound).max().item()
    else:
        assert torch.equal(out, ref), (out.float() - ref.float()).abs().max().item()


_ROPE_CASES = [
    (1, 4, 2, 32),
    (7, 4, 2, 64),
    (64, 24, 8, 128),  # Orpheus-3B heads (24 padded to 32 in the kernel)
    (7, 6, 6, 128),  # MHA, non-power-of-two heads
]


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("t,hq,hkv,d", _ROPE_CASES)
def test_rope_in_place_on_strided_views(t, hq, hkv, d, dtype):
    p = 300
    cos, sin = _tables(p, d)
    qkv, q, k, v = _qkv_views(t, hq, hkv, d, dtype, seed=7)
    positions = torch.randint(0, p, (t,), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    q_in, k_in = q.clone(), k.clone()
    ref_q, ref_k = TORCH_OPS.rope(q, k, cos, sin, positions)
    v0 = v.clone()
    out_q, out_k = TRITON_OPS.rope(q, k, cos, sin, positions)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    _check_rope(q, ref_q, q_in)
    _check_rope(k, ref_k, k_in)
    assert torch.equal(v, v0)  # the v columns of qkv are untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_dt)
@pytest.mark.parametrize("t,hq,hkv,d", _ROPE_CASES[:3])
def test_rope_write_kv_matches_rope_then_write_kv(t, hq, hkv, d, dtype):
    nb, bs, p = 40, 16, 4096
    cos, sin = _tables(p, d)
    g = torch.Generator().manual_seed(9)
    positions = torch.randint(0, p, (t,), generator=g).to(DEVICE)
    slots = torch.randperm(nb * bs, generator=g)[:t].to(DEVICE)  # distinct, scrambled flat slots
    cache = _rand(2, nb, bs, hkv, d, dtype=dtype, seed=10)
    ref_cache = cache.clone()
    _, q, k, v = _qkv_views(t, hq, hkv, d, dtype, seed=11)
    q_in, k_in = q.clone(), k.clone()
    ref_q, ref_k = TORCH_OPS.rope_write_kv(q, k, v, cos, sin, positions, ref_cache, slots)
    out_q, out_k = TRITON_OPS.rope_write_kv(q, k, v, cos, sin, positions, cache, slots)
    _check_rope(out_q, ref_q, q_in)
    _check_rope(out_k, ref_k, k_in)
    # written slots hold rotated k (checked above through out_k) and raw v; the rest untouched
    flat, ref_flat = cache.view(2, nb * bs, hkv, d), ref_cache.view(2, nb * bs, hkv, d)
    others = torch.ones(nb * bs, dtype=torch.bool, device=flat.device)
    others[slots] = False
    assert torch.equal(flat[:, others], ref_flat[:, others])
    assert torch.equal(flat[0][slots], out_k) and torch.equal(flat[1][slots], v)


# --- SiLU * mul ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("t,inter", [(1, 64), (7, 1000), (64, 3072), (1, 8192)])
def test_silu_and_mul(t, inter, dtype):
    gate_up = _rand(t, 2 * inter, dtype=dtype, seed=12, scale=3.0)
    out = TRITON_OPS.silu_and_mul(gate_up)
    ref = TORCH_OPS.silu_and_mul(gate_up)
    # exp differs by an fp32 ulp or so between implementations: rare one-ulp flips after rounding.
    _assert_close_ulps(out, ref, 2.0 if dtype != torch.float32 else 8.0, max_frac=0.01)


def test_zero_tokens():
    x = torch.empty(0, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    assert TRITON_OPS.rmsnorm(x, w, 1e-6).shape == (0, 64)
    assert TRITON_OPS.add_rmsnorm(x, x, w, 1e-6)[1].shape == (0, 64)
    assert TRITON_OPS.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
    cos, sin = _tables(8, 32)
    q, k = torch.empty(0, 4, 32, device=DEVICE), torch.empty(0, 2, 32, device=DEVICE)
    TRITON_OPS.rope(q, k, cos, sin, torch.empty(0, dtype=torch.int64, device=DEVICE))


# --- whole model -----------------------------------------------------------------------------


def test_registry_selects_by_device():
    assert isinstance(make_ops(None, "cpu"), TorchOps)
    assert isinstance(make_attention(None, "cpu"), TorchPagedAttention)
    if _CUDA:
        assert isinstance(make_ops(None, "cuda"), TritonOps)
        assert isinstance(make_attention(None, "cuda"), TritonPagedAttention)


@pytest.mark.parametrize("backend", [TorchPagedAttention, TritonPagedAttention])
def test_attention_backends_declare_every_capability(backend):
    """Callers read capabilities as attributes (no getattr defaults): each backend sets all."""
    attn = backend()
    for cap in ("supports_token_rows", "accepts_prewritten_kv", "decodes_from_cache", "fuses_decode_rope"):
        assert isinstance(getattr(attn, cap), bool), cap


class _Paged:
    """Scrambled block bookkeeping (like tests/models/test_models.py's PagedSequences, on DEVICE)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.bs = block_size
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]]):
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for sid, toks in chunks:
            start = self.lens.get(sid, 0)
            blocks = self.blocks.setdefault(sid, [])
            for p in range(start, start + len(toks)):
                if p // self.bs == len(blocks):
                    blocks.append(self.free.pop())
                slots.append(blocks[p // self.bs] * self.bs + p % self.bs)
                pos.append(p)
            ids += toks
            self.lens[sid] = start + len(toks)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(self.lens[sid])
        width = max(len(self.blocks[sid]) for sid, _ in chunks) + 1
        table = [self.blocks[sid] + [0] * (width - len(self.blocks[sid])) for sid, _ in chunks]

        def dev(x, dt):
            return torch.tensor(x, dtype=dt, device=DEVICE)

        meta = AttentionMetadata(
            query_start_loc=dev(qsl, torch.int32),
            seq_lens=dev(seq_lens, torch.int32),
            block_tables=dev(table, torch.int32),
            slot_mapping=dev(slots, torch.int64),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
        )
        return dev(ids, torch.int64), dev(pos, torch.int64), meta


_MODELS = {
    "llama": dict(rope_llama3=True),
    "qwen2": dict(tie=True),  # q/k/v bias
    "qwen3": dict(head_dim=32),  # per-head q/k norms
}


@pytest.fixture(scope="module", params=sorted(_MODELS))
def tiny(request, tiny_model_dir):
    pytest.importorskip("transformers")
    family = request.param
    path = tiny_model_dir(family, seed=3, **_MODELS[family])
    return ModelConfig.from_pretrained(path)


def _with_ops(weights: torch.nn.Module, cfg: ModelConfig, ops, attn, dtype: torch.dtype):
    """A model with explicit ops/attention and the same weights as `weights`."""
    model = build_empty_model(cfg, DEVICE, dtype, attn=attn, ops=ops)
    model.load_state_dict(weights.state_dict())
    return model


@torch.no_grad()
def _run(model, cfg: ModelConfig, dtype: torch.dtype):
    """Prefill two prompts (one chunked), then decode steps; every step's logits, the captured
    hidden states of the first step, and the final KV caches."""
    seqs = _Paged(48, 4)
    kv = allocate_kv_cache(cfg, 48, 4, DEVICE, dtype)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 14)]
    logits, captured = [], None
    chunks = [(0, prompts[0]), (1, prompts[1][:10])]
    for step in range(4):
        ids, pos, meta = seqs.step(chunks)
        hidden, cap = model(ids, pos, kv, meta, capture_layers=(0, 1, cfg.num_layers))
        captured = captured or cap
        out = model.compute_logits(hidden)
        logits.append(out)
        last = [int(out[meta.query_start_loc[b + 1] - 1].argmax()) for b in range(len(chunks))]
        # step 1 mixes a decode with seq 1's remaining prompt; then pure decode (T == B)
        chunks = [(0, [last[0]]), (1, prompts[1][10:] if step == 0 else [last[1]])]
    return logits, captured, kv


@pytest.mark.parametrize("fused_kv", [False, True], ids=["torch-attn", "triton-attn-fused-kv"])
def test_model_with_triton_ops_matches_torch_ops(tiny, fused_kv):
    """The same fp32 weights through TorchOps and TritonOps: logits, hidden states and KV agree
    to fp32 tolerance. With TritonPagedAttention the KV write rides in the RoPE launch."""
    dtype = torch.float32
    weights = load_model(tiny, torch.device(DEVICE), dtype)
    attn = TritonPagedAttention() if fused_kv else TorchPagedAttention()
    model = _with_ops(weights, tiny, TRITON_OPS, attn, dtype)
    assert all(layer.self_attn.fuse_kv_write == fused_kv for layer in model.layers)
    ref = _with_ops(weights, tiny, TORCH_OPS, TorchPagedAttention(), dtype)
    got_logits, got_cap, got_kv = _run(model, tiny, dtype)
    ref_logits, ref_cap, ref_kv = _run(ref, tiny, dtype)
    for a, b in zip(got_logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    for layer in ref_cap:
        torch.testing.assert_close(got_cap[layer], ref_cap[layer], rtol=0, atol=1e-5)
    for a, b in zip(got_kv, ref_kv):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


# Llama-shaped, GQA 4/2 heads, D 64: the bf16 model tests
_BF16_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 256,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@torch.no_grad()
def test_model_bf16_triton_ops_close_to_torch_ops():
    """bf16 end to end (Llama-shaped, GQA 4/2 heads, D 64): logits agree to bf16 tolerance."""
    from runner.models.llama import build_random_model

    cfg = ModelConfig.from_dict(_BF16_LLAMA)
    dtype = torch.bfloat16
    ref = build_random_model(cfg, DEVICE, dtype, seed=2, attn=TorchPagedAttention(), ops=TORCH_OPS)
    model = _with_ops(ref, cfg, TRITON_OPS, TorchPagedAttention(), dtype)
    got, _, _ = _run(model, cfg, dtype)
    want, _, _ = _run(ref, cfg, dtype)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=3e-2)


@pytest.mark.parametrize("parts,t,n", [(2, 3, 64), (4, 1, 3072), (3, 5, 100)])
def test_add_rmsnorm_of_split_k_partials(parts, t, n):
    """x given as split-K partials: summed in split order in fp32 and rounded once, bit for bit
    what materialize() returns and what add_rmsnorm of that tensor gives."""
    from runner.kernels.linear import Partials, materialize

    g = torch.Generator().manual_seed(parts * 100 + n)
    p = torch.randn(parts, t, n, generator=g).to(DEVICE)
    res = torch.randn(t, n, generator=g).to(DEVICE, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(DEVICE, torch.bfloat16)
    h = Partials(p, torch.bfloat16)
    dense = materialize(h)
    seq = p[0].clone()
    for q in p[1:]:
        seq = seq + q
    assert dense.dtype == torch.bfloat16 and torch.equal(dense, seq.to(torch.bfloat16))
    normed, new_res = TRITON_OPS.add_rmsnorm(h, res, w, 1e-6)
    ref_normed, ref_res = TRITON_OPS.add_rmsnorm(dense, res, w, 1e-6)
    assert torch.equal(new_res, ref_res) and torch.equal(normed, ref_normed)
    assert TRITON_OPS.materialize(h).data_ptr() != p.data_ptr() and TORCH_OPS.materialize(dense) is dense


@torch.no_grad()
def test_model_with_split_k_into_norm(monkeypatch):
    """o_proj and down as split-K partials summed by the add + RMSNorm (tile table pointed at
    this model's shapes): logits and captured hidden states (materialize) stay within bf16
    tolerance of TorchOps, and the split path is really taken."""
    import dataclasses

    from runner.kernels import linear as triton_linear
    from runner.kernels.linear import LinearTile
    from runner.models.llama import build_random_model

    cfg = ModelConfig.from_dict(_BF16_LLAMA)
    tile = LinearTile(16, 32, 64, 4, 2)
    split = {(256, 256): ((64, tile, 2),), (256, 384): ((64, tile, 3),)}
    ops = TritonOps(tables=dataclasses.replace(triton_linear.REFERENCE, split=split))
    calls = []
    real = triton_linear.skinny_linear

    def spy(*a, **k):
        calls.append(k.get("split_k", 1))
        return real(*a, **k)

    import runner.layers.triton_ops as tfo

    monkeypatch.setattr(tfo, "skinny_linear", spy)
    dtype = torch.bfloat16
    ref = build_random_model(cfg, DEVICE, dtype, seed=3, attn=TorchPagedAttention(), ops=TORCH_OPS)
    model = _with_ops(ref, cfg, ops, TorchPagedAttention(), dtype)
    got, got_cap, _ = _run(model, cfg, dtype)
    want, want_cap, _ = _run(ref, cfg, dtype)
    assert 2 in calls and 3 in calls
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=3e-2)
    for layer in want_cap:
        torch.testing.assert_close(got_cap[layer].float(), want_cap[layer].float(), rtol=0, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="CUDA graphs need a CUDA device")
@torch.no_grad()
def test_decode_step_cuda_graph_replay_matches_eager():
    """A whole decode step (TritonOps with the KV write fused into RoPE, Triton attention)
    captured once and replayed with new ids/positions/slots/tables equals the eager step."""
    from runner.models.llama import build_random_model

    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 256,
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,  # D = 64
            "max_position_embeddings": 512,
        }
    )
    dtype, b, nb, bs, mb = torch.bfloat16, 4, 64, 16, 8
    model = build_random_model(cfg, DEVICE, dtype, seed=0)
    assert isinstance(model.ops, TritonOps) and model.layers[0].self_attn.fuse_kv_write
    kv = [torch.randn(2, nb, bs, cfg.num_kv_heads, cfg.head_dim, device=DEVICE, dtype=dtype) for _ in range(2)]
    ids = torch.zeros(b, dtype=torch.int64, device=DEVICE)
    pos = torch.zeros(b, dtype=torch.int64, device=DEVICE)
    slots = torch.zeros(b, dtype=torch.int64, device=DEVICE)
    seq_lens = torch.ones(b, dtype=torch.int32, device=DEVICE)
    tables = torch.zeros(b, mb, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=seq_lens, block_tables=tables, slot_mapping=slots, max_query_len=1, max_seq_len=mb * bs,
    )  # fmt: skip

    def fill(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, mb * bs, (b,), generator=g)
        perm = torch.randperm(nb, generator=g)[: b * mb].view(b, mb).to(torch.int32)
        p = lens - 1
        seq_lens.copy_(lens)
        tables.copy_(perm)
        pos.copy_(p)
        slots.copy_(perm[torch.arange(b), p // bs].long() * bs + p % bs)
        ids.copy_(torch.randint(0, cfg.vocab_size, (b,), generator=g))

    def step(caches):
        return model.compute_logits(model(ids, pos, caches, meta)[0])

    fill(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile every kernel outside the capture
        step([c.clone() for c in kv])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step(kv)
    for seed in (1, 2, 3):
        fill(seed)
        eager_kv = [c.clone() for c in kv]
        want = step(eager_kv)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-3)
        for a, e in zip(kv, eager_kv):
            assert torch.equal(a, e)


# --- offline sm_90 compile -------------------------------------------------------------------

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from runner.kernels import fused_ops as m
    from tests.support.triton_interpreter import compile_sm90

    def build(fn, sig, consts, warps):  # each kernel as the decode path launches it: with PDL
        compile_sm90(fn, sig, dict(consts, USE_GDC=True), num_warps=warps, launch_pdl=True)

    ptr = "*bf16"
    norm_sig = dict(x_ptr=ptr, res_ptr=ptr, w_ptr=ptr, out_ptr=ptr, res_out_ptr=ptr, rows_inner="i32",
                    stride_xo="i32", stride_xi="i32", stride_ro="i32", stride_ri="i32", n_cols="i32",
                    eps="fp32", stride_part="i32")
    for has_res, n, parts in ((True, 3072, 0), (False, 3072, 0), (False, 128, 0), (True, 3072, 8)):
        block = triton.next_power_of_2(n)
        sig = dict(norm_sig, x_ptr="*fp32") if parts else norm_sig
        build(m._rmsnorm_kernel, sig, dict(HAS_RESIDUAL=has_res, BLOCK_N=block, NUM_PARTS=parts), m._norm_warps(block))
    rope_sig = dict(q_ptr=ptr, k_ptr=ptr, v_ptr=ptr, cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64",
                    kv_ptr=ptr, slot_ptr="*i64", stride_qt="i32", stride_qh="i32", stride_kt="i32",
                    stride_kh="i32", stride_vt="i32", stride_vh="i32", stride_cos="i32", stride_sin="i32",
                    stride_kv="i64", stride_slot="i32", stride_kvh="i32", max_pos="i32")
    for write in (False, True):
        build(m._rope_kernel, rope_sig, dict(HQ=24, HKV=8, HQ_P=32, HKV_P=8, HALF=64, HALF_P=64,
                                             ROUND=True, WRITE_KV=write), 4)
    build(m._silu_and_mul_kernel, dict(x_ptr=ptr, out_ptr=ptr, stride_xt="i32", inter="i32"),
          dict(BLOCK=m._SILU_BLOCK), 4)
    print("compiled")
    """
)


@pytest.mark.skipif(not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_kernels_compile_for_sm90():
    """Lowering errors the interpreter cannot see, without a GPU."""
    compile_offline(_COMPILE_SCRIPT, timeout=300)
