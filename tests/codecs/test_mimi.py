"""Mimi codec stage on a tiny random MimiModel: streaming == transformers' offline decode, each
sample once, batching, abort, bad codes (CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import MimiModel

from runner.codecs.config import CodecError
from runner.codecs.decoder import float_to_s16
from runner.codecs.mimi import MimiStreamingDecoder
from runner.codecs.mimi_loader import load_mimi
from runner.codecs.mimi_stage import MimiCodecConfig, MimiCodecStage
from tests.support.tiny_models import make_tiny_mimi, tiny_mimi_config

CPU = torch.device("cpu")
K, SIZE, SPF = 8, 64, 1920  # tiny_mimi_config: 8 codebooks of 64, 1920 samples a frame
FLOAT_TOL = 1e-5  # streamed vs offline float PCM of a ~0.3-std signal: measured ~1e-6


@pytest.fixture(scope="module")
def mimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)  # the test machine's cores are shared
    return make_tiny_mimi(tmp_path_factory.mktemp("mimi") / "tiny", seed=0)


@pytest.fixture(scope="module")
def model(mimi_dir: Path) -> MimiModel:
    return load_mimi(mimi_dir, CPU)


@pytest.fixture(scope="module")
def stage_factory(mimi_dir: Path, model: MimiModel):
    def make(**overrides) -> MimiCodecStage:
        return MimiCodecStage(MimiCodecConfig(path=str(mimi_dir), **overrides), CPU, model=model)

    return make


def _codes(seed: int, n: int, k: int = K) -> np.ndarray:
    """(n, k) random frames."""
    return np.random.default_rng(seed).integers(0, SIZE, size=(n, k), dtype=np.int64)


def _offline(model: MimiModel, frames: np.ndarray) -> torch.Tensor:
    """transformers' decode of the whole (n, k) sequence -> float (n * SPF,)."""
    with torch.inference_mode():
        return model.decode(torch.from_numpy(frames).T[None]).audio_values[0, 0]


def _assert_s16_close(got: np.ndarray, want: torch.Tensor) -> None:
    # exact sample count; values within 1 LSB (float rounding of other shapes, then int16 rounding)
    want16 = float_to_s16(want).numpy()
    assert got.dtype == np.int16 and got.shape == want16.shape
    assert np.abs(got.astype(np.int32) - want16.astype(np.int32)).max(initial=0) <= 1


def _drain(stage: MimiCodecStage, out: dict, done: dict | None = None) -> None:
    for key, r in stage.step().items():
        assert r.error is None, r.error
        out.setdefault(key, []).append(r.pcm)
        if done is not None and r.done:
            assert key not in done, "done reported twice"
            done[key] = True


def _pcm(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int16)


# ---------------------------------------------------------------- the streaming decoder


@pytest.mark.parametrize("chunks", [[1] * 14, [1, 2, 1, 3, 7], [14], [5, 9]])
def test_streamed_float_pcm_equals_offline_decode(model: MimiModel, chunks: list[int]) -> None:
    # 14 frames = 28 latent steps, past the tiny codec's 6-step attention window
    dec = MimiStreamingDecoder(model)
    frames = [_codes(s, 14) for s in range(3)]
    slots = [dec.new_stream() for _ in frames]
    got, i = [], 0
    for c in chunks:
        batch = torch.from_numpy(np.stack([f[i : i + c] for f in frames])).transpose(1, 2)
        out = dec.decode(slots, batch)
        assert out.shape == (3, c * SPF)
        got.append(out)
        i += c
    got = torch.cat(got, dim=1)
    for row, f in zip(got, frames):
        assert (row - _offline(model, f)).abs().max().item() <= FLOAT_TOL


def test_the_comparison_sees_the_transformer_and_its_window(mimi_dir: Path, model: MimiModel) -> None:
    # The offline reference with a longer attention window differs from the streamed decode
    # by far more than the tolerance: a ring that forgot the window (or no transformer at all)
    # would fail the test above.
    wide = load_mimi(MimiModel.from_pretrained(mimi_dir, sliding_window=64), CPU)
    frames = _codes(7, 14)
    dec = MimiStreamingDecoder(model)
    got = torch.cat([dec.decode([dec.new_stream()], torch.from_numpy(frames).T[None])[0]])
    assert (got - _offline(wide, frames)).abs().max().item() > 100 * FLOAT_TOL
    assert (got - _offline(model, frames)).abs().max().item() <= FLOAT_TOL


