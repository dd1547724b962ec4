"""Qwen3-TTS through the real engine (Engine -> scheduler -> FrameRunner -> FrameLog) on the CPU,
on the golden tiny checkpoints of tests/reference/qwen3_tts_golden.py: greedy frames equal the
reference's generate() (its N - 1 frames), batched with different prompts and trailing texts,
rows joining mid-run, async scheduling on and off, prefix cache on; the stop on code 0 == eos
(not before frame 2); the groups' own parameters; seeded sampling alone = in a busy batch;
request validation naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.codecs.mimi_stage import MimiCodecConfig
from runner.codecs.qwen12hz_stage import Qwen12HzCodecStage
from runner.config import EngineConfig
from runner.engine.engine import Engine
from runner.families import Qwen3TtsFamily
from runner.families.qwen3_tts import SUBTALKER_DEFAULTS, subtalker_sampling
from streaming.ipc import PromptVector
from streaming.profile import ModelProfile
from streaming.sampling_params import InvalidRequest, SamplingParams
from tests.support.engine_runs import drive_requests
from tests.support.tiny_qwen12hz import make_tiny_qwen12hz

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODELS = ("custom_voice", "ends", "base")  # base: x-vector and ICL (reference frames) prompts
GREEDY_GROUPS = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def golden(qwen3_tts_golden) -> Path:
    return qwen3_tts_golden("qwen3_tts_golden")


def cases(golden: Path, model: str) -> list[dict[str, np.ndarray]]:
    names = json.loads((golden / "manifest.json").read_text())["models"][model]
    return [dict(np.load(golden / model / f"{n}.npz"), name=n) for n in names]


def make_engine(folder: Path, *, async_scheduling: bool, prefix: bool = True, max_num_seqs: int = 8,
                codec: dict | None = None, num_blocks: int = 256) -> Engine:
    cfg = EngineConfig.build(folder, device="cpu", dtype="float32", max_model_len=128, max_num_batched_tokens=64,
                             max_num_seqs=max_num_seqs, block_size=4, num_blocks=num_blocks,
                             enable_prefix_caching=prefix, async_scheduling=async_scheduling)
    family = Qwen3TtsFamily(ModelProfile(family="qwen3_tts", speech=None, codec=codec), str(folder))
    return Engine(cfg, family=family, codec=family.build_codec(torch.device("cpu"), torch.float32))


def drive(engine: Engine, reqs: list[dict], sampling, join_every: int = 0, audio: bool = False) -> dict[str, dict]:
    """engine_runs.drive_requests over golden cases (prompt = its text ids, prompt_frames = its
    codec part, step_text_ids = its trailing text, group_sampling = its groups'); "finish" is
    the finish reason alone."""
    extra = [dict(prompt_frames=c["codec_ids"], step_text_ids=c["trailing_ids"].tolist(), group_sampling=c.get("groups"),
                  prompt_vectors=xvector(c)) for c in reqs]
    got = drive_requests(engine, [c["text_ids"].tolist() for c in reqs], sampling, join_every, audio, extra)
    for g in got.values():
        g["finish"] = g["finish"][0]
    return got


def xvector(case: dict) -> list[PromptVector] | None:
    """A golden case's x-vector over its speaker row (Base), as the front end sends it."""
    if "xvector" not in case:
        return None
    return [PromptVector(int(case["xvector_row"]), case["xvector"].astype("<f4").tobytes())]


def test_engine_view_and_layout(golden):
    folder = golden / "custom_voice" / "checkpoint"
    eng = make_engine(folder, async_scheduling=False)
    c = eng.family.config
    m = eng.cfg.model
    assert (m.vocab_size, m.eos_token_ids, m.num_layers, m.hidden_size) == (c.text_vocab_size, (c.tts_eos_id,), 2, 64)
    lay = eng.runner.layout
    assert (lay.row_width, lay.frame_id, lay.end_id) == (c.num_code_groups + 1, c.tts_pad_id, c.tts_eos_id)
    assert (lay.code0.vocab, lay.code0.num_codes, lay.code0.eos, lay.code0.min_frames) == (1056, 32, 42, 2)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("join_every", [0, 2])
def test_greedy_frames_equal_the_reference(golden, model, async_scheduling, join_every):
    """Every prompt kind of the model batched: each request's frames = the reference's generate()
    alone (max_new_tokens N: N - 1 frames). "ends": requests stop on code 0 == eos at frames 3,
    5 and 2 (the first min_new_tokens allows); the eos frame is reported as tts_eos."""
    refs = cases(golden, model)
    n = json.loads((golden / "manifest.json").read_text())["max_new_tokens"] - 1
    eng = make_engine(golden / model / "checkpoint", async_scheduling=async_scheduling)
    reqs = [dict(c, groups=GREEDY_GROUPS) for c in refs]
    got = drive(eng, reqs, SamplingParams(temperature=0.0, max_tokens=n), join_every=join_every)
    c = eng.family.config
    lengths = []
    for i, ref in enumerate(refs):
        g = got[f"r{i}"]
        ended = g["finish"] == "stop"
        np.testing.assert_array_equal(g["frames"][: len(g["frames"]) - ended], ref["frames"], err_msg=f"r{i}")
        assert g["ids"] == [c.tts_pad_id] * len(ref["frames"]) + [c.tts_eos_id] * ended
        if ended:
            assert g["frames"][-1, 0] == c.codec.eos
        lengths.append(len(ref["frames"]))
    assert [got[f"r{i}"]["finish"] for i in range(len(refs))] == (
        ["stop", "length", "stop", "stop"] if model == "ends" else ["length"] * len(refs))
    assert lengths == ([3, n, 5, 2] if model == "ends" else [n] * len(refs))
    assert not eng.requests


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_requests_recompute_their_rows(golden, async_scheduling):
    """A KV cache too small for all four: requests are preempted and recompute prompt + frames
    from their FrameLog rows (the generated positions' text ids included); frames unchanged."""
    refs = [dict(c, groups=GREEDY_GROUPS) for c in cases(golden, "custom_voice")]
    n = len(refs[0]["frames"])
    eng = make_engine(golden / "custom_voice" / "checkpoint", async_scheduling=async_scheduling, num_blocks=14,
                      prefix=False)
    got = drive(eng, refs, SamplingParams(temperature=0.0, max_tokens=n))
    assert eng.scheduler.num_preemptions > 0
    for i, ref in enumerate(refs):
        np.testing.assert_array_equal(got[f"r{i}"]["frames"], ref["frames"], err_msg=f"r{i}")


def test_trailing_text_feeds_the_frames(golden):
    """The same prompt with another trailing text gives other frames (the text column is read),
    and equal frames again when given the reference's."""
    ref = cases(golden, "custom_voice")[0]
    n = len(ref["frames"])
    other = dict(ref, trailing_ids=ref["trailing_ids"][::-1].copy(), groups=GREEDY_GROUPS)
    got = drive(make_engine(golden / "custom_voice" / "checkpoint", async_scheduling=True),
                [dict(ref, groups=GREEDY_GROUPS), other], SamplingParams(temperature=0.0, max_tokens=n))
    np.testing.assert_array_equal(got["r0"]["frames"], ref["frames"])
    assert not np.array_equal(got["r1"]["frames"], ref["frames"])
    np.testing.assert_array_equal(got["r1"]["frames"][0], ref["frames"][0])  # frame 0 reads no trailing text


def test_groups_sample_with_the_subtalker_parameters(golden, tmp_path):
    """Without group_sampling the groups draw with the folder's subtalker_* (sampled, so not the
    greedy reference's), code 0 stays greedy's for the first frame; generation_config.json is read."""
    ref = cases(golden, "custom_voice")[0]
    folder = golden / "custom_voice" / "checkpoint"
    assert subtalker_sampling(folder) == SamplingParams(temperature=0.9, top_k=50, top_p=1.0)
    assert subtalker_sampling(tmp_path) == SamplingParams(temperature=SUBTALKER_DEFAULTS["subtalker_temperature"],
                                                          top_k=50, top_p=1.0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"subtalker_dosample": False, "subtalker_top_k": 7}))
    assert subtalker_sampling(tmp_path) == SamplingParams(temperature=0.0, top_k=7, top_p=1.0)
    sp = SamplingParams(temperature=0.0, max_tokens=len(ref["frames"]), seed=5)
    got = drive(make_engine(folder, async_scheduling=False), [ref], sp)["r0"]["frames"]
    assert got[0, 0] == ref["frames"][0, 0] and not np.array_equal(got[:, 1:], ref["frames"][:, 1:])


