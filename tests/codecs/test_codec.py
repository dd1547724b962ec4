"""Codec stage on a tiny random SNAC: token mapping, exactly-once streaming, errors."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.codecs.config import CodecConfig, CodecError
from runner.codecs.decoder import offline_decode
from runner.codecs.orpheus_tokens import codes_to_tokens, tokens_to_codes
from runner.codecs.snac import load_snac
from runner.codecs.stage import CodecStage, StageResult
from streaming.audio import WindowPolicy, plan_offline

SPF = 2048
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cfg(tiny_snac_dir: Path) -> CodecConfig:
    return CodecConfig(path=str(tiny_snac_dir), codebook_size=64)


@pytest.fixture(scope="module")
def stage_factory(cfg: CodecConfig):
    torch.set_num_threads(1)  # the test machine's cores are shared

    def make(**overrides) -> CodecStage:
        return CodecStage(replace(cfg, **overrides), CPU)

    return make


def _codes(rng: np.random.Generator, n: int, codebook: int = 64) -> np.ndarray:
    return rng.integers(0, codebook, size=(n, 7), dtype=np.int64)


def _assert_pcm_close(got: np.ndarray, want: np.ndarray) -> None:
    # Exact sample counts; values within 1 LSB (batched vs single-window float rounding).
    assert got.dtype == np.int16 and got.shape == want.shape
    if got.size:
        assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1


# ---------------------------------------------------------------- mapping


def test_token_code_round_trip(cfg: CodecConfig) -> None:
    codes = _codes(np.random.default_rng(0), 9)
    toks = codes_to_tokens(cfg, codes)
    assert len(toks) == 63
    assert np.array_equal(tokens_to_codes(cfg, toks), codes)
    # Position k of a frame uses the k-th codebook-sized slice after the offset.
    assert toks[3] == cfg.audio_token_offset + 3 * 64 + int(codes[0, 3])
    assert tokens_to_codes(cfg, toks[:-3]).shape == (8, 7)  # partial last frame dropped


def test_orpheus_defaults_ranges(cfg: CodecConfig) -> None:
    real = CodecConfig(path="unused")
    assert codes_to_tokens(real, np.array([[0, 0, 0, 0, 0, 0, 4095]])) == [
        128266, 132362, 136458, 140554, 144650, 148746, 152842 + 4095,
    ]
    with pytest.raises(ValueError, match=r"invalid audio token 132362 at audio index 7 \(expected range \[128266, 132362\)"):
        tokens_to_codes(real, [128266 + k * 4096 for k in range(7)] + [132362])


def test_allowed_token_range(stage_factory) -> None:
    st = stage_factory()
    off = st.cfg.audio_token_offset
    assert st.allowed_token_range(0) == (off, off + 64)
    assert st.allowed_token_range(5) == (off + 5 * 64, off + 6 * 64)
    assert st.allowed_token_range(7 * 11 + 2) == (off + 2 * 64, off + 3 * 64)


def test_bad_config_rejected(tiny_snac_dir: Path) -> None:
    with pytest.raises(CodecError, match="codebook_size"):
        CodecStage(CodecConfig(path=str(tiny_snac_dir)), CPU)  # 4096 vs the tiny model's 64
    with pytest.raises(CodecError, match="tokens_per_frame"):
        CodecConfig(path=str(tiny_snac_dir), codebook_size=64, tokens_per_frame=8)
    with pytest.raises(CodecError, match="end_token_id"):
        CodecConfig(path=str(tiny_snac_dir), codebook_size=64, end_token_id=128266 + 5)
    with pytest.raises(CodecError, match="not found"):
        CodecStage(CodecConfig(path=str(tiny_snac_dir / "missing"), codebook_size=64), CPU)


def test_weight_layouts_load_identically(cfg: CodecConfig, tiny_snac_dir: Path, tmp_path: Path) -> None:
    """Legacy weight_g/weight_v .bin, parametrized-key .bin and safetensors give one model."""
    from safetensors.torch import save_file

    legacy = torch.load(tiny_snac_dir / "pytorch_model.bin", weights_only=True)
    modern = {
        k.replace("weight_g", "parametrizations.weight.original0").replace("weight_v", "parametrizations.weight.original1"): v
        for k, v in legacy.items()
    }
    for name, sd in [("modern", modern), ("st", legacy)]:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((tiny_snac_dir / "config.json").read_text())
        if name == "st":
            save_file(sd, str(d / "model.safetensors"))
        else:
            torch.save(sd, d / "pytorch_model.bin")
        a = load_snac(cfg, CPU).state_dict()
        b = load_snac(replace(cfg, path=str(d)), CPU).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tiny_snac_dir / "config.json").read_text())["vq_strides"] == [4, 2, 1]


# ---------------------------------------------------------------- decoding


def test_batched_equals_single_and_noise_is_positional(stage_factory) -> None:
    st = stage_factory()
    dec = st.decoder
    rng = np.random.default_rng(1)
    codes = _codes(rng, 30)
    plan = plan_offline(st.cfg.policy, 30)
    length = max({j.window_frames for j in plan}, key=lambda n: sum(j.window_frames == n for j in plan))
    jobs = [j for j in plan if j.window_frames == length]  # equal-length windows batch together
    assert len(jobs) >= 2
    windows = [codes[j.window_start : j.window_end] for j in jobs]
    batched = dec.decode_jobs(windows, jobs, [0] * len(jobs))
    for w, j, b in zip(windows, jobs, batched):
        _assert_pcm_close(b, dec.decode_jobs([w], [j], [0])[0])
    # Different noise seeds give different audio; the output is a busy, unclipped signal.
    other = dec.decode_jobs(windows[:1], jobs[:1], [7])[0]
    assert np.abs(other.astype(np.int32) - batched[0]).max() > 100
    assert 3000 < np.abs(batched[0].astype(np.int32)).mean() < 25000


def test_enough_context_equals_whole_utterance_decode(stage_factory) -> None:
    """Positional noise makes overlapping windows agree: with context >= the receptive
    field (3 frames), the windowed offline decode equals one whole-utterance decode."""
    st = stage_factory()
    codes = _codes(np.random.default_rng(2), 14)
    policy = WindowPolicy(left_context=3, right_context=3, chunk_frames=(1, 2, 4))
    windowed = offline_decode(st.decoder, codes, policy)
    one = WindowPolicy(left_context=0, right_context=0, chunk_frames=(14,))
    _assert_pcm_close(windowed, offline_decode(st.decoder, codes, one))


def _feed(st: CodecStage, streams: dict[str, list[int]], ends: dict[str, str], seed: int) -> dict[str, StageResult]:
    """Push each stream's tokens in random bursts, stepping between pushes, until all done.

    ends[key]: "token" (push the end token), "close" (call close) or "both".
    Returns per key the concatenated PCM and the final done/error.
    """
    rng = random.Random(seed)
    pos = {k: 0 for k in streams}
    pcm: dict[str, list[np.ndarray]] = {k: [] for k in streams}
    final: dict[str, StageResult] = {}
    for k in streams:
        st.open(k)
    for _ in range(10_000):
        for k, toks in streams.items():
            if k in final or pos[k] > len(toks):
                continue
            n = rng.choice([1, 1, 1, 2, 5, 7, 13, 40])
            burst = toks[pos[k] : pos[k] + n]
            pos[k] += n
            if pos[k] >= len(toks):
                pos[k] = len(toks) + 1
                if ends[k] in ("token", "both"):
                    burst = burst + [st.cfg.end_token_id] + [5, 6]  # junk after the end is ignored
                st.push(k, burst)
                if ends[k] in ("close", "both"):
                    st.close(k)
            else:
                st.push(k, burst)
        for k, res in st.step().items():
            pcm[k].append(res.pcm)
            if res.done:
                final[k] = StageResult(np.concatenate(pcm[k]), True, res.error)
        if len(final) == len(streams):
            return final
    raise AssertionError("streams did not finish")


def test_streamed_equals_offline_three_requests(stage_factory) -> None:
    st = stage_factory()
    rng = np.random.default_rng(3)
    frames = {"a": 1, "b": 9, "c": 26}
    codes = {k: _codes(rng, n) for k, n in frames.items()}
    streams = {k: codes_to_tokens(st.cfg, c) for k, c in codes.items()}
    ends = {"a": "token", "b": "close", "c": "both"}
    batch_sizes: list[int] = []
    launch_jobs = st.decoder.launch_jobs

    def recording(windows, jobs, seeds):
        batch_sizes.append(len(jobs))
        return launch_jobs(windows, jobs, seeds)

    st.decoder.launch_jobs = recording  # type: ignore[method-assign]
    for seed in (0, 1):
        out = _feed(st, streams, ends, seed)
        for k, n in frames.items():
            assert out[k].error is None
            assert out[k].pcm.size == n * SPF
            _assert_pcm_close(out[k].pcm, offline_decode(st.decoder, codes[k], st.cfg.policy))
        assert len(st) == 0  # done requests are forgotten
    assert max(batch_sizes) > 1  # windows of different requests / chunks shared a call


def test_invalid_token_ends_only_that_request(stage_factory) -> None:
    st = stage_factory()
    rng = np.random.default_rng(4)
    codes = {k: _codes(rng, n) for k, n in {"ok1": 6, "bad": 10, "ok2": 4}.items()}
    streams = {k: codes_to_tokens(st.cfg, c) for k, c in codes.items()}
    # Audio index 17 is position 3 of frame 2; give it a position-0 id instead.
    streams["bad"][17] = st.cfg.audio_token_offset + 1
    out = _feed(st, streams, {k: "token" for k in streams}, seed=5)
    lo = st.cfg.audio_token_offset + 3 * 64
    assert out["bad"].error == (
        f"invalid audio token {st.cfg.audio_token_offset + 1} at audio index 17 "
        f"(expected range [{lo}, {lo + 64}) or end token {st.cfg.end_token_id})"
    )
    for k in ("ok1", "ok2"):
        assert out[k].error is None
        _assert_pcm_close(out[k].pcm, offline_decode(st.decoder, codes[k], st.cfg.policy))
    # A non-audio token (e.g. a text token) is rejected the same way.
    st.open("text")
    st.push("text", [128000])
    res = st.step()["text"]
    assert res.done and res.pcm.size == 0 and "invalid audio token 128000 at audio index 0" in res.error


def test_push_many_one_token_per_stream_per_step_like_the_engine(stage_factory) -> None:
    """The engine hands each step's tokens of all its audio requests over in one push_many
    call, one (key, token) pair per request: the streams must come out as each would alone
    (its PCM, its end, its error), whatever they are interleaved with."""
    st = stage_factory()
    rng = np.random.default_rng(11)
    codes = {"a": _codes(rng, 9), "b": _codes(rng, 5), "c": _codes(rng, 4)}
    toks = {k: codes_to_tokens(st.cfg, c) for k, c in codes.items()}
    toks["a"] = toks["a"] + [st.cfg.end_token_id]
    toks["b"][10] = st.cfg.audio_token_offset + 1  # wrong codebook slot at audio index 10
    for k in toks:
        st.open(k)
    pcm: dict[str, list[np.ndarray]] = {k: [] for k in toks}
    final: dict[str, StageResult] = {}
    for i in range(max(map(len, toks.values()))):
        items = [(k, t[i]) for k, t in toks.items() if i < len(t)]
        if i == len(toks["a"]) - 1:
            items.insert(1, ("a", 7))  # right after a's end token, in the same call: ignored
        st.push_many(items)
        if i == len(toks["c"]) - 1:
            st.close("c")  # c ends by close() (a stop on max_tokens), not by the end token
        for k, res in st.step().items():
            pcm[k].append(res.pcm)
            if res.done:
                final[k] = res
    assert set(final) == {"a", "b", "c"}
    for k in ("a", "c"):
        assert final[k].error is None
        _assert_pcm_close(np.concatenate(pcm[k]), offline_decode(st.decoder, codes[k], st.cfg.policy))
    assert "invalid audio token" in final["b"].error and "at audio index 10" in final["b"].error


def test_abort_drops_state(stage_factory) -> None:
    st = stage_factory()
    toks = codes_to_tokens(st.cfg, _codes(np.random.default_rng(6), 12))
    st.open("x")
    st.push("x", toks[: 7 * 3])
    first = st.step()["x"]
    assert first.pcm.size == SPF and not first.done  # chunk 0 ready once frames 0..2 exist
    st.abort("x")
    st.push("x", toks[7 * 3 :])  # a late output after abort is ignored
    st.close("x")
    assert st.step() == {} and "x" not in st
    # The key can be reused afterwards and starts from scratch.
    st.open("x")
    st.push("x", toks[:7] + [st.cfg.end_token_id])
    res = st.step()["x"]
    assert res.done and res.pcm.size == SPF
    st.open("y")
    with pytest.raises(KeyError, match="already open"):
        st.open("y")


class _Event:
    """Stands in for a CUDA event: the test decides when the launch has landed."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True


