"""The codebook samplers' common contract on the CPU, without triton (runner/models/csm_sampling.py):
logits in bf16 are drawn as their float32 values, `out` receives the ids in place (a column of
the frames), the codec range keeps flagged rows below the limit. The fused kernel's equality with
these is tests/kernels/test_codebook_sampling.py."""

from __future__ import annotations

import pytest
import torch

from runner.layers.sampler import Sampler
from runner.layers.sampling_batch import SamplingBatch
from runner.models.csm_sampling import CodecRange, FusedCodebooks, GreedyCodebooks, RaceCodebooks
from streaming.sampling_params import SamplingParams as SP

K = 32


def _batch() -> SamplingBatch:
    params = [SP(temperature=0.0), SP(temperature=0.9, top_k=50), SP(top_p=0.8), SP(min_p=0.1)]
    return SamplingBatch.build(params, [0, 1, 2, 3], [11, 12, 13, 14], [5, 6, 7, 8], [], "cpu")


def _samplers(batch: SamplingBatch, v: int):
    race = RaceCodebooks(Sampler("cpu", backend="torch"), batch, K)
    rows = torch.tensor([True, False, True, False])
    return {"greedy": GreedyCodebooks(), "race": race, "range": CodecRange(race, v - 3, rows, v)}


@pytest.mark.parametrize("kind", ["greedy", "race", "range"])
def test_bf16_logits_draw_their_float_values_into_out(kind):
    v = 2051
    batch = _batch()
    x = (torch.randn(4, v, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    want = _samplers(batch, v)[kind](x.float(), 9)
    frames = torch.full((4, K), -1, dtype=torch.int64)
    got = _samplers(batch, v)[kind](x.clone(), 9, frames[:, 9])
    assert got.data_ptr() == frames[:, 9].data_ptr()
    assert frames[:, 9].tolist() == want.tolist()
    assert (frames[:, :9] == -1).all() and (frames[:, 10:] == -1).all()


def test_codec_range_rows():
    v, limit = 2051, 2048
    batch = _batch()
    x = torch.randn(4, v, generator=torch.Generator().manual_seed(2))
    x[:, limit:] = 20.0
    race = RaceCodebooks(Sampler("cpu", backend="torch"), batch, K)
    got = CodecRange(race, limit, torch.tensor([True, True, False, False]), v)(x, 0)
    assert (got[:2] < limit).all() and (got[2:] >= limit).all(), got


def test_fused_codebooks_takes_limit_and_rows_together():
    with pytest.raises(ValueError, match="limit and rows"):
        FusedCodebooks(_batch(), K, limit=2048)
    with pytest.raises(ValueError, match="limit and rows"):
        FusedCodebooks(_batch(), K, rows=torch.ones(4, dtype=torch.bool))
