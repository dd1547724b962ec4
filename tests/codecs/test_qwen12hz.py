"""Qwen3-TTS's 12 Hz codec decoder (runner/codecs/qwen12hz.py), streamed: equal to the reference
decode (qwen-tts 0.1.1's golden files, tests/reference/qwen3_tts_codec_golden.py) in float64 and
float32 / int16, chunked in any way, slots independent and reusable; the encoder's codes; the
loader's errors. Tests marked "no reference" run on a tiny random folder (tests/support) (CPU)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from runner.codecs.config import CodecError
from runner.codecs.decoder import float_to_s16
from runner.codecs.qwen12hz import Qwen12HzStreamingDecoder, load_qwen12hz_decoder
from runner.codecs.mimi_stage import MimiCodecConfig
from runner.codecs.qwen12hz_loader import load_decoder_tensors, load_encoder, read_config
from runner.codecs.qwen12hz_stage import Qwen12HzCodecStage
from tests.support.tiny_qwen12hz import make_tiny_qwen12hz

CPU = torch.device("cpu")
K, SPF = 16, 1920
LENGTHS = (1, 5, 37, 120, 300)  # the golden decodes' frame counts
F64_TOL = 1e-10  # float64 port vs float64 reference: measured ~2e-14
F32_TOL = 2e-5  # float32 vs the reference's float32 decode of a ~0.2-std signal: measured ~4e-6 (the
# reference's own float32 decode is ~3e-6 from its float64 one)


@pytest.fixture(scope="module")
def golden(qwen3_tts_golden) -> Path:
    torch.set_num_threads(1)  # the test machine's cores are shared
    return qwen3_tts_golden("qwen3_tts_codec_golden")


@pytest.fixture(scope="module")
def reference(golden: Path) -> dict[str, np.ndarray]:
    with np.load(golden / "decode.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return make_tiny_qwen12hz(tmp_path_factory.mktemp("qwen12hz") / "tiny", seed=0)


def _stream(dec: Qwen12HzStreamingDecoder, codes: np.ndarray, chunks: list[int]) -> torch.Tensor:
    """codes (n, K) through a fresh slot in chunks of the given frame counts -> float PCM (n * SPF,)."""
    slot, parts, i = dec.new_stream(), [], 0
    for c in chunks:
        out = dec.decode([slot], torch.from_numpy(codes[i : i + c]).T[None])
        assert out.shape == (1, c * SPF)
        parts.append(out[0])
        i += c
    assert i == len(codes)
    dec.free(slot)
    return torch.cat(parts)


def _max_lsb(got: torch.Tensor | np.ndarray, want: np.ndarray) -> int:
    """Max |difference| in int16 LSB of float PCM (or int16 PCM) from the reference's float PCM."""
    a = (float_to_s16(got).numpy() if isinstance(got, torch.Tensor) else got).astype(np.int32)
    b = float_to_s16(torch.from_numpy(want.astype(np.float32))).numpy().astype(np.int32)
    assert a.shape == b.shape
    return int(np.abs(a - b).max(initial=0))


# ---------------------------------------------------------------- against the reference


def test_float64_decode_equals_the_reference(golden: Path, reference: dict[str, np.ndarray]) -> None:
    # the port's arithmetic is the reference's: in float64 only rounding at 1e-14 is left
    dec = load_qwen12hz_decoder(golden, CPU, torch.float64)
    for n in LENGTHS:
        got = _stream(dec, reference[f"codes_{n}"], [n])
        assert (got.numpy() - reference[f"pcm64_{n}"]).__abs__().max() <= F64_TOL, n


@pytest.mark.parametrize("chunks", [[1] * 37, [1, 2, 3, 5, 8, 13, 5], [4, 33], [37]])
def test_streamed_chunks_equal_the_reference_float32(golden: Path, reference: dict[str, np.ndarray],
                                                     chunks: list[int]) -> None:
    # 37 frames: past the tiny codec's 4-frame attention window many times over, and chunks
    # shorter and longer than the window
    dec = load_qwen12hz_decoder(golden, CPU)
    got = _stream(dec, reference["codes_37"], chunks)
    assert (got.numpy() - reference["pcm_37"]).__abs__().max() <= F32_TOL
    assert _max_lsb(got, reference["pcm_37"]) <= 1


