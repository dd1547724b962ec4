"""Decode graph buckets (runner/engine/cuda_graphs.py): which padded batch sizes are captured, and the
GC guard around captures. The graphs themselves need CUDA (tests/gpu/test_gpu.py)."""

from __future__ import annotations

import pytest

from runner.engine.cuda_graphs import graph_buckets


def test_buckets_end_at_the_largest_batch_and_pad_little():
    for max_bs in (1, 7, 64, 512, 768, 1536, 2048, 2100):
        b = graph_buckets(max_bs)
        assert b[-1] == max_bs and b == sorted(set(b)) and b[0] == 1
        # every batch size up to max_bs has a bucket; padding above 128 rows stays under 25%,
        # above 1024 rows (prefill bursts as token rows) under ~11%
        for lo, hi in zip(b, b[1:]):
            if lo >= 1024:
                assert hi - lo <= 128
            if lo >= 128:
                assert (hi - lo) / (lo + 1) < 0.25


def test_small_buckets_unchanged():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(2048)[-9:] == [1024, 1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048]


def test_all_layers_family_buckets_keys_and_forward(tiny_model_dir):
    """hidden_rows > 0 adds an all-layers family for pure decode up to that many rows, in the
    form (pure or token-row) of each bucket's plain graph; its forward keeps every layer's
    output, the last being the final hidden. Built on the CPU without capturing (capture and
    replay: tests/gpu/test_gpu.py)."""
    import numpy as np
    import torch

    from runner.config import ModelConfig
    from runner.engine.cuda_graphs import DecodeGraphs
    from runner.models.loader import load_model
    from runner.utils.graph_inputs import pack_graph_inputs

    cfg = ModelConfig.from_pretrained(tiny_model_dir("llama", seed=1))
    model = load_model(cfg, torch.device("cpu"), torch.float32)
    bs, nb = 16, 8
    kv = [torch.zeros(2, nb, bs, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    last_token = torch.tensor([0, 0, 7, 0])
    g = DecodeGraphs(model, kv, max_bs=64, max_blocks=4, scratch_block=nb - 1, block_size=bs,
                     device=torch.device("cpu"), last_token=last_token, max_decode_rows=16, hidden_rows=12)
    assert g.hidden_buckets == [1, 2, 4, 8, 16]
    assert g.bucket_for(5, all_layers=True) == 8 and g.bucket_for(17, all_layers=True) is None
    assert g.bucket_for(17) == 32
    keys = g._keys()
    assert [k for k in keys if k[2]] == [(b, False, True) for b in g.hidden_buckets]  # no fused-RoPE family on CPU
    assert len(keys) == len(set(keys)) == len(g.buckets) + len(g.hidden_buckets)
    # four one-token sequences in block 0; row 2's token is still on the device (last_token[2])
    staged = pack_graph_inputs(np.array([3, 4, 0, 6]), np.zeros(4), np.arange(4), np.ones(4), np.array([-1, -1, 2, -1]),
                               np.zeros((4, 1), dtype=np.int32))
    g.staged[: staged.size] = torch.from_numpy(staged)
    hidden, layers = g._forward((4, False, True))
    assert g.input_ids[:4].tolist() == [3, 4, 7, 6] and g.seq_lens[:4].tolist() == [1, 1, 1, 1]
    assert sorted(layers) == list(range(cfg.num_layers + 1)) and layers[cfg.num_layers] is hidden
    plain, none = g._forward((4, False, False))
    assert none == {} and torch.equal(plain, hidden)
    assert DecodeGraphs(model, kv, 64, 4, nb - 1, bs, torch.device("cpu"), last_token).hidden_buckets == []


def test_no_gc_while_capturing_restores_the_collector():
    """Captures run with the cyclic GC off (a collection's finalizers could make CUDA calls mid
    capture); it comes back on afterwards, also after an error, and stays off if it was off."""
    import gc

    from runner.utils.capture import no_gc_while_capturing

    assert gc.isenabled()
    with no_gc_while_capturing():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_gc_while_capturing():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_gc_while_capturing():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
