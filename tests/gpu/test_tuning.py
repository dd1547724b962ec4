"""RunnerConfig.tuning on CUDA: the device's tuning tables ("auto") against the generic path
("none": cuBLAS for every GEMM, the always-valid default attention, SNAC and sampling launches),
on the tiny models. Skipped without a GPU (run on the lent H200, where "auto" is the H200 table).

The generic path must be a correct engine on its own, the proof that a GPU with no table runs:

* fp32: the same greedy tokens as the tuned path. fp32 GEMMs run in cuBLAS on both paths
  (TritonOps keeps Triton GEMMs to 16-bit dtypes), so only the attention launch choices differ
  (tile length, stages, block-table chunks, split counts): the fp32 order of the softmax sums,
  far below any logit gap a greedy pick depends on in these models.
* bf16: no Triton GEMM launch at all on "none" (the tuned path launches them: the H200 table's
  default tiles cover the tiny shapes), and every request runs to its length. Token equality is
  not asserted in bf16: a Triton tile and cuBLAS accumulate the K sums in different orders, so
  activations differ by bf16 ulps, a random tiny model has near-tied logits where one ulp flips
  a greedy pick, and from there on that request continues from another token (measured on the
  H200: 190 of 288 positions equal on the tiny Llama, at least 90% on the tiny Qwen3). The token
  proof is the fp32 test above; the bf16 numerics are held to transformers by
  tests/gpu/test_gpu.py's logit / hidden-state tolerance tests.
* the codec stage: "none" decodes with the safe SNAC tiles, "auto" with the table's; same PCM
  within the fused decoder's tolerance.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runner.config import EngineConfig
from runner.engine.engine import Engine
from runner.kernels.tuning import GENERIC, load_tables, read_table
from streaming.sampling_params import SamplingParams
from tests.engine.test_engine import prompts_of, run_staggered

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
# the Triton GEMM launchers TritonOps calls (runner/layers/triton_ops.py's module names)
TRITON_GEMMS = ("skinny_linear", "residual_linear", "head_argmax", "qkv_rope_write")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tiny_model_dir):
    fam = request.param
    return tiny_model_dir(fam, seed=7, head_dim=64 if fam != "qwen3" else 32)


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 GEMMs in full fp32 (cuBLAS may otherwise round to tf32: another source of ulps)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _engine(path, dtype: str, tuning: str) -> Engine:
    """An engine with CUDA graphs and async scheduling on, as served, at this tuning; its backends
    hold the tables the registry looked up once for it."""
    cfg = EngineConfig.build(path, device="cuda", dtype=dtype, max_model_len=256, max_num_batched_tokens=128,
                             max_num_seqs=16, block_size=16, num_blocks=256)
    assert cfg.runner.tuning == "auto"  # the default
    eng = Engine(cfg.with_(runner=replace(cfg.runner, tuning=tuning)))
    tables = load_tables("cuda", tuning)
    assert eng.model.ops.tables is tables.linear and eng.model.attn.tuning is tables.attention
    return eng


@pytest.fixture()
def triton_gemm_calls(monkeypatch) -> list[str]:
    """Counts the Triton GEMM launches TritonOps makes (skinny, residual, fused head, qkv + RoPE)."""
    import runner.layers.triton_ops as tops

    calls: list[str] = []
    for name in TRITON_GEMMS:
        real = getattr(tops, name)
        monkeypatch.setattr(tops, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    return calls


def test_the_h200_takes_its_table():
    """"auto" on an H200 is the H200 table (the tuned side of these tests is really tuned)."""
    if "H200" not in torch.cuda.get_device_name():
        pytest.skip("checks the H200's table")
    assert load_tables("cuda").name == "nvidia_h200" and load_tables("cuda", "none") is GENERIC


def test_untuned_path_gives_the_tuned_tokens_fp32(model_dir):
    prompts = prompts_of([5, 11, 20, 9, 1, 30], 512, seed=21)
    got = run_staggered(_engine(model_dir, "float32", "auto"), prompts, GREEDY)
    assert run_staggered(_engine(model_dir, "float32", "none"), prompts, GREEDY) == got


def test_untuned_path_runs_no_triton_gemm_and_keeps_bf16_tokens(model_dir, triton_gemm_calls):
    prompts = prompts_of([5, 11, 20, 9, 1, 30], 512, seed=22)
    got = run_staggered(_engine(model_dir, "bfloat16", "auto"), prompts, GREEDY)
    if load_tables("cuda").tuned:  # a GPU with a table (the H200): its default tiles run the tiny GEMMs
        assert triton_gemm_calls
    triton_gemm_calls.clear()
    # counted from the engine's construction on: warm-up and graph capture included
    ref = run_staggered(_engine(model_dir, "bfloat16", "none"), prompts, GREEDY)
    assert triton_gemm_calls == []  # "none": cuBLAS for every GEMM
    assert [len(r) for r in got] == [len(r) for r in ref] == [GREEDY.max_tokens] * len(prompts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_untuned_codec_takes_the_safe_tiles(tiny_snac_dir, dtype):
    """The codec stage on "none" decodes with the safe SNAC tiles (no SFU sine), on "auto" with
    the table's; fp32: the same PCM (fp32 tiles differ only in the order of the tl.dot sums);
    bf16: both within twice the bf16 torch path's own distance from the fp32 decode (the bar
    tests/kernels/test_snac_kernels.py holds the fused bf16 decoder to)."""
    from runner.codecs.config import CodecConfig
    from runner.codecs.decoder import SnacWindowDecoder
    from runner.codecs.snac import load_snac
    from runner.codecs.stage import CodecStage
    from runner.kernels.tuning.tiles import SAFE_SNAC_TILES

    dev = torch.device("cuda")
    cfg = CodecConfig(path=str(tiny_snac_dir), codebook_size=64, cuda_graphs=False)
    auto = CodecStage(cfg, dev, dtype, tuning="auto").decoder
    none = CodecStage(cfg, dev, dtype, tuning="none").decoder
    assert auto.kernels == none.kernels == "triton"
    assert none.fused.tiles == SAFE_SNAC_TILES
    assert auto.fused.tiles in (load_tables("cuda").snac.tiles(dtype), SAFE_SNAC_TILES)  # (retried if too big)
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 64, (4, 6, 7), generator=g).to(dev)
    start = torch.tensor([0, 5, 17, 40]).to(dev)
    seeds = torch.tensor([1, 2, 3, 4]).to(dev)
    a, b = auto.decode(codes, start, seeds).float(), none.decode(codes, start, seeds).float()
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        return
    want = SnacWindowDecoder(load_snac(cfg, dev), 2048, kernels="torch").decode(codes, start, seeds).float()
    bar = max(64 / 32767, 2 * float((none.decode_torch(codes, start, seeds).float() - want).abs().max()))
    assert float((a - want).abs().max()) <= bar and float((b - want).abs().max()) <= bar


def test_every_h200_linear_row_equals_cublas():
    """Every tile the H200 table's linear rows name, at the row counts of its bucket, gives
    F.linear's product (gated rows: silu(gate) * up) within a bf16 rounding: the rows come from
    timing sweeps, which compare no values."""
    import torch.nn.functional as F

    from runner.kernels.linear import GATED, skinny_linear

    lin = read_table("nvidia_h200").linear
    g = torch.Generator(device="cuda").manual_seed(0)
    for (kind, n, k), rows in sorted(lin.tuned.items()):
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k**0.5
        lo = 1
        for max_m, tile in rows:
            for m in sorted({lo, max_m}):
                x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
                if tile is None:
                    continue
                ref = F.linear(x.float(), w.float())
                if kind == GATED:
                    gate, up = ref.chunk(2, dim=-1)
                    ref = F.silu(gate) * up
                got = skinny_linear(x, w, None, tile, gated=kind == GATED).float()
                torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2, msg=lambda s: f"{kind, n, k, m, tile}: {s}")
            lo = max_m + 1