def test_code0_window_and_eos_bar_under_sampling(golden):
    """Hot sampling over a head that favours eos ("ends"): code 0 is always a code or eos, and
    eos never comes before frame 2."""
    refs = cases(golden, "ends")
    eng = make_engine(golden / "ends" / "checkpoint", async_scheduling=True)
    sps = [SamplingParams(temperature=5.0, max_tokens=8, seed=s) for s in range(len(refs))]
    got = drive(eng, refs, sps)
    eos, v = eng.family.config.codec.eos, eng.family.config.codebook_size
    for g in got.values():
        code0 = g["frames"][:, 0]
        assert (code0[:-1] < v).all() and code0[-1] in (*range(v), eos)
        assert (code0[-1] == eos) == (g["finish"] == "stop")
        assert len(code0) >= 3 or g["finish"] == "length"  # eos not at frames 0, 1


def test_seeded_sampling_same_alone_and_in_a_busy_batch(golden):
    refs = cases(golden, "custom_voice")
    folder = golden / "custom_voice" / "checkpoint"
    sp = SamplingParams(temperature=0.9, top_k=20, max_tokens=8, seed=11)
    alone = drive(make_engine(folder, async_scheduling=True), [refs[1]], sp)["r0"]["frames"]
    others = [SamplingParams(temperature=1.0, top_p=0.8, max_tokens=8, seed=s) for s in (1, 2)]
    busy = drive(make_engine(folder, async_scheduling=True), [refs[0], refs[1], refs[2]],
                 [others[0], sp, others[1]], join_every=2)["r1"]["frames"]
    np.testing.assert_array_equal(alone, busy)
    assert len(np.unique(alone[:, 1:])) > 1  # sampled, not a constant