def test_300_frames_in_uneven_chunks_equal_the_reference(golden: Path, reference: dict[str, np.ndarray]) -> None:
    # the reference's one-chunk limit (it decodes longer sequences in pieces: docs/qwen3_tts.md §3)
    dec = load_qwen12hz_decoder(golden, CPU)
    chunks = [1, 2, 4, 8, 16, 32, 64, 100, 73]
    for n, ch in ((300, chunks), (120, [7] * 17 + [1]), (5, [2, 3]), (1, [1])):
        got = _stream(dec, reference[f"codes_{n}"], ch)
        assert (got.numpy() - reference[f"pcm_{n}"]).__abs__().max() <= F32_TOL, n
        assert _max_lsb(got, reference[f"pcm_{n}"]) <= 1, n


def test_interleaved_streams_and_batches_are_independent(golden: Path, reference: dict[str, np.ndarray]) -> None:
    # two streams in one decoder: alone, interleaved, and batched in one call with other
    # chunk sizes; each equals its own reference decode
    dec = load_qwen12hz_decoder(golden, CPU, initial_streams=1)  # the pools grow under the streams
    a, b = reference["codes_120"], reference["codes_37"]
    sa, sb = dec.new_stream(), dec.new_stream()
    assert sa != sb
    got_a, got_b = [], []
    i = j = 0
    for step in range(20):
        if step % 3 == 0 and j < len(b):  # both in one call, 2 frames each
            out = dec.decode([sb, sa], torch.from_numpy(np.stack([b[j : j + 2], a[i : i + 2]])).transpose(1, 2))
            got_b.append(out[0])
            got_a.append(out[1])
            i, j = i + 2, j + 2
        else:
            n = 1 + step % 4
            got_a.append(dec.decode([sa], torch.from_numpy(a[i : i + n]).T[None])[0])
            i += n
            if j < len(b):
                got_b.append(dec.decode([sb], torch.from_numpy(b[j : j + 1]).T[None])[0])
                j += 1
    ga, gb = torch.cat(got_a), torch.cat(got_b)
    assert (ga.numpy() - reference["pcm_120"][: len(ga)]).__abs__().max() <= F32_TOL
    assert (gb.numpy() - reference["pcm_37"][: len(gb)]).__abs__().max() <= F32_TOL
    assert len(ga) > 40 * SPF and len(gb) > 20 * SPF  # both streams ran past the window


def test_a_freed_slot_starts_the_next_stream_fresh(golden: Path, reference: dict[str, np.ndarray]) -> None:
    dec = load_qwen12hz_decoder(golden, CPU)
    slot = dec.new_stream()
    dec.decode([slot], torch.from_numpy(reference["codes_37"][:9]).T[None])  # state in every pool
    dec.free(slot)
    again = dec.new_stream()
    assert again == slot  # the same slot, reset
    got = dec.decode([again], torch.from_numpy(reference["codes_5"]).T[None])[0]
    assert (got.numpy() - reference["pcm_5"]).__abs__().max() <= F32_TOL


def test_the_comparison_sees_the_window(golden: Path, reference: dict[str, np.ndarray]) -> None:
    # a wider attention window decodes far from the reference: a ring that forgot the window
    # (or a transformer that did nothing) fails the tests above
    cfg = read_config(golden)
    wide = Qwen12HzStreamingDecoder(dataclasses.replace(cfg, sliding_window=64), load_decoder_tensors(golden, cfg), CPU)
    got = _stream(wide, reference["codes_37"], [37])
    assert (got.numpy() - reference["pcm_37"]).__abs__().max() > 100 * F32_TOL


