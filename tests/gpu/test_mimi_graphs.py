"""Mimi's streaming decode on CUDA through captured graphs (runner/codecs/mimi_graphs.py) and
asynchronous launches on the codec's stream (runner/codecs/mimi_stage.py): the streams' PCM
equals the eager stage's and transformers' offline decode of the same frames, each sample once,
with streams joining, ending and decoding in chunks of several lengths while launches are in
flight; step() does not wait for the codec, done comes after the last chunk, an abort in flight
delivers nothing, a reused slot starts fresh, the in-flight bound holds."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from runner.codecs.decoder import float_to_s16
from runner.codecs.mimi_loader import load_mimi
from runner.codecs.mimi_stage import MimiCodecConfig, MimiCodecStage
from tests.support.tiny_models import make_tiny_mimi

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
K, SIZE = 8, 64


def _hold(stage: MimiCodecStage, seconds: float) -> None:
    """Keep the codec's stream busy for about `seconds`: what is launched now lands after."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**6)
    end.record()
    end.synchronize()
    cycles_per_s = 10**6 / (start.elapsed_time(end) / 1e3)
    with torch.cuda.stream(stage.decoder.stream):
        torch.cuda._sleep(int(seconds * cycles_per_s))


def run(stage: MimiCodecStage, frames: dict[str, np.ndarray], hold_every: int = 0) -> dict[str, np.ndarray]:
    """Stream i joins at step i, one frame per step; its PCM, concatenated. hold_every: hold the
    codec's stream for 20 ms every that many steps, so launches stay in flight across steps."""
    out: dict[str, list] = {k: [] for k in frames}
    sent = dict.fromkeys(frames, 0)
    done: set = set()
    step = 0
    while step == 0 or len(stage):
        if hold_every and step % hold_every == 0:
            _hold(stage, 0.02)
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
            assert key not in done, "PCM after done"
            out[key].append(r.pcm)
            if r.done:
                assert sum(p.size for p in out[key]) == len(frames[key]) * 1920, "done before its last chunk"
                done.add(key)
        step += 1
    assert done == set(frames)
    return {k: np.concatenate(v) for k, v in out.items()}


def offline(model, f: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return float_to_s16(model.decode(torch.from_numpy(f.T[None].copy()).cuda()).audio_values[0, 0]).cpu().numpy()


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max(initial=0) <= 1


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
    assert graphed.asynchronous
    replays = []
    orig = graphed.decoder.graphs.launch
    graphed.decoder.graphs.launch = lambda *a: replays.append(a[0]) or orig(*a)
    got = run(graphed, frames, hold_every=3)
    eager = run(MimiCodecStage(MimiCodecConfig(**cfg, cuda_graphs=False), dev, torch.float32), frames)
    assert len(replays) > 5
    model = load_mimi(path, dev)
    for key, f in frames.items():
        assert len(got[key]) == 1920 * len(f)
        assert_close(got[key], eager[key])
        assert_close(got[key], offline(model, f))


@pytest.fixture
def stage(tmp_path, no_tf32):
    def make(**overrides) -> MimiCodecStage:
        cfg = dict(path=str(make_tiny_mimi(tmp_path / "mimi", seed=0)), max_streams=4, max_batch_rows=4,
                   max_chunk_frames=8)
        return MimiCodecStage(MimiCodecConfig(**{**cfg, **overrides}), torch.device("cuda"), torch.float32)

    return make


def test_step_does_not_wait_for_the_codec_and_done_follows_the_last_chunk(stage):
    st = stage()
    model = st.decoder.model
    f = np.random.default_rng(1).integers(0, SIZE, size=(4, K))
    torch.cuda.synchronize()
    _hold(st, 0.5)
    st.open("a")
    st.push_many([("a", x) for x in f])
    st.close("a")
    t0 = time.perf_counter()
    assert st.step() == {}  # launched behind the hold: no PCM yet, and not done
    assert time.perf_counter() - t0 < 0.2, "step() waited for the codec"
    assert "a" in st and st.num_inflight == 4
    res = st.step(wait=True)
    assert res["a"].done and res["a"].error is None and "a" not in st
    assert_close(res["a"].pcm, offline(model, f))


def test_abort_in_flight_delivers_nothing_and_the_reused_slot_starts_fresh(stage):
    st = stage(max_streams=1)  # one slot: the new request takes the aborted one's
    model = st.decoder.model
    rng = np.random.default_rng(2)
    old, new = rng.integers(0, SIZE, size=(4, K)), rng.integers(0, SIZE, size=(4, K))
    st.open("a")
    st.push_many([("a", x) for x in old])
    _hold(st, 0.3)
    assert st.step() == {}  # the old stream's decode is queued behind the hold: it writes the slot later
    st.abort("a")
    st.open("a")  # same key, same slot, while that launch is in flight
    st.push_many([("a", x) for x in new])
    st.close("a")
    res = st.step(wait=True)
    assert res["a"].done and res["a"].error is None
    # only the new request's samples, decoded from a zero state (a reset that ran before the old
    # launch wrote the slot would leave the old stream's state in it)
    assert_close(res["a"].pcm, offline(model, new))
    assert st.step() == {} and st.num_inflight == 0


def test_inflight_launches_are_bounded(stage):
    st = stage(max_chunk_frames=1, max_inflight_launches=2)
    model = st.decoder.model
    f = np.random.default_rng(3).integers(0, SIZE, size=(5, K))
    st.open("a")
    _hold(st, 0.3)
    got = []
    for i, x in enumerate(f):
        st.push_many([("a", x)])
        got += [r.pcm for r in st.step().values()]
        assert len(st._launches) <= 2
    assert sum(p.size for p in got) >= 3 * 1920  # the oldest were waited for past the bound
    st.close("a")
    res = st.step(wait=True)
    assert res["a"].done and len(st._launches) == 0
    assert_close(np.concatenate(got + [res["a"].pcm]), offline(model, f))


def test_the_engine_ring_never_waits_for_the_codec_backlog(stage):
    """A codec launch's input copies queue behind its stream's backlog; the engine's staging ring
    wraps every few steps at hundreds of streams, and a ring shared with the codec made its next
    copy wait for those (steps of 150 ms at ~1000 streams). The codec stages through its own."""
    from runner.utils.host_staging import staging_for

    st = stage()
    engine = staging_for(torch.device("cuda", torch.cuda.current_device()))
    assert st.decoder.staging is not engine
    st.open("a")
    st.push_many([("a", x) for x in np.random.default_rng(4).integers(0, SIZE, size=(2, K))])
    torch.cuda.synchronize()
    _hold(st, 0.5)
    assert st.step() == {}  # its copies sit behind the hold
    block = np.zeros(engine.capacity // 4 // 8, dtype=np.int64)  # the largest array the ring stages
    t0 = time.perf_counter()
    for _ in range(6):  # more than a lap: every region of the ring is rewritten
        engine.to_device(block)
    assert time.perf_counter() - t0 < 0.2, "the engine's ring waited for the codec's copies"
    st.close("a")
    assert st.step(wait=True)["a"].done
