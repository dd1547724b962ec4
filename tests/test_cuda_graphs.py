"""Decode graph buckets (runner/cuda_graphs.py): which padded batch sizes are captured. The
graphs themselves need CUDA (tests/test_gpu.py)."""

from __future__ import annotations

from runner.cuda_graphs import graph_buckets


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