def test_prefix_cache_keys_on_the_rows(golden):
    """A second request with the same prompt hits the cache; its frames are unchanged; one whose
    prompt differs only in a codec id does not hit it past that position."""
    ref = dict(cases(golden, "custom_voice")[0], groups=GREEDY_GROUPS)
    eng = make_engine(golden / "custom_voice" / "checkpoint", async_scheduling=False)
    sp = SamplingParams(temperature=0.0, max_tokens=len(ref["frames"]))
    first = drive(eng, [ref], sp)["r0"]["frames"]
    hits = eng.blocks.hit_tokens_total
    again = drive(eng, [ref], sp)["r0"]["frames"]
    assert eng.blocks.hit_tokens_total > hits
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first, ref["frames"])
    other = dict(ref, codec_ids=ref["codec_ids"].copy())
    other["codec_ids"][1, 0] = ref["codec_ids"][3, 0]  # a think tag on a text-only position, block 0
    hits = eng.blocks.hit_tokens_total
    drive(eng, [other], sp)
    assert eng.blocks.hit_tokens_total == hits


@pytest.mark.parametrize("kwargs, field", [
    (dict(step_text_ids=[0, 10_000]), "step_text_ids"),
    (dict(prompt_frames=None), "prompt_frames"),
    (dict(prompt_frames="short"), "prompt_frames"),
    (dict(prompt_frames="bad_group"), "prompt_frames"),
    (dict(group_sampling=SamplingParams(temperature=-1.0)), "group_sampling.temperature"),
    (dict(group_sampling=SamplingParams(repetition_penalty=1.05)), "group_sampling.repetition_penalty"),
    # code 0 takes repetition_penalty only (the reference has no other): refused, not ignored
    (dict(sampling=SamplingParams(frequency_penalty=0.5)), "sampling.frequency_penalty"),
    (dict(sampling=SamplingParams(presence_penalty=0.5)), "sampling.presence_penalty"),
])
def test_bad_requests_name_the_field(golden, kwargs, field):
    ref = cases(golden, "custom_voice")[0]
    eng = make_engine(golden / "custom_voice" / "checkpoint", async_scheduling=False)
    frames = ref["codec_ids"]
    if kwargs.get("prompt_frames") == "short":
        kwargs["prompt_frames"] = frames[:-1]
    elif kwargs.get("prompt_frames") == "bad_group":
        kwargs["prompt_frames"] = frames.copy()
        kwargs["prompt_frames"][0, 1] = 32
    args = dict(prompt_frames=frames, step_text_ids=ref["trailing_ids"].tolist()) | kwargs
    sampling = args.pop("sampling", SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequest) as e:
        eng.add_request("x", ref["text_ids"].tolist(), sampling, **args)
    assert e.value.field == field
    assert not eng.requests


