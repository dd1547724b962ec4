"""A multi-codebook talker (CSM) through the engine: frames against transformers' generate on a
tiny random-weight checkpoint loaded through the real path (profile -> family -> loader), batched,
joining mid-run, async scheduling on and off; seeded sampling alone and in a busy batch; the
prefix cache keyed on frames; frames through the Mimi codec stage as streamed PCM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.config import EngineConfig
from runner.engine.engine import Engine, EngineBusy
from runner.families import CsmFamily, family_for
from streaming.profile import read_profile
from streaming.sampling_params import InvalidRequest, SamplingParams
from runner.models.csm_config import CsmModelConfig
from runner.models.csm_loader import load_csm
from runner.models.csm_sampling import GreedyCodebooks
from tests.models.test_csm import PROMPTS, drive, hf_generate
from tests.support.engine_runs import drive_requests
from tests.support.tiny_models import CSM_AUDIO_EOS_TOKEN_ID, CSM_AUDIO_TOKEN_ID, load_hf_csm, make_tiny_csm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_FRAMES = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_FRAMES)


@pytest.fixture(scope="module")
def csm_dir(tmp_path_factory):
    return make_tiny_csm(tmp_path_factory.mktemp("csm_engine"), seed=3)


@pytest.fixture(scope="module")
def hf(csm_dir):
    return load_hf_csm(csm_dir)


@pytest.fixture(scope="module")
def reference(hf):
    return [hf_generate(hf, p, MAX_FRAMES).numpy() for p in PROMPTS]


def make_engine(path, *, async_scheduling: bool, codec: bool = False, prefix: bool = True, max_num_seqs: int = 8) -> Engine:
    cfg = EngineConfig.build(path, device="cpu", dtype="float32", max_model_len=128, max_num_batched_tokens=64,
                             max_num_seqs=max_num_seqs, block_size=4, num_blocks=256, enable_prefix_caching=prefix,
                             async_scheduling=async_scheduling)
    family = family_for(read_profile(path), str(path))
    return Engine(cfg, family=family, codec=family.build_codec(torch.device("cpu"), torch.float32) if codec else None)


def test_profile_and_family_are_csm(csm_dir):
    profile = read_profile(csm_dir)
    assert profile.family == "csm" and profile.codec["path"] == str(csm_dir)
    fam = family_for(profile, str(csm_dir))
    assert isinstance(fam, CsmFamily) and fam.codes_per_frame == 4
    assert fam.stop_token_ids() == (CSM_AUDIO_EOS_TOKEN_ID,)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("join_every", [0, 3])
def test_greedy_frames_equal_transformers(csm_dir, reference, async_scheduling, join_every):
    eng = make_engine(csm_dir, async_scheduling=async_scheduling)
    got = drive_requests(eng, PROMPTS, GREEDY, join_every=join_every)
    for i, ref in enumerate(reference):
        g = got[f"r{i}"]
        np.testing.assert_array_equal(g["frames"], ref)
        ended = int((ref[-1, :-1] == 0).all())
        assert g["ids"] == [CSM_AUDIO_TOKEN_ID] * (len(ref) - ended) + [CSM_AUDIO_EOS_TOKEN_ID] * ended
        assert g["finish"] == ("stop" if ended else "length", None)
    assert not eng.requests and eng.blocks.num_free_blocks == eng.num_blocks or eng.cfg.cache.enable_prefix_caching


def test_seeded_sampling_same_alone_and_in_a_busy_batch(csm_dir):
    sp = SamplingParams(temperature=0.9, top_k=20, max_tokens=10, seed=11)
    alone = drive_requests(make_engine(csm_dir, async_scheduling=True), [PROMPTS[1]], sp)["r0"]["frames"]
    others = [SamplingParams(temperature=1.0, top_p=0.8, max_tokens=10, seed=s) for s in (1, 2)]
    busy = drive_requests(make_engine(csm_dir, async_scheduling=True), [PROMPTS[0], PROMPTS[1], PROMPTS[2]],
               [others[0], sp, others[1]], join_every=2)["r1"]["frames"]
    np.testing.assert_array_equal(alone, busy)
    assert len(alone) and len(np.unique(alone[:, 1:])) > 1  # sampled, not a constant


def test_a_top_p_below_float32_range_keeps_the_top_token(csm_dir):
    """top_p 1e-300 validates (> 0) but is 0 in the float32 sampling rows; it used to keep no
    token (code 0 every time). It keeps the top token: the greedy frames."""
    greedy = drive_requests(make_engine(csm_dir, async_scheduling=True), [PROMPTS[1]],
                            SamplingParams(temperature=0.0, max_tokens=8))["r0"]["frames"]
    tiny = drive_requests(make_engine(csm_dir, async_scheduling=True), [PROMPTS[1]],
                          SamplingParams(temperature=1.0, top_p=1e-300, max_tokens=8, seed=3))["r0"]["frames"]
    np.testing.assert_array_equal(tiny, greedy)
    assert len(np.unique(greedy)) > 1  # not the all-zero frames of the bug


def test_prompt_frames_condition_the_output_and_hit_the_prefix_cache(csm_dir):
    """A voice prompt (text, the clip's frames, audio end, text): the engine's frames equal the
    standalone model's (tests/models/test_csm.py holds its prompt embedding and frames equal to
    transformers'); a second request with the same clip reuses the cached blocks, another clip
    under the same ids does not."""
    k = 4
    clip = np.random.default_rng(0).integers(1, 30, size=(5, k))
    prompt = [1, 5, 6] + [CSM_AUDIO_TOKEN_ID] * 5 + [CSM_AUDIO_EOS_TOKEN_ID, 1, 7, 8, 9]
    eng = make_engine(csm_dir, async_scheduling=True)
    eng.add_request("a", prompt, GREEDY, prompt_frames=clip.tolist())
    frames_a = []
    while eng.has_unfinished:
        frames_a += [o.frames for o in eng.step() if o.frames is not None]
    cfg = CsmModelConfig.from_pretrained(csm_dir)
    model = load_csm(cfg, "cpu", torch.float32)
    ref = drive(model, [prompt], MAX_FRAMES, lambda rows: GreedyCodebooks(), audio={0: torch.from_numpy(clip)})[0]
    np.testing.assert_array_equal(np.concatenate(frames_a), ref.numpy())
    hits = eng.blocks.hit_tokens_total
    eng.add_request("b", prompt[:-3] + [20, 21, 22], GREEDY, prompt_frames=clip.tolist())
    while eng.has_unfinished:
        eng.step()
    assert eng.blocks.hit_tokens_total - hits == 8  # the 2 full blocks (of 4) inside the 10 shared positions
    hits = eng.blocks.hit_tokens_total
    eng.add_request("c", prompt, GREEDY, prompt_frames=(clip + 1).tolist())
    while eng.has_unfinished:
        eng.step()
    assert eng.blocks.hit_tokens_total - hits == 0  # block 0 (ids 1 5 6 AUDIO) holds a frame: differs


def test_bad_requests_name_the_field(csm_dir):
    eng = make_engine(csm_dir, async_scheduling=False)
    cases = [
        (dict(prompt_frames=[[1, 2, 3, 4]]), "prompt_frames"),  # no audio position
        (dict(prompt_token_ids=[1, CSM_AUDIO_TOKEN_ID], prompt_frames=[[1, 2, 3]]), "prompt_frames"),
        (dict(prompt_token_ids=[1, CSM_AUDIO_TOKEN_ID], prompt_frames=[[1, 2, 3, 99]]), "prompt_frames"),
        (dict(sampling=SamplingParams(repetition_penalty=1.2)), "sampling.repetition_penalty"),
        (dict(hidden_state_layers=[7]), "hidden_state_layers"),  # the backbone has 2 layers
    ]
    for kw, field in cases:
        args = dict(prompt_token_ids=[1, 5, 6], sampling=GREEDY) | kw
        with pytest.raises(InvalidRequest) as e:
            eng.add_request("x", args.pop("prompt_token_ids"), args.pop("sampling"), **args)
        assert e.value.field == field, (kw, e.value)
    assert not eng.requests


def test_audio_streams_mimi_pcm_equal_to_offline_decode(csm_dir):
    from runner.codecs.mimi_loader import load_csm_codec

    eng = make_engine(csm_dir, async_scheduling=True, codec=True)
    sp = SamplingParams(temperature=0.9, top_k=20, max_tokens=9, seed=5)
    got = drive_requests(eng, PROMPTS[:2], sp, join_every=2, audio=True)
    mimi = load_csm_codec(csm_dir, torch.device("cpu"))
    for g in got.values():
        assert g["finish"][1] is None
        frames = g["frames"]
        audio_frames = frames[:-1] if g["finish"][0] == "stop" else frames  # the ending frame is not audio
        assert len(audio_frames) and audio_frames.max() < mimi.config.codebook_size  # CodecRange
        pcm = np.concatenate(g["pcm"])
        with torch.no_grad():
            ref = mimi.decode(torch.from_numpy(audio_frames.T[None].copy())).audio_values[0, 0].numpy()
        assert len(pcm) == len(ref) == 1920 * len(audio_frames)
        np.testing.assert_allclose(pcm / 32767.0, np.clip(ref, -1, 1), atol=2 / 32767)


def test_hidden_states_equal_transformers_backbone(csm_dir, hf):
    """Hidden states of chosen backbone layers (transformers' output_hidden_states indexing), for
    prompt and generated positions, each position once, beside the frames."""
    eng = make_engine(csm_dir, async_scheduling=True)
    layers = (0, 1, -1)
    eng.add_request("h", PROMPTS[1], GREEDY, hidden_state_layers=layers)
    rows, positions, frames = [], [], []
    while eng.has_unfinished:
        for o in eng.step():
            if o.hidden is not None:
                rows.append(o.hidden)
                positions += list(range(*o.hidden_positions))
            if o.frames is not None:
                frames.append(o.frames)
    hidden = np.concatenate(rows)  # [positions, 3, H]
    frames = np.concatenate(frames)
    assert positions == list(range(len(positions)))
    # transformers: the backbone over the prompt then the generated frames (all but the last,
    # whose position is never computed)
    with torch.no_grad():
        ids = torch.tensor([PROMPTS[1]])
        embeds = hf.embed_text_tokens(ids)  # text positions
        audio = hf.backbone_model.embed_tokens(torch.from_numpy(frames[:-1])[None])  # [1, F - 1, H] summed frames
        out = hf.backbone_model(inputs_embeds=torch.cat([embeds, audio], dim=1), output_hidden_states=True)
    ref = torch.stack([out.hidden_states[i] for i in (0, 1, len(out.hidden_states) - 1)], dim=2)[0].numpy()
    assert hidden.shape == ref.shape
    np.testing.assert_allclose(hidden, ref, atol=1e-4, rtol=1e-4)


def test_audio_requests_past_the_codec_streams_are_refused_and_the_engine_goes_on(csm_dir):
    # Mimi holds state per stream (MimiCodecConfig.max_streams): an audio request past them is
    # EngineBusy before anything is registered (it used to escape add_request as a CodecError
    # with the request half-registered, and kill the engine loop); requests without audio and,
    # once streams are free, new audio requests go on
    from runner.codecs.mimi_loader import load_csm_codec
    from runner.codecs.mimi_stage import MimiCodecConfig, MimiCodecStage

    cpu = torch.device("cpu")
    base = make_engine(csm_dir, async_scheduling=True)
    codec = MimiCodecStage(MimiCodecConfig(path=str(csm_dir), max_streams=2), cpu, torch.float32,
                           model=load_csm_codec(csm_dir, cpu))
    eng = Engine(base.cfg, family=base.family, codec=codec)
    sp = SamplingParams(temperature=0.9, top_k=20, max_tokens=4, seed=1, ignore_eos=True)
    eng.add_request("a", PROMPTS[0], sp, audio=True)
    eng.add_request("b", PROMPTS[1], sp, audio=True)
    with pytest.raises(EngineBusy, match="audio"):
        eng.add_request("c", PROMPTS[2], sp, audio=True)
    assert set(eng.requests) == {"a", "b"} and len(eng.scheduler.waiting) + len(eng.scheduler.running) == 2
    eng.add_request("d", PROMPTS[2], sp)  # frames only: no codec stream

    def run() -> dict:
        got: dict = {}
        while eng.has_unfinished:
            for o in eng.step():
                g = got.setdefault(o.request_id, {"pcm": 0, "finish": None})
                g["pcm"] += 0 if o.audio is None else len(o.audio)
                if o.finished:
                    g["finish"] = (o.finish_reason, o.error)
        return got

    got = run()
    assert {k: g["finish"] for k, g in got.items()} == {k: ("length", None) for k in "abd"}
    assert got["a"]["pcm"] == got["b"]["pcm"] == 4 * 1920 and got["d"]["pcm"] == 0
    eng.add_request("c", PROMPTS[2], sp, audio=True)  # the finished requests gave their streams back
    assert run()["c"] == {"pcm": 4 * 1920, "finish": ("length", None)}


def test_warm_up_with_fewer_codec_streams_than_its_decodes_starts(tmp_path):
    # the eager-prefill warm-up runs up to 8 decodes as speech; a codec holding fewer streams
    # (MimiCodecConfig.max_streams = 2) gets speech on those it has, the rest decode without
    # audio, instead of refusing the engine's own warm-up at start-up. (A text vocabulary whose
    # audio ids sit where the warm-up's synthetic prompts never reach, as CSM-1B's do.)
    from runner.codecs.mimi_loader import load_csm_codec
    from runner.codecs.mimi_stage import MimiCodecConfig, MimiCodecStage

    csm_dir = make_tiny_csm(tmp_path / "csm", seed=3, text_vocab=2048, audio_token_id=2047, audio_eos_token_id=2046)
    cpu = torch.device("cpu")
    cfg = EngineConfig.build(csm_dir, device="cpu", dtype="float32", max_model_len=400, max_num_batched_tokens=512,
                             max_num_seqs=9, block_size=4, num_blocks=512)
    family = family_for(read_profile(csm_dir), str(csm_dir))
    codec = MimiCodecStage(MimiCodecConfig(path=str(csm_dir), max_streams=2), cpu, torch.float32,
                           model=load_csm_codec(csm_dir, cpu))
    eng = Engine(cfg, family=family, codec=codec)
    eng.warm_up_eager_prefill()
    st = eng.stats()
    assert st.num_running == st.num_waiting == 0 and st.num_refused_total == 0 and len(codec) == 0


def test_warm_up_prompts_holding_the_audio_ids_start(csm_dir):
    """The eager-prefill warm-up's synthetic prompts reach every id of a small text vocabulary,
    the audio token (90) and its end (91) among them: the family gives their frames
    (CsmFamily.warm_up_args) instead of the engine refusing its own start-up request."""
    cfg = EngineConfig.build(csm_dir, device="cpu", dtype="float32", max_model_len=400, max_num_batched_tokens=512,
                             max_num_seqs=9, block_size=4, num_blocks=512)
    eng = Engine(cfg, family=family_for(read_profile(csm_dir), str(csm_dir)), codec=None)
    eng.warm_up_eager_prefill()
    st = eng.stats()
    assert st.num_running == st.num_waiting == 0 and st.num_refused_total == 0 and eng.num_requests_total == 10


def test_warm_up_runs_a_prompt_at_every_uncaptured_row_bucket(csm_dir):
    """warm_up_row_buckets: one prompt step of each graph bucket's row count above the captured
    ones (none captured here: graphs off), up to MAX_TOKEN_ROW_QUERY, each computed whole (no
    prefix shared between them)."""
    from runner.engine.cuda_graphs import graph_buckets
    from runner.engine.model_runner import MAX_TOKEN_ROW_QUERY

    cfg = EngineConfig.build(csm_dir, device="cpu", dtype="float32", max_model_len=400, max_num_batched_tokens=512,
                             max_num_seqs=4, block_size=4, num_blocks=512, cuda_graphs=False)
    eng = Engine(cfg, family=family_for(read_profile(csm_dir), str(csm_dir)), codec=None)
    eng.warm_up_row_buckets()
    want = graph_buckets(MAX_TOKEN_ROW_QUERY)
    st = eng.stats()
    assert want[-1] == MAX_TOKEN_ROW_QUERY and st.num_requests_total == len(want)
    assert st.num_prefix_cache_hit_tokens == 0 and st.num_refused_total == 0 and not eng.has_unfinished


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_lone_audio_request_ended_by_its_stop_frame_finishes(csm_dir, async_scheduling):
    """The frame that ends the audio is not pushed to the codec; when it is the step's only row
    the codec stream must still be closed (it was not: the request never finished, its codec
    stream leaked and the engine spun on empty steps)."""
    eng = make_engine(csm_dir, async_scheduling=async_scheduling, codec=True)
    assert eng.model.cfg.codebook_eos_id == 0
    with torch.no_grad():  # every logit 0: greedy draws code 0 in every codebook, the stop frame
        eng.model.lm_head.weight.zero_()
        eng.model.depth.codebooks_head.zero_()
    eng.add_request("lone", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=9), audio=True)
    outs = []
    for _ in range(50):
        outs += eng.step()
        if not eng.has_unfinished:
            break
    done = [o for o in outs if o.finished]
    assert len(done) == 1 and done[0].finish_reason == "stop" and done[0].error is None
    assert not eng.has_unfinished and len(eng.codec) == 0 and not eng.requests
    assert sum(0 if o.audio is None else len(o.audio) for o in outs) == 0  # no audio frame came before it