def test_encoder_codes_equal_the_reference(golden: Path) -> None:
    with np.load(golden / "encode.npz") as z:
        wav, want = z["wav"], z["codes"]
    enc = load_encoder(golden, CPU)
    with torch.inference_mode():
        codes = enc.encode(torch.from_numpy(wav)[None, None]).audio_codes[0]  # (quantizers, frames)
    frames = -(-len(wav) // SPF)  # the reference keeps ceil(samples / 1920) frames of the first 16 rows
    np.testing.assert_array_equal(codes[:K, :frames].T.numpy(), want)


# ---------------------------------------------------------------- no reference


def test_prefix_causality(tiny_dir: Path) -> None:
    # the first n frames' decode is the prefix of a longer decode: nothing looks ahead
    dec = load_qwen12hz_decoder(tiny_dir, CPU, torch.float64)
    codes = np.random.default_rng(1).integers(0, 32, size=(24, K), dtype=np.int64)
    full = _stream(dec, codes, [24])
    for n in (1, 3, 10):
        assert (_stream(dec, codes[:n], [n]) - full[: n * SPF]).abs().max().item() <= 1e-12


def test_chunking_does_not_change_the_decode(tiny_dir: Path) -> None:
    dec = load_qwen12hz_decoder(tiny_dir, CPU)
    codes = np.random.default_rng(2).integers(0, 32, size=(20, K), dtype=np.int64)
    whole = _stream(dec, codes, [20])
    assert whole.std() > 0.05  # a signal, not silence
    for chunks in ([1] * 20, [2, 7, 1, 10], [3, 17]):
        assert (_stream(dec, codes, chunks) - whole).abs().max().item() <= 1e-5


def test_max_streams_and_codebook_count_are_enforced(tiny_dir: Path) -> None:
    dec = load_qwen12hz_decoder(tiny_dir, CPU, max_streams=2, initial_streams=1)
    dec.new_stream(), dec.new_stream()
    with pytest.raises(CodecError, match="max_streams: all 2 Qwen3-TTS 12 Hz"):
        dec.new_stream()
    dec.free(0)
    with pytest.raises(CodecError, match="16 codebooks a frame, got 8"):
        dec.decode([0], torch.zeros(1, 8, 1, dtype=torch.int64))


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_loader_errors_name_the_bad_tensor(tiny_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    name = "decoder.pre_transformer.layers.1.self_attn.k_proj.weight"
    cases = (
        ({k: v for k, v in tensors.items() if k != name}, f"tensor {name} missing"),
        ({**tensors, name: tensors[name][:, :-1].contiguous()}, f"tensor {name} has shape \\(16, 31\\)"),
        ({**tensors, "decoder.pre_transformer.layers.0.self_attn.q_norm.weight": torch.ones(8)},
         "unexpected tensor decoder.pre_transformer.layers.0.self_attn.q_norm.weight"),
    )
    for i, (state, match) in enumerate(cases):
        bad = _copy(tiny_dir, tmp_path / str(i))
        save_file(state, str(bad / "model.safetensors"))
        with pytest.raises(CodecError, match=match):
            load_qwen12hz_decoder(bad, CPU)


def test_loader_refuses_configs_it_does_not_run(tiny_dir: Path, tmp_path: Path) -> None:
    raw = json.loads((tiny_dir / "config.json").read_text())
    cases = (
        ({"decoder_config": {**raw["decoder_config"], "hidden_act": "gelu"}}, "decoder_config.hidden_act"),
        ({"decoder_config": {**raw["decoder_config"], "rope_scaling": {"rope_type": "yarn"}}},
         "decoder_config.rope_scaling"),
        ({"decode_upsample_rate": 960}, "decode_upsample_rate: 960"),
    )
    for i, (change, match) in enumerate(cases):
        bad = _copy(tiny_dir, tmp_path / str(i))
        (bad / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(CodecError, match=match):
            read_config(bad)
    with pytest.raises(CodecError, match="no config.json"):
        read_config(tmp_path)
    # a model folder holding the tokenizer as speech_tokenizer/ is found too
    model_dir = tmp_path / "model"
    _copy(tiny_dir, model_dir / "speech_tokenizer")
    assert read_config(model_dir) == read_config(tiny_dir)


# ---------------------------------------------------------------- the codec stage


def _run_stage(stage: Qwen12HzCodecStage, frames: dict[str, np.ndarray], prefixes: dict | None = None) -> dict:
    """Stream i opens at step i (primed with prefixes[key] if given), one frame a step each."""
    out: dict[str, list[np.ndarray]] = {k: [] for k in frames}
    sent, done, step = dict.fromkeys(frames, 0), set(), 0
    while step == 0 or len(stage):
        for i, (key, f) in enumerate(frames.items()):
            if step == i:
                stage.open(key, prefix_frames=(prefixes or {}).get(key))
            if i <= step and sent[key] < len(f):
                stage.push_many([(key, f[sent[key]])])
                sent[key] += 1
                if sent[key] == len(f):
                    stage.close(key)
        for key, r in stage.step().items():
            assert r.error is None, r.error
            out[key].append(r.pcm)
            if r.done:
                done.add(key)
        step += 1
    assert done == set(frames)
    return {k: np.concatenate(v) for k, v in out.items()}


def test_stage_streams_the_reference_pcm(golden: Path, reference: dict[str, np.ndarray]) -> None:
    stage = Qwen12HzCodecStage(MimiCodecConfig(path=str(golden), max_chunk_frames=8), CPU)
    assert (stage.num_codebooks, stage.codebook_size, stage.samples_per_frame) == (K, 64, SPF)
    got = _run_stage(stage, {"a": reference["codes_120"], "b": reference["codes_37"], "c": reference["codes_5"]})
    for key, n in (("a", 120), ("b", 37), ("c", 5)):
        assert got[key].dtype == np.int16 and _max_lsb(got[key], reference[f"pcm_{n}"]) <= 1


def test_stage_priming_is_the_cut_decode_of_prefix_and_frames(golden: Path, reference: dict[str, np.ndarray]) -> None:
    # Qwen3-TTS's voice clone decodes ref_codes + generated and cuts the first ref_len * 1920
    # samples: a stream primed with the reference frames emits exactly the rest
    stage = Qwen12HzCodecStage(MimiCodecConfig(path=str(golden), max_chunk_frames=4), CPU)
    codes = reference["codes_37"]
    got = _run_stage(stage, {"x": codes[11:], "plain": codes[:5]}, prefixes={"x": codes[:11]})
    assert _max_lsb(got["x"], reference["pcm_37"][11 * SPF :]) <= 1
    assert _max_lsb(got["plain"], reference["pcm_37"][: 5 * SPF]) <= 1  # unprimed beside it: the plain prefix
    with pytest.raises(CodecError, match="prefix_frames: frame 1, codebook 3: code 64"):
        bad = codes[:2].copy()
        bad[1, 3] = 64
        stage.open("bad", prefix_frames=bad)
    with pytest.raises(CodecError, match="prefix_frames: \\(frames, 16\\)"):
        stage.open("bad", prefix_frames=codes[:2, :8])


def test_stage_encodes_as_the_reference(golden: Path) -> None:
    with np.load(golden / "encode.npz") as z:
        wav, want = z["wav"], z["codes"]
    stage = Qwen12HzCodecStage(MimiCodecConfig(path=str(golden)), CPU)
    pcm = np.round(wav * 32768.0).clip(-32768, 32767).astype(np.int16)  # the stage takes int16
    # the clip rounded to int16 gives the same codes here (measured); a near-tie in a codebook
    # search could move one, so this pins what this clip does
    np.testing.assert_array_equal(stage.encode(pcm), want)


def test_the_released_codec_config_reads(tmp_path: Path) -> None:
    """The released tokenizer's config parses, and the decoder it describes has 114,323,137
    parameters: 436.1 MiB in float32, the size of the released decoder's weights (a port's
    weights file), so the tensor map covers exactly the real decoder."""
    from runner.codecs.qwen12hz_loader import RELEASED_DECODER_CONFIG, decoder_shapes

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_tts_tokenizer_12hz", "input_sample_rate": 24000, "output_sample_rate": 24000,
        "decode_upsample_rate": 1920, "encode_downsample_rate": 1920, "decoder_config": RELEASED_DECODER_CONFIG}))
    cfg = read_config(tmp_path)
    assert (cfg.num_quantizers, cfg.codebook_size, cfg.sliding_window, cfg.sample_rate) == (16, 2048, 72, 24000)
    assert int(np.prod(cfg.upsample_rates)) * int(np.prod(cfg.upsampling_ratios)) == 1920
    assert sum(int(np.prod(s)) for s in decoder_shapes(cfg).values()) == 114_323_137