def test_other_families_refuse_step_text(tmp_path):
    from runner.families import TextFamily

    fam = TextFamily(ModelProfile(family="text", speech=None))
    assert fam.step_text(None) is None and fam.step_text([]) is None
    for args in (([1],), (None, True)):  # ids, or text to come
        with pytest.raises(InvalidRequest) as e:
            fam.step_text(*args)
        assert e.value.field == "step_text_ids"


@pytest.fixture(scope="module")
def codec_dir(tmp_path_factory) -> Path:
    """A tiny 12 Hz codec of the golden talkers' frames: 4 codebooks of 32 codes."""
    return make_tiny_qwen12hz(tmp_path_factory.mktemp("qwen12hz") / "tiny4", seed=1, num_quantizers=4)


@pytest.mark.parametrize("model", MODELS)
def test_audio_through_the_12hz_codec(golden, codec_dir, model):
    """Audio requests: the family's codec (Qwen12HzCodecStage from `codec.path`) gets every
    frame but the eos one, and streams their decode (= a fresh stage's decode of the same
    frames, within 1 int16 LSB: chunks differ); frames and ids are those without audio. An ICL
    prompt's reference frames (its rows with all K codes) prime the stream first, as the
    reference decodes ref_code + codes and cuts the reference's share."""
    refs = [dict(c, groups=GREEDY_GROUPS) for c in cases(golden, model)]
    n = json.loads((golden / "manifest.json").read_text())["max_new_tokens"] - 1
    sp = SamplingParams(temperature=0.0, max_tokens=n)
    eng = make_engine(golden / model / "checkpoint", async_scheduling=True, codec={"path": str(codec_dir)})
    assert isinstance(eng.codec, Qwen12HzCodecStage)
    got = drive(eng, refs, sp, join_every=1, audio=True)
    plain = drive(make_engine(golden / model / "checkpoint", async_scheduling=True), refs, sp, join_every=1)
    fresh = Qwen12HzCodecStage(MimiCodecConfig(path=str(codec_dir), max_chunk_frames=64), torch.device("cpu"))
    for i, ref in enumerate(refs):
        g, p = got[f"r{i}"], plain[f"r{i}"]
        assert (g["ids"], g["finish"]) == (p["ids"], p["finish"])
        np.testing.assert_array_equal(g["frames"], p["frames"])
        pcm = np.concatenate(g["pcm"])
        assert pcm.dtype == np.int16 and len(pcm) == len(ref["frames"]) * fresh.samples_per_frame
        clip = ref["codec_ids"][(ref["codec_ids"] >= 0).all(axis=1)]
        assert len(clip) == (3 if ref["name"].startswith("icl") else 0)  # the golden clips' 3 frames
        fresh.open(i, prefix_frames=clip if len(clip) else None)
        fresh.push_many([(i, f) for f in ref["frames"]])
        fresh.close(i)
        want, done = [], False
        while not done:
            r = fresh.step(wait=True).get(i)
            if r is not None:
                want += [r.pcm] if r.pcm is not None and len(r.pcm) else []
                done = r.done
        assert np.abs(pcm.astype(np.int32) - np.concatenate(want)).max() <= 1
        assert np.abs(pcm).max() > 100  # not silence


def test_a_codec_of_other_frames_is_refused(golden, tmp_path):
    other = make_tiny_qwen12hz(tmp_path / "tiny16", seed=1)  # 16 codebooks: not the talker's 4
    family = Qwen3TtsFamily(ModelProfile(family="qwen3_tts", speech=None, codec={"path": str(other)}),
                            str(golden / "custom_voice" / "checkpoint"))
    with pytest.raises(ValueError, match="frames of 16 codes of 32, the model emits 4 of 32"):
        family.build_codec(torch.device("cpu"), torch.float32)