def test_fewer_codebooks_than_quantizers(model: MimiModel) -> None:
    dec = MimiStreamingDecoder(model, num_codebooks=4)
    frames = _codes(3, 6, k=4)
    slot = dec.new_stream()
    got = torch.cat([dec.decode([slot], torch.from_numpy(frames[i : i + 1]).T[None])[0] for i in range(6)])
    assert (got - _offline(model, frames)).abs().max().item() <= FLOAT_TOL
    with pytest.raises(CodecError, match="num_codebooks"):
        MimiStreamingDecoder(model, num_codebooks=K + 1)


def test_non_streamable_configs_are_refused_naming_the_field() -> None:
    for field, value in (("use_causal_conv", False), ("pad_mode", "reflect")):
        m = MimiModel(tiny_mimi_config(**{field: value}))
        with pytest.raises(CodecError, match=f"MimiConfig.{field}"):
            load_mimi(m, CPU)


def test_missing_folder_is_a_codec_error(tmp_path: Path) -> None:
    with pytest.raises(CodecError, match="config.json"):
        load_mimi(tmp_path, CPU)


# ---------------------------------------------------------------- the stage


def test_stage_streams_each_sample_once_equal_to_offline(stage_factory, model: MimiModel) -> None:
    stage = stage_factory(max_chunk_frames=1)  # every frame decoded as it comes
    assert (stage.sample_rate, stage.num_codebooks, stage.samples_per_frame) == (24000, K, SPF)
    frames = _codes(11, 13)
    stage.open("a")
    out: dict = {}
    done: dict = {}
    for i, f in enumerate(frames):
        stage.push_many([("a", f.tolist() if i % 2 else f)])  # lists and arrays alike
        _drain(stage, out, done)
        # each step emits exactly the new frame's samples: nothing held back, nothing repeated
        assert sum(p.size for p in out["a"]) == (i + 1) * SPF
    stage.close("a")
    _drain(stage, out, done)
    assert done == {"a": True} and len(stage) == 0
    _assert_s16_close(_pcm(out["a"]), _offline(model, frames))
    assert stage.step() == {}  # forgotten
    stage.push_many([("a", frames[0])])  # a late frame of a finished request: ignored
    assert len(stage) == 0 and stage.step() == {}


