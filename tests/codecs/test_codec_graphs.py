"""Codec CUDA graphs: how a batch is cut into captured sizes (CPU), and graph == eager decode
bit for bit (CUDA)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from runner.codecs.graphs import row_buckets, split_rows


def test_row_buckets() -> None:
    assert row_buckets(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert row_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert row_buckets(1) == [1]


@pytest.mark.parametrize("max_rows", [1, 7, 100, 128])
def test_split_rows_covers_every_row_once_with_little_padding(max_rows: int) -> None:
    buckets = row_buckets(max_rows)
    for n in range(1, 3 * max_rows + 2):
        pieces = split_rows(n, buckets)
        assert sum(take for take, _ in pieces) == n
        for take, rows in pieces:
            assert rows in buckets and take <= rows
            assert 4 * (rows - take) <= rows  # at most a quarter of a piece is padding
        assert sum(take < rows for take, rows in pieces) <= 1  # only the last piece is padded
        assert len(pieces) <= n // max_rows + max_rows.bit_length() + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_decode_equals_eager_decode(tiny_snac_dir: Path) -> None:
    """The same windows through the captured graphs (padded and split batches included) and
    through the eager fused decoder give the same int16 PCM."""
    from runner.codecs.config import CodecConfig
    from runner.codecs.stage import CodecStage
    from streaming.audio import WindowJob

    st = CodecStage(CodecConfig(path=str(tiny_snac_dir), codebook_size=64), torch.device("cuda"))
    dec = st.decoder
    assert dec.graphs is not None and dec.graphs.window_lengths == {3, 4, 5, 6, 8, 12}
    rng = np.random.default_rng(0)
    for w in (3, 8, 12):
        for n in (1, 5, 70):
            windows = [rng.integers(0, 64, (w, 7)) for _ in range(n)]
            jobs = [WindowJob(0, i, i + w, i, i + w) for i in range(n)]
            seeds = list(range(100, 100 + n))
            graphed = dec.decode_jobs(windows, jobs, seeds)
            graphs, dec.graphs = dec.graphs, None
            eager = dec.decode_jobs(windows, jobs, seeds)
            dec.graphs = graphs
            for g, e in zip(graphed, eager):
                assert np.array_equal(g, e)