def prompt_hidden(eng: Engine, case: dict) -> np.ndarray:
    """The talker's final hidden state at every prompt position of one greedy request."""
    eng.add_request("h", case["text_ids"].tolist(), SamplingParams(temperature=0.0, max_tokens=1),
                    hidden_state_layers=[-1], prompt_frames=case["codec_ids"], prompt_vectors=xvector(case),
                    group_sampling=GREEDY_GROUPS)
    rows = []
    while eng.has_unfinished:
        rows += [o.hidden[:, 0] for o in eng.step() if o.hidden is not None]
    return np.concatenate(rows)[: len(case["text_ids"])]


def test_the_x_vector_is_read_and_keys_the_prefix_cache(golden):
    """Base's x-vector case: the prompt's hidden states equal the reference's with the vector
    over its speaker row (and differ from that row on without it); a second request with the
    same vector computes only past the cached blocks and gives the reference's frames; another
    vector, or none, shares no block (the vector seeds every block's chain)."""
    ref = next(c for c in cases(golden, "base") if c["name"] == "xvector")
    row = int(ref["xvector_row"])
    eng = make_engine(golden / "base" / "checkpoint", async_scheduling=False, prefix=False)
    np.testing.assert_allclose(prompt_hidden(eng, ref), ref["prompt_hidden"], atol=1e-4)
    no_vector = {k: v for k, v in ref.items() if k != "xvector"}
    off = np.abs(prompt_hidden(eng, no_vector) - ref["prompt_hidden"]).max(axis=1)
    assert off[:row].max() < 1e-4 and off[row:].min() > 1e-2

    eng = make_engine(golden / "base" / "checkpoint", async_scheduling=False)
    sp = SamplingParams(temperature=0.0, max_tokens=len(ref["frames"]))
    other = dict(ref, xvector=np.random.default_rng(0).standard_normal(64).astype(np.float32) * 4)
    cached = []
    for case in (ref, ref, other, no_vector):
        before = eng.blocks.hit_tokens_total
        frames = drive(eng, [dict(case, groups=GREEDY_GROUPS)], sp)["r0"]["frames"]
        cached.append(eng.blocks.hit_tokens_total - before)
        if case is ref:
            np.testing.assert_array_equal(frames, ref["frames"])
    p = len(ref["text_ids"])
    assert cached[0] == 0 and cached[1] == (p - 1) // 4 * 4  # every full prompt block but the last position's
    assert cached[2:] == [0, 0]


@pytest.mark.parametrize("vectors, message", [
    ([PromptVector(99, b"\0" * 256)], "position 99 is outside the prompt"),
    ([PromptVector(2, b"\0" * 252)], "252 bytes, expected 64 float32"),
    ([PromptVector(2, b"\0" * 256), PromptVector(2, b"\0" * 256)], "positions must be distinct"),
    ([PromptVector(2, np.full(64, np.nan, "<f4").tobytes())], "values must be finite"),
])
def test_bad_prompt_vectors_name_the_field(golden, vectors, message):
    ref = next(c for c in cases(golden, "base") if c["name"] == "xvector")
    eng = make_engine(golden / "base" / "checkpoint", async_scheduling=False)
    with pytest.raises(InvalidRequest, match=message) as e:
        eng.add_request("x", ref["text_ids"].tolist(), SamplingParams(max_tokens=2), prompt_frames=ref["codec_ids"],
                        prompt_vectors=vectors)
    assert e.value.field == "prompt_vectors" and not eng.requests


def test_a_reference_frame_must_hold_codes(golden):
    """A row with group codes is a reference frame (it primes the codec): its code 0 must be a
    code, and no group may be missing."""
    ref = next(c for c in cases(golden, "base") if c["name"] == "icl_streaming")
    eng = make_engine(golden / "base" / "checkpoint", async_scheduling=False)
    row = int(np.flatnonzero((ref["codec_ids"] >= 0).all(axis=1))[0])
    for col, value in ((0, 41), (2, -1)):  # codec bos as code 0; a group left out
        frames = ref["codec_ids"].copy()
        frames[row, col] = value
        with pytest.raises(InvalidRequest, match="a position with group codes is a reference frame") as e:
            eng.add_request("x", ref["text_ids"].tolist(), SamplingParams(max_tokens=2), prompt_frames=frames)
        assert e.value.field == "prompt_frames"


