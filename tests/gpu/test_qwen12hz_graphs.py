"""Qwen3-TTS's 12 Hz codec on CUDA through captured graphs (runner/codecs/mimi_graphs.py over
the 12 Hz decoder's `_decode_into`) and asynchronous launches (Qwen12HzCodecStage): the streams'
PCM equals the eager stage's, each sample once, with streams joining, ending and decoding in
chunks of several lengths while launches are in flight; a stream primed with reference frames
(ICL) equals the tail of the eager decode of reference + frames; the encoder runs on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.codecs.mimi_stage import MimiCodecConfig
from runner.codecs.qwen12hz_stage import Qwen12HzCodecStage
from tests.gpu.test_mimi_graphs import assert_close, no_tf32, run  # noqa: F401  (no_tf32: a fixture)
from tests.support.tiny_qwen12hz import make_tiny_qwen12hz

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
K, SIZE = 16, 32


def test_graph_decode_equals_eager(tmp_path, no_tf32):
    path = make_tiny_qwen12hz(tmp_path / "codec", seed=0, encoder=True)
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    frames = {f"s{i}": rng.integers(0, SIZE, size=(n, K)) for i, n in enumerate((23, 5, 17, 1, 31))}
    cfg = dict(path=str(path), max_streams=8, max_batch_rows=4, max_chunk_frames=8)
    graphed = Qwen12HzCodecStage(MimiCodecConfig(**cfg), dev, torch.float32)
    assert graphed.decoder.graphs is not None and graphed.decoder.graphs.graphs
    replays = []
    orig = graphed.decoder.graphs.launch
    graphed.decoder.graphs.launch = lambda *a: replays.append(a[0]) or orig(*a)
    got = run(graphed, frames, hold_every=3)
    eager_stage = Qwen12HzCodecStage(MimiCodecConfig(**cfg, cuda_graphs=False), dev, torch.float32)
    eager = run(eager_stage, frames)
    assert len(replays) > 5
    for key, f in frames.items():
        assert len(got[key]) == 1920 * len(f)
        assert_close(got[key], eager[key])
        assert np.abs(got[key]).max() > 100

    # ICL: a stream primed with a reference's frames = the tail of the decode of both
    ref, own = rng.integers(0, SIZE, size=(9, K)), frames["s2"]
    both = run(eager_stage, {"both": np.concatenate([ref, own])})["both"]
    graphed.open("primed", prefix_frames=ref)
    graphed.push_many([("primed", f) for f in own])
    graphed.close("primed")
    pcm, done = [], False
    while not done:
        r = graphed.step(wait=True).get("primed")
        if r is not None:
            pcm += [r.pcm] if r.pcm is not None and len(r.pcm) else []
            done = r.done
    assert_close(np.concatenate(pcm), both[len(ref) * 1920:])

    codes = graphed.encode((np.sin(np.arange(24000) * 0.05) * 8000).astype(np.int16))
    assert codes.shape == (13, K) and codes.min() >= 0 and codes.max() < SIZE
