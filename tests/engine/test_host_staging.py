"""The pinned staging ring (runner/utils/host_staging.py) and the copier's pinned rows: a region is
never rewritten before the copy that reads it has run, even when the GPU lags far behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.utils.host_staging import PinnedStaging

CUDA = torch.cuda.is_available()


def test_cpu_device_is_refused():
    with pytest.raises(ValueError, match="CUDA"):
        PinnedStaging(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_ring_keeps_every_copy_intact_while_the_stream_lags():
    dev = torch.device("cuda")
    st = PinnedStaging(dev, capacity_bytes=4096)  # a few copies per lap: many wraps
    rng = np.random.default_rng(0)
    torch.cuda._sleep(50_000_000)  # the stream is busy: every copy below waits behind it
    sent, got = [], []
    for i in range(300):
        n = int(rng.integers(1, 120))
        arr = rng.integers(-(2**40), 2**40, size=n) if i % 3 else rng.standard_normal(n).astype(np.float32)
        sent.append(arr.copy())
        got.append(st.to_device(arr, torch.int64 if i % 3 else None))
        arr[:] = 0  # the caller may reuse its array at once
    big = rng.integers(0, 100, size=2048)  # over a quarter of the ring: a pinned block of its own
    sent.append(big.copy())
    got.append(st.to_device(big))
    torch.cuda.synchronize()
    for want, t in zip(sent, got):
        assert t.device.type == "cuda" and np.array_equal(t.cpu().numpy(), want)
    assert st.to_device(np.zeros((3, 5), dtype=np.int32)).shape == (3, 5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_copier_refuses_an_output_whose_pinned_row_was_reused():
    from runner.engine.output_copier import CudaOutputCopier

    cp = CudaOutputCopier(torch.device("cuda"), max_rows=8)
    outs = [cp.copy(torch.arange(3, device="cuda") + i, None, []) for i in range(cp.RING + 1)]
    assert outs[-1].get().sampled == [cp.RING, cp.RING + 1, cp.RING + 2]
    assert outs[1].get().sampled == [1, 2, 3]
    with pytest.raises(AssertionError, match="reused"):
        outs[0].get()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_copy_into_a_fixed_buffer_keeps_every_step_intact_while_the_stream_lags():
    """copy_into (a CUDA graph's input buffer) shares the ring with to_device: each step's
    contents reach the buffer in stream order, whatever the host writes after queueing them."""
    dev = torch.device("cuda")
    st = PinnedStaging(dev, capacity_bytes=4096)
    dst = torch.zeros(200, dtype=torch.int32, device=dev)
    rng = np.random.default_rng(1)
    torch.cuda._sleep(50_000_000)
    sent, got = [], []
    for i in range(200):
        arr = rng.integers(-(2**31), 2**31 - 1, size=int(rng.integers(1, 200))).astype(np.int32)
        st.copy_into(dst, arr)
        sent.append(arr.copy())
        got.append(dst[: arr.size].clone())  # what a replay right after the copy would read
        arr[:] = 0
        if i % 4 == 0:
            st.to_device(rng.integers(0, 9, size=30))  # interleaved with ordinary copies
    big_dst = torch.zeros(2048, dtype=torch.int32, device=dev)
    big = rng.integers(0, 100, size=2048).astype(np.int32)  # over a quarter of the ring: a pinned block of its own
    st.copy_into(big_dst, big)
    sent.append(big.copy())
    got.append(big_dst.clone())
    big[:] = 0
    torch.cuda.synchronize()
    for want, t in zip(sent, got):
        assert np.array_equal(t.cpu().numpy(), want)
    with pytest.raises(AssertionError):
        st.copy_into(dst, np.zeros(201, dtype=np.int32))  # larger than the buffer
    with pytest.raises(AssertionError):
        st.copy_into(dst, np.zeros(3, dtype=np.int64))  # dtype differs
