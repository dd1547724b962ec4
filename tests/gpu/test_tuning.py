"""RunnerConfig.tuning on CUDA: the device's tuning tables ("auto") against the generic path
("none": cuBLAS for every GEMM, the always-valid default attention tiles), on the tiny models.
Skipped without a GPU (run on the lent H200).

The generic path must be a correct engine on its own: same greedy tokens as the tuned one in
fp32 (where only the attention tiles differ: fp32 order of the softmax sums, which cannot flip
a greedy choice on these models), and in bf16 (Triton GEMM tiles against cuBLAS: another
accumulation order, bf16 ulps in the activations) the same tokens on nearly every position.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runner.config import EngineConfig
from runner.engine.engine import Engine
from streaming.sampling_params import SamplingParams
from tests.engine.test_engine import prompts_of, run_staggered
from tests.support.tiny_models import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    fam = request.param
    return make_tiny_model(fam, tmp_path_factory.mktemp(fam), seed=7, head_dim=64 if fam != "qwen3" else 32)


def _engines(path, dtype: str) -> tuple[Engine, Engine]:
    cfg = EngineConfig.build(path, device="cuda", dtype=dtype, max_model_len=256, max_num_batched_tokens=128,
                             max_num_seqs=16, block_size=16, num_blocks=256)
    assert cfg.runner.tuning == "auto"
    return Engine(cfg), Engine(cfg.with_(runner=replace(cfg.runner, tuning="none")))


@pytest.fixture()
def triton_gemm_calls(monkeypatch):
    """Counts the Triton GEMM launches TritonOps makes (skinny, residual, fused head)."""
    import runner.layers.triton_ops as tops

    calls: list[str] = []
    for name in ("skinny_linear", "residual_linear", "head_argmax", "qkv_rope_write"):
        real = getattr(tops, name)
        monkeypatch.setattr(tops, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    return calls


def test_untuned_path_gives_the_tuned_tokens_fp32(model_dir):
    prompts = prompts_of([5, 11, 20, 9, 1, 30], 512, seed=21)
    auto, none = _engines(model_dir, "float32")
    assert run_staggered(auto, prompts, GREEDY) == run_staggered(none, prompts, GREEDY)


def test_untuned_path_runs_no_triton_gemm_and_keeps_bf16_tokens(model_dir, triton_gemm_calls):
    from runner.kernels.tuning import load_tables

    prompts = prompts_of([5, 11, 20, 9, 1, 30], 512, seed=22)
    auto, none = _engines(model_dir, "bfloat16")
    got = run_staggered(auto, prompts, GREEDY)
    tuned_calls = len(triton_gemm_calls)
    if load_tables("cuda").tuned:  # a GPU with a table (the H200): its default tiles run the tiny GEMMs
        assert tuned_calls > 0
    triton_gemm_calls.clear()
    ref = run_staggered(none, prompts, GREEDY)
    assert triton_gemm_calls == []  # "none": cuBLAS for every GEMM
    assert [len(r) for r in got] == [len(r) for r in ref]
    same = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r))
    total = sum(len(r) for r in ref)
    assert same / total >= 0.9, (same, total)