@pytest.mark.parametrize("ratio,emitted", [
    (0.5, [1, 2, 3, 4, 4, 6, 6, 6, 9, 9, 9, 9]),  # chunks 1, 1, 1, 1, 2, 3, then the cap 4 (9: 3 + 4 + 4 + 1 wait)
    (1.0, [1, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8, 12]),  # doubling: 1, 1, 2, 4, then 4
])
def test_chunks_grow_with_the_audio_sent_up_to_the_cap_and_the_end_flushes(stage_factory, model: MimiModel, ratio,
                                                                           emitted) -> None:
    """After each launch a stream's next chunk is chunk_ratio x the frames it has sent (at least
    1, at most max_chunk_frames=4); close() decodes what is left; the PCM is the offline
    decode's, each sample once."""
    stage = stage_factory(max_chunk_frames=4, chunk_ratio=ratio)
    frames = _codes(5, 12)
    stage.open("a")
    out: dict = {}
    done: dict = {}
    got = []
    for f in frames:
        stage.push_many([("a", f)])
        _drain(stage, out, done)
        got.append(sum(p.size for p in out.get("a", [])) // SPF)
    assert got == emitted
    stage.close("a")
    _drain(stage, out, done)
    assert done == {"a": True}
    _assert_s16_close(_pcm(out["a"]), _offline(model, frames))


@pytest.mark.parametrize("t_ms,ratio,starves", [(39, 1.0, False), (45, 1.0, True), (52, 0.5, False), (58, 0.5, True)])
def test_a_player_starves_only_when_steps_are_slower_than_the_ratio_allows(stage_factory, t_ms, ratio, starves) -> None:
    """Why chunk_ratio: the stage fed a frame every t_ms (its PCM out when the stage returns it,
    no codec latency), played from the first chunk at 80 ms a frame: the player waits only
    when t_ms > 80 / (1 + ratio)."""
    stage = stage_factory(max_chunk_frames=16, chunk_ratio=ratio)
    frame_ms = 1000 * SPF / stage.sample_rate
    stage.open("a")
    out: dict = {}
    played_from, received, waited = None, 0, False
    for n, f in enumerate(_codes(7, 100), start=1):
        stage.push_many([("a", f)])
        _drain(stage, out, {})
        total = sum(p.size for p in out.get("a", [])) // SPF
        if total > received:
            now = n * t_ms
            if played_from is None:
                played_from = now
            waited |= now > played_from + received * frame_ms
            received = total
    assert waited == starves


def test_concurrent_requests_batched_equal_each_alone(stage_factory, model: MimiModel) -> None:
    stage = stage_factory(max_chunk_frames=3)
    calls: list[tuple[int, int]] = []  # (rows, frames) of each decoder call
    decode = stage.decoder.decode
    stage.decoder.decode = lambda slots, codes: (calls.append((len(slots), codes.shape[-1])), decode(slots, codes))[1]
    # different lengths, joining at different steps, several frames per push now and then
    plan = {"a": (0, 9), "b": (0, 4), "c": (2, 12), "d": (5, 1), "e": (3, 7)}  # key: (first step, frames)
    frames = {k: _codes(20 + i, n) for i, (k, (_, n)) in enumerate(plan.items())}
    sent = dict.fromkeys(plan, 0)
    out: dict = {}
    done: dict = {}
    for step in range(16):
        items, closing = [], []
        for k, (start, n) in plan.items():
            if step == start:
                stage.open(k)
            if start <= step and sent[k] < n:
                take = 1 + (step % 3 == 0) * 3  # 1, or a burst of 4 (decoded 3 + 1)
                items += [(k, f) for f in frames[k][sent[k] : sent[k] + take]]
                sent[k] = min(n, sent[k] + take)
                if sent[k] == n:
                    closing.append(k)
        stage.push_many(items)
        for k in closing:  # after its last frame
            stage.close(k)
        _drain(stage, out, done)
    assert done == dict.fromkeys(plan, True) and len(stage) == 0
    assert max(rows for rows, _ in calls) >= 3  # requests did share decoder calls
    assert max(m for _, m in calls) == 3  # max_chunk_frames bounds a call
    for k in plan:
        _assert_s16_close(_pcm(out[k]), _offline(model, frames[k]))
        alone = stage_factory()
        alone.open(k)
        alone.push_many([(k, f) for f in frames[k]])
        alone.close(k)
        res = alone.step()
        assert res[k].done and res[k].pcm.shape == _pcm(out[k]).shape
        assert np.abs(res[k].pcm.astype(np.int32) - _pcm(out[k]).astype(np.int32)).max() <= 1


def test_abort_frees_state_and_a_reused_slot_starts_fresh(stage_factory, model: MimiModel) -> None:
    stage = stage_factory(max_streams=2)
    free = stage.decoder.num_free
    stage.open("x")
    stage.push_many([("x", f) for f in _codes(1, 5)])
    stage.step()
    stage.push_many([("x", f) for f in _codes(2, 3)])  # pushed, never decoded
    stage.abort("x")
    assert len(stage) == 0 and "x" not in stage and stage.decoder.num_free == free
    assert stage.step() == {}  # nothing more for it
    stage.push_many([("x", _codes(3, 1)[0])])  # late frames after abort: ignored
    assert stage.step() == {}
    stage.abort("x")  # twice: harmless
    # the freed slot is handed out again with zero state: the new stream equals its offline decode
    frames = _codes(4, 6)
    stage.open("y")
    stage.push_many([("y", f) for f in frames])
    stage.close("y")
    res = stage.step()
    assert res["y"].done and res["y"].error is None
    _assert_s16_close(res["y"].pcm, _offline(model, frames))
    assert stage.decoder.num_free == free


def test_bad_codes_fail_only_their_request_naming_frame_and_codebook(stage_factory, model: MimiModel) -> None:
    stage = stage_factory()
    good = _codes(5, 4)
    for key in ("ok", "range", "negative", "shape", "dtype"):
        stage.open(key)
    bad_range = good[2].copy()
    bad_range[5] = SIZE
    bad_neg = good[1].copy()
    bad_neg[0] = -1
    stage.push_many([("ok", f) for f in good] + [("range", good[0]), ("range", good[1]), ("range", bad_range),
                                                  ("negative", bad_neg), ("shape", good[0][:7]),
                                                  ("dtype", good[0].astype(np.float32))])
    stage.close("ok")
    res = stage.step()
    assert res["range"].done and res["range"].error == (
        f"codes: frame 2, codebook 5: code {SIZE} is outside the codebook range [0, {SIZE})")
    assert res["negative"].error == f"codes: frame 0, codebook 0: code -1 is outside the codebook range [0, {SIZE})"
    assert "frame 0 must hold 8 codes (one per codebook), got shape (7,)" in res["shape"].error
    assert "integer codes" in res["dtype"].error
    assert res["ok"].done and res["ok"].error is None
    _assert_s16_close(res["ok"].pcm, _offline(model, good))
    assert len(stage) == 0 and stage.decoder.num_free == stage.decoder.max_streams


def test_limits_are_named_errors(stage_factory, mimi_dir: Path) -> None:
    stage = stage_factory(max_streams=2, max_pending_frames=3)
    stage.open(1)
    stage.open(2)
    with pytest.raises(CodecError, match="max_streams: all 2"):
        stage.open(3)
    with pytest.raises(KeyError):
        stage.open(1)
    stage.push_many([(1, f) for f in _codes(0, 4)])  # one more than may wait
    res = stage.step()
    assert res[1].done and "MimiCodecConfig.max_pending_frames" in res[1].error
    stage.close(2)  # closed with no frames: done, no audio
    assert stage.step()[2].done
    stage.open(3)  # slots came back
    with pytest.raises(CodecError, match="MimiCodecConfig.sample_rate"):
        MimiCodecStage(MimiCodecConfig(path=str(mimi_dir), sample_rate=16000), CPU)
    with pytest.raises(CodecError, match="MimiCodecConfig.max_batch_rows"):
        MimiCodecConfig(path=str(mimi_dir), max_batch_rows=0)
    for bad in (0.0, 1.5):
        with pytest.raises(CodecError, match="MimiCodecConfig.chunk_ratio"):
            MimiCodecConfig(path=str(mimi_dir), chunk_ratio=bad)


# ---------------------------------------------------------------- asynchronous launches (CUDA's bookkeeping)


class _LateEvent:
    """A CUDA event stand-in: lands when the test says so; a host wait on it is counted."""

    def __init__(self, waits: list) -> None:
        self.landed = False
        self.waits = waits

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        if not self.landed:
            self.waits.append(self)
            self.landed = True


def _late(stage: MimiCodecStage) -> tuple[list[_LateEvent], list[_LateEvent]]:
    """The stage as on CUDA, on the CPU: a launch decodes at once (state advances in launch
    order, as on the codec's stream) but its PCM lands only when the test lands its event, in
    launch order. Returns (events in launch order, host waits)."""
    events: list[_LateEvent] = []
    waits: list[_LateEvent] = []
    launch = stage.decoder.launch

    def late(slots, codes):
        pending = launch(slots, codes)
        pending.event = _LateEvent(waits)
        events.append(pending.event)
        return pending

    stage.decoder.launch = late
    stage.asynchronous = True
    return events, waits


def _land(events: list[_LateEvent], n: int) -> None:
    """The oldest n launches not landed yet land (a stream finishes in order)."""
    for e in [e for e in events if not e.landed][:n]:
        e.landed = True


def test_async_launches_deliver_the_synchronous_pcm_in_order(stage_factory, model: MimiModel) -> None:
    """Streams of different lengths join at different steps; launches land a few steps late,
    in launch order. Each stream's PCM equals the synchronous stage's (same calls) and the
    offline decode, each sample once; done comes after its last chunk is collected, and the
    host never waits below the in-flight bound."""
    plan = {"a": (0, 11), "b": (1, 3), "c": (1, 16), "d": (4, 1), "e": (6, 7)}  # key: (first step, frames)
    frames = {k: _codes(40 + i, n) for i, (k, (_, n)) in enumerate(plan.items())}

    def run(stage: MimiCodecStage, events: list[_LateEvent] | None) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        out: dict = {}
        done: dict = {}
        sent = dict.fromkeys(plan, 0)
        for step in range(60):
            for k, (start, n) in plan.items():
                if step == start:
                    stage.open(k)
                if start <= step and sent[k] < n:
                    stage.push_many([(k, frames[k][sent[k]])])
                    sent[k] += 1
                    if sent[k] == n:
                        stage.close(k)
            if events is not None:
                _land(events, int(rng.integers(0, 3)))
            for k, r in stage.step().items():
                assert r.error is None and k not in done, (k, r)
                out.setdefault(k, []).append(r.pcm)
                if r.done:
                    # every frame it was pushed has come back by now
                    assert sum(p.size for p in out[k]) == plan[k][1] * SPF, k
                    done[k] = True
            if len(done) == len(plan):
                break
        assert done == dict.fromkeys(plan, True) and len(stage) == 0 and stage.num_inflight == 0
        return {k: _pcm(v) for k, v in out.items()}

    stage = stage_factory(max_chunk_frames=4, max_batch_rows=2, max_inflight_launches=1000)
    events, waits = _late(stage)
    got = run(stage, events)
    assert len(events) > 10 and waits == []  # launched late-landing, and the host never waited
    want = run(stage_factory(max_chunk_frames=4, max_batch_rows=2), None)
    for k in plan:
        assert np.array_equal(got[k], want[k]), k
        _assert_s16_close(got[k], _offline(model, frames[k]))


def test_async_done_only_after_the_last_launch_lands(stage_factory, model: MimiModel) -> None:
    stage = stage_factory()
    events, waits = _late(stage)
    frames = _codes(50, 5)
    stage.open("a")
    stage.push_many([("a", f) for f in frames])
    stage.close("a")
    assert stage.step() == {}  # launched (4 + 1 frames), not landed: nothing yet, not done
    assert len(events) == 2 and "a" in stage and stage.num_inflight == 5
    assert stage.step() == {}
    events[0].landed = True
    first = stage.step()["a"]  # the first 4 frames' PCM; the last launch still out
    assert not first.done and "a" in stage
    events[1].landed = True
    res = stage.step()
    assert res["a"].done and res["a"].error is None and "a" not in stage
    _assert_s16_close(np.concatenate([first.pcm, res["a"].pcm]), _offline(model, frames))
    assert waits == [] and stage.step() == {}


def test_async_abort_mid_flight_delivers_nothing_for_it_nor_to_a_new_request_on_its_key(
        stage_factory, model: MimiModel) -> None:
    stage = stage_factory(max_streams=1)  # one slot: the new request must take the aborted one's
    events, _ = _late(stage)
    stage.open("a")
    stage.push_many([("a", f) for f in _codes(60, 3)])
    stage.step()  # launched
    stage.push_many([("a", f) for f in _codes(61, 2)])
    stage.abort("a")  # launch in flight, frames pending
    assert stage.step() == {} and stage.num_inflight == 3
    frames = _codes(62, 4)
    stage.open("a")  # the same key, a new request, the same slot
    stage.push_many([("a", f) for f in frames])
    stage.close("a")
    assert stage.step() == {}  # the old launch has not landed, the new one neither
    events[0].landed = True
    assert stage.step() == {}  # the old request's PCM is dropped; the new launch is still out
    out = stage.step(wait=True)  # the caller has nothing else to do: everything is collected
    assert out["a"].done
    _assert_s16_close(out["a"].pcm, _offline(model, frames))
    assert stage.num_inflight == 0 and stage.step() == {}


def test_async_inflight_launches_are_bounded(stage_factory) -> None:
    stage = stage_factory(max_chunk_frames=1, max_inflight_launches=2)
    events, waits = _late(stage)
    stage.open("a")
    got = []
    for i, f in enumerate(_codes(70, 6)):
        stage.push_many([("a", f)])
        got += [r.pcm for r in stage.step().values()]
        assert len(events) == i + 1 and len(stage._launches) == min(i + 1, 2)
        assert len(waits) == max(0, i - 1)  # past the bound the host waits for the oldest
    assert sum(p.size for p in got) == 4 * SPF and stage.num_inflight == 2
    stage.close("a")
    res = stage.step(wait=True)
    assert res["a"].done and res["a"].pcm.size == 2 * SPF and len(stage._launches) == 0


def test_every_call_takes_a_schedule_length_and_a_remainder_is_split(stage_factory, model: MimiModel) -> None:
    # schedule 1, 2, 4 (the CUDA graphs' lengths): an utterance of 10 frames pushed at once and
    # ended decodes as 4 + 4 + 2, one of 7 as 4 + 2 + 1 (no call of 3 or 7 frames, which would
    # decode eagerly mid-serving on CUDA); the PCM is the offline decode's either way
    stage = stage_factory(max_chunk_frames=4)
    calls = []
    launch = stage.decoder.launch
    stage.decoder.launch = lambda slots, codes: calls.append((len(slots), codes.shape[2])) or launch(slots, codes)
    frames = {"a": _codes(8, 10), "b": _codes(9, 7)}
    out: dict = {}
    done: dict = {}
    for key, f in frames.items():
        stage.open(key)
        stage.push_many([(key, row) for row in f])
        stage.close(key)
    _drain(stage, out, done)
    assert done == {"a": True, "b": True}
    # one call per length and pass, both streams' rows together where their lengths agree:
    # a 4 | b 4, then a 4, b 2, then a 2, b 1
    assert sorted(calls) == sorted([(2, 4), (1, 4), (1, 2), (1, 2), (1, 1)])
    for key, f in frames.items():
        _assert_s16_close(_pcm(out[key]), _offline(model, f))