def test_only_base_folders_encode_reference_clips(golden, tmp_path):
    """CustomVoice folders refuse an upload naming `audio`; a Base folder gives the clip's codes
    and its x-vector (the folder's speaker encoder)."""
    pcm = (np.sin(np.arange(24000) * 0.05) * 8000).astype(np.int16)
    codec_dir = make_tiny_qwen12hz(tmp_path / "enc", seed=1, encoder=True, num_quantizers=4)
    eng = make_engine(golden / "custom_voice" / "checkpoint", async_scheduling=False, codec={"path": str(codec_dir)})
    with pytest.raises(InvalidRequest, match="voice cloning needs a Base folder") as e:
        eng.encode_audio(pcm)
    assert e.value.field == "audio"
    eng = make_engine(golden / "base" / "checkpoint", async_scheduling=False, codec={"path": str(codec_dir)})
    ref = eng.encode_audio(pcm)
    assert ref.codes.shape == (-(-24000 // eng.codec.samples_per_frame), 4)  # ceil, as the reference keeps
    assert ref.speaker_embedding.shape == (64,) and ref.speaker_embedding.dtype == np.float32
    reply = ref.reply("u1")
    assert np.array_equal(np.frombuffer(reply.speaker_embedding, "<f4"), ref.speaker_embedding)
    with pytest.raises(InvalidRequest, match="too short") as e:
        eng.encode_audio(pcm[:100])
    assert e.value.field == "audio"


def drive_streaming_text(eng: Engine, reqs: list[dict], sp: SamplingParams, pieces: int, every: int) -> dict:
    """Each request starts with its trailing text's first id only (step_text_open) and gets the
    rest in `pieces` appends, one every `every` steps (the last one final), while the others
    run; -> frames per request, and (frames it had, text ids it had been given) at each append."""
    feeds, given = {}, {}
    for i, c in enumerate(reqs):
        given[f"r{i}"] = 1
        rest = c["trailing_ids"].tolist()
        eng.add_request(f"r{i}", c["text_ids"].tolist(), sp, prompt_frames=c["codec_ids"], step_text_ids=rest[:1],
                        group_sampling=GREEDY_GROUPS, prompt_vectors=xvector(c), step_text_open=True)
        cuts = np.linspace(1, len(rest), pieces + 1).round().astype(int)
        feeds[f"r{i}"] = [rest[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    got = {f"r{i}": [] for i in range(len(reqs))}
    seen = {k: [] for k in got}
    step = 0
    while eng.has_unfinished:
        if step % every == every - 1:
            for k, f in feeds.items():
                if f:
                    seen[k].append((sum(len(x) for x in got[k]), given[k]))
                    given[k] += len(f[0])
                    eng.append_text(k, f.pop(0), final=not f)
        for o in eng.step():
            if o.frames is not None:
                got[o.request_id].append(o.frames)
        step += 1
        assert step < 2000, "held rows never resumed"
    return {k: np.concatenate(v) for k, v in got.items()}, seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_streamed_text_gives_the_frames_of_the_whole_text(golden, async_scheduling):
    """The streaming-text prompts (CustomVoice speakers, Base x-vector and ICL) with their
    trailing text arriving in pieces while the rows run: each row is held while its next text
    id has not come (frame j + 1 needs text id j: with t ids it has at most t + 1 frames), and
    the greedy frames equal the reference's generate() with the whole text up front."""
    n = json.loads((golden / "manifest.json").read_text())["max_new_tokens"] - 1
    for model, names in (("custom_voice", ("speaker_streaming", "dialect_streaming")),
                         ("base", ("xvector", "icl_streaming"))):
        refs = [c for c in cases(golden, model) if c["name"] in names]
        eng = make_engine(golden / model / "checkpoint", async_scheduling=async_scheduling)
        got, seen = drive_streaming_text(eng, refs, SamplingParams(temperature=0.0, max_tokens=n), pieces=3, every=4)
        for i, ref in enumerate(refs):
            np.testing.assert_array_equal(got[f"r{i}"], ref["frames"], err_msg=f"{model} {ref['name']}")
            assert len(seen[f"r{i}"]) == 3
            for frames_then, ids_given in seen[f"r{i}"]:
                assert frames_then <= ids_given + 1, (ref["name"], frames_then, ids_given)
            assert any(f == g + 1 for f, g in seen[f"r{i}"]), "no row was ever held: the test proves nothing"
        assert not eng.requests


def test_append_text_rules(golden):
    ref = next(c for c in cases(golden, "custom_voice") if c["name"] == "speaker_streaming")
    eng = make_engine(golden / "custom_voice" / "checkpoint", async_scheduling=True)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    args = dict(prompt_frames=ref["codec_ids"], step_text_ids=ref["trailing_ids"][:1].tolist())
    eng.add_request("closed", ref["text_ids"].tolist(), sp, **args)
    with pytest.raises(InvalidRequest, match="takes no more text") as e:
        eng.append_text("closed", [5], final=True)
    assert e.value.field == "step_text_ids"
    eng.add_request("open", ref["text_ids"].tolist(), sp, step_text_open=True, **args)
    with pytest.raises(InvalidRequest) as e:
        eng.append_text("open", [10_000], final=False)
    assert e.value.field == "step_text_ids"
    assert eng.fail_request("open", e.value)
    outs = {o.request_id: o for _ in range(40) for o in eng.step() if o.finished}
    assert outs["open"].finish_reason == "error" and "step_text_ids" in outs["open"].error
    assert outs["closed"].finish_reason == "length"
    assert eng.append_text("closed", [5], final=True) is False  # gone: its text no longer matters
    # a row that waits for text schedules nothing: the engine says so (its loop blocks on input)
    eng.add_request("held", ref["text_ids"].tolist(), SamplingParams(temperature=0.0, max_tokens=8),
                    step_text_open=True, **args)
    for _ in range(10):
        eng.step()
    assert eng.stalled_on_input and eng.has_unfinished
    frames_before = eng.requests["held"].num_output_tokens
    eng.append_text("held", ref["trailing_ids"][1:].tolist(), final=True)
    while eng.has_unfinished:
        eng.step()
    assert frames_before <= 2


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_held_rows_preempted_and_recomputed_keep_their_frames(golden, async_scheduling):
    """A KV cache too small for all four CustomVoice prompts; speaker_streaming, added last,
    gets the rest of its text only at step 20, so it waits, the newest row, while the others
    grow: it is preempted while it waits, and recomputes up to its last position whose text
    has come (never one without its text id); every request's frames equal the reference's."""
    refs = cases(golden, "custom_voice")
    n = json.loads((golden / "manifest.json").read_text())["max_new_tokens"] - 1
    eng = make_engine(golden / "custom_voice" / "checkpoint", async_scheduling=async_scheduling, num_blocks=16,
                      prefix=False)
    sp = SamplingParams(temperature=0.0, max_tokens=n)
    for i in (1, 2, 3, 0):
        c, held = refs[i], i == 0
        trailing = c["trailing_ids"].tolist()
        eng.add_request(f"r{i}", c["text_ids"].tolist(), sp, prompt_frames=c["codec_ids"],
                        step_text_ids=trailing[:1] if held else trailing, group_sampling=GREEDY_GROUPS,
                        step_text_open=held)
    got = {f"r{i}": [] for i in range(4)}
    step, preempted = 0, 0
    while eng.has_unfinished:
        if step == 20:
            preempted = eng.requests["r0"].num_preemptions
            eng.append_text("r0", refs[0]["trailing_ids"].tolist()[1:], final=True)
        for o in eng.step():
            if o.frames is not None:
                got[o.request_id].append(o.frames)
        step += 1
    assert preempted > 0
    for i, ref in enumerate(refs):
        np.testing.assert_array_equal(np.concatenate(got[f"r{i}"]), ref["frames"], err_msg=ref["name"])


def test_warm_up_runs_the_familys_requests(golden, codec_dir):
    """The engine's start-up requests carry the family's prompt rows (a Qwen3-TTS request
    without them is refused: the CUDA server failed to start before ModelFamily.warm_up_args)."""
    eng = make_engine(golden / "custom_voice" / "checkpoint", async_scheduling=True, codec={"path": str(codec_dir)})
    eng.warm_up()
    assert not eng.has_unfinished and eng.num_requests_total == 0