def _async_stage(stage_factory, **overrides) -> tuple[CodecStage, list[_Event]]:
    """A CPU stage that behaves like the CUDA one: launches complete only when their event says."""
    st = stage_factory(**overrides)
    events: list[_Event] = []
    launch = st.decoder.launch_jobs

    def deferred(windows, jobs, seeds):
        p = launch(windows, jobs, seeds)
        p.event = _Event()
        events.append(p.event)
        return p

    st.decoder.launch_jobs = deferred
    st.asynchronous = True  # as on CUDA: collection happens on later steps
    return st, events


def test_collect_does_not_wait_for_the_codec(stage_factory) -> None:
    st, events = _async_stage(stage_factory)
    codes = _codes(np.random.default_rng(8), 6)
    toks = codes_to_tokens(st.cfg, codes)
    st.open("a")
    st.push("a", toks[: 7 * 3])
    assert st.step() == {} and len(events) == 1 and st.num_inflight == 1  # chunk 0 launched
    assert st.step() == {} and not events[0].waited  # not landed: nothing, no wait
    events[0].done = True
    st.push("a", toks[7 * 3 :] + [st.cfg.end_token_id])
    res = st.step()["a"]
    assert res.pcm.size == SPF and not res.done  # chunk 0 collected; the rest just launched
    assert st.num_inflight > 0 and not any(e.done for e in events[1:])
    res = st.step(wait=True)["a"]  # the caller is idle: wait for everything in flight
    assert res.done and st.num_inflight == 0 and all(e.waited for e in events[1:])
    _assert_pcm_close(res.pcm, offline_decode(st.decoder, codes, st.cfg.policy)[SPF:])


