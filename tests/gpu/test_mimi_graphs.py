"""Mimi's streaming decode on CUDA through captured graphs (runner/codecs/mimi_graphs.py): the
streams' PCM equals the eager stage's and transformers' offline decode of the same frames, each
sample once, with streams joining, ending and decoding in chunks of several lengths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.codecs.decoder import float_to_s16
from runner.codecs.mimi import load_mimi
from runner.codecs.mimi_stage import MimiCodecConfig, MimiCodecStage
from tests.support.tiny_models import make_tiny_mimi

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
K, SIZE = 8, 64


def run(stage: MimiCodecStage, frames: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stream i joins at step i, one frame per step; its PCM, concatenated."""
    out: dict[str, list] = {k: [] for k in frames}
    sent = dict.fromkeys(frames, 0)
    step = 0
    while step == 0 or len(stage):
        for i, (key, f) in enumerate(frames.items()):
            if step == i:
                stage.open(key)
            if i <= step and sent[key] < len(f):
                stage.push_many([(key, f[sent[key]])])
                sent[key] += 1
                if sent[key] == len(f):
                    stage.close(key)
        for key, r in stage.step().items():
            assert r.error is None, r.error
            out[key].append(r.pcm)
        step += 1
    return {k: np.concatenate(v) for k, v in out.items()}


@pytest.fixture
def no_tf32():
    # cuDNN convolutions default to TF32 (10-bit mantissa): the graph's padded batches pick other
    # algorithms than the eager calls, and TF32 rounding then differs by tens of LSB; in full
    # fp32 the paths must agree to rounding
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def test_graph_decode_equals_eager_and_offline(tmp_path, no_tf32):
    path = make_tiny_mimi(tmp_path / "mimi", seed=0)
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    frames = {f"s{i}": rng.integers(0, SIZE, size=(n, K)) for i, n in enumerate((23, 5, 17, 1, 31))}
    cfg = dict(path=str(path), max_streams=8, max_batch_rows=4, max_chunk_frames=8)
    graphed = MimiCodecStage(MimiCodecConfig(**cfg), dev, torch.float32)
    assert graphed.decoder.graphs is not None and graphed.decoder.graphs.graphs
    replays = []
    orig = graphed.decoder.graphs.run
    graphed.decoder.graphs.run = lambda *a: replays.append(a[0]) or orig(*a)
    got = run(graphed, frames)
    eager = run(MimiCodecStage(MimiCodecConfig(**cfg, cuda_graphs=False), dev, torch.float32), frames)
    assert len(replays) > 5
    model = load_mimi(path, dev)
    for key, f in frames.items():
        assert len(got[key]) == 1920 * len(f)
        assert np.abs(got[key].astype(np.int32) - eager[key].astype(np.int32)).max() <= 1
        with torch.inference_mode():
            ref = float_to_s16(model.decode(torch.from_numpy(f.T[None].copy()).to(dev)).audio_values[0, 0]).cpu().numpy()
        assert np.abs(got[key].astype(np.int32) - ref.astype(np.int32)).max() <= 1