def test_inflight_bound_waits_for_the_oldest(stage_factory) -> None:
    st, events = _async_stage(stage_factory, max_inflight_windows=1)
    toks = codes_to_tokens(st.cfg, _codes(np.random.default_rng(9), 4))
    for key in ("a", "b"):
        st.open(key)
        st.push(key, toks[: 7 * 3])
        st.step()  # one window each, launched in separate calls
    assert len(events) == 2 and events[0].waited and not events[1].waited  # 2 > 1 in flight
    assert st.num_inflight == 1


def test_launches_per_step_are_bounded_and_deferred_windows_batch_later(stage_factory) -> None:
    st, events = _async_stage(stage_factory, max_launches_per_step=1, max_defer_steps=2)
    calls = []
    launch = st.decoder.launch_jobs
    st.decoder.launch_jobs = lambda w, j, s: calls.append([x.window_frames for x in j]) or launch(w, j, s)
    rng = np.random.default_rng(12)
    toks = {k: codes_to_tokens(st.cfg, _codes(rng, 8)) for k in "abc"}
    # a: chunk 0 ready (3 frames); b: chunks 0-1 (4 frames); c: chunks 0-2 (5 frames) -> first
    # chunks launch at once, whatever the bound
    for key, n in (("a", 3), ("b", 4), ("c", 5)):
        st.open(key)
        st.push(key, toks[key][: 7 * n])
    st.step()
    assert sorted(calls[0]) == [3, 3, 3] and len(calls) == 1  # chunk-0 windows: one call
    # b's and c's chunk-1 windows (length 4) and c's chunk-2 window (length 5): one length
    # per step, the fullest first; the other waits its 2 steps at most
    assert st.step() == {}  # nothing has landed yet
    assert calls[1] == [4, 4] and len(calls) == 2
    st.step()
    assert calls[2] == [5] and len(calls) == 3
    for e in events:
        e.done = True
    res = st.step(wait=True)
    assert {k: r.pcm.size // SPF for k, r in res.items()} == {"a": 1, "b": 2, "c": 3}


def test_abort_with_window_in_flight_does_not_leak_into_a_reused_key(stage_factory) -> None:
    st, events = _async_stage(stage_factory)
    old = codes_to_tokens(st.cfg, _codes(np.random.default_rng(10), 3))
    st.open("x")
    st.push("x", old)
    st.step()
    st.abort("x")  # its chunk-0 window is still on the codec stream
    new = _codes(np.random.default_rng(11), 1)
    st.open("x")
    st.push("x", codes_to_tokens(st.cfg, new) + [st.cfg.end_token_id])
    st.step()
    for e in events:
        e.done = True
    res = st.step()["x"]
    assert res.done
    _assert_pcm_close(res.pcm, offline_decode(st.decoder, new, st.cfg.policy))


def test_trailing_partial_frame_dropped(stage_factory) -> None:
    st = stage_factory()
    codes = _codes(np.random.default_rng(7), 5)
    toks = codes_to_tokens(st.cfg, codes)
    st.open("p")
    st.push("p", toks + toks[:3])  # 5 frames + 3 tokens of a 6th
    st.close("p")
    res = st.step()["p"]
    assert res.done and res.error is None and res.pcm.size == 5 * SPF
    _assert_pcm_close(res.pcm, offline_decode(st.decoder, codes, st.cfg.policy))


def test_empty_stream_finishes(stage_factory) -> None:
    st = stage_factory()
    st.open("e")
    assert st.step() == {}
    st.push("e", [st.cfg.end_token_id])
    res = st.step()["e"]
    assert res.done and res.error is None and res.pcm.size == 0


# ---------------------------------------------------------------- implementation choice, cost model


def test_kernel_choice_config(cfg: CodecConfig) -> None:
    with pytest.raises(CodecError, match="CodecConfig.kernels"):
        replace(cfg, kernels="cuda")
    with pytest.raises(CodecError, match="CodecConfig.matmul_precision"):
        replace(cfg, matmul_precision="fp16")
    # "auto" on CPU keeps SNAC's torch layers (the fused kernels are tested in test_snac_kernels).
    assert CodecStage(cfg, CPU).decoder.kernels == "torch"


def test_cost_model_counts_the_decoders_macs(cfg: CodecConfig) -> None:
    """codec_flops_and_bytes' MACs equal the decoder convs' MACs counted by hooks."""
    from runner.codecs.cost import codec_flops_and_bytes

    model = load_snac(cfg, CPU)
    macs = 0

    def count(mod, inputs, out) -> None:
        nonlocal macs
        if isinstance(mod, torch.nn.ConvTranspose1d):
            macs += inputs[0].numel() * mod.out_channels * mod.kernel_size[0]
        else:
            macs += out.numel() * mod.in_channels // mod.groups * mod.kernel_size[0]

    convs = [m for m in model.decoder.modules() if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d))]
    hooks = [m.register_forward_hook(count) for m in convs]
    frames = 3
    with torch.no_grad():
        model.decoder(torch.zeros(1, model.latent_dim, 4 * frames))
    for h in hooks:
        h.remove()
    rows = codec_flops_and_bytes(model, frames)
    assert [r["stage"] for r in rows] == ["latent", "block0", "block1", "block2", "block3", "final"]
    assert sum(r["macs"] for r in rows) == macs
    assert rows == codec_flops_and_bytes(cfg, frames)  # from the config file: same numbers
    assert all(r["fused_bytes"] < r["torch_bytes"] for r in rows)
