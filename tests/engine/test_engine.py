"""Engine core against transformers on the same weights, plus the scheduling invariants
(async on/off, seeds, preemption, prefix cache, aborts, bad input)."""

from __future__ import annotations

import random

import pytest
import torch

from runner.config import EngineConfig
from runner.engine.engine import Engine
from streaming.sampling_params import InvalidRequest, SamplingParams
from tests.support.tiny_models import load_hf

FAMILIES = {
    "llama": dict(rope_llama3=True, tie=False),
    "qwen2": dict(tie=True),
    "qwen3": dict(tie=False),
}
NEW_TOKENS = 64


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tiny_model_dir):
    fam = request.param
    path = tiny_model_dir(fam, seed=7, **FAMILIES[fam])
    return fam, path, load_hf(path)


@pytest.fixture(scope="module")
def llama_path(tiny_model_dir):
    return tiny_model_dir("llama", seed=3)


def make_engine(path, *, block_size=4, num_blocks=512, prefix=True, max_model_len=256, budget=64,
                max_num_seqs=16, async_scheduling=False) -> Engine:
    cfg = EngineConfig.build(
        path, device="cpu", dtype="float32", max_model_len=max_model_len, max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs, block_size=block_size, num_blocks=num_blocks,
        enable_prefix_caching=prefix, async_scheduling=async_scheduling,
    )
    return Engine(cfg)


def prompts_of(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run_staggered(engine: Engine, prompts, sampling, join_every=3):
    """Add prompt i after i*join_every steps, so requests join a running batch mid-decode."""
    outs = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished:
        while pending and step >= pending[0][0] * join_every:
            i, p = pending.pop(0)
            sp = sampling[i] if isinstance(sampling, list) else sampling
            engine.add_request(f"r{i}", p, sp)
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
        step += 1
        assert step < 10_000
    return [outs[f"r{i}"] for i in range(len(prompts))]


def hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                      min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("async_sched", [False, True])
def test_greedy_matches_transformers(family_model, async_sched):
    fam, path, hf = family_model
    lengths = [1, 3, 7, 12, 17, 25, 33, 48]
    prompts = prompts_of(lengths, hf.config.vocab_size, seed=len(fam))
    eng = make_engine(path, async_scheduling=async_sched)
    got = run_staggered(eng, prompts, GREEDY)
    for p, g in zip(prompts, got):
        assert len(g) == NEW_TOKENS
        assert g == hf_greedy(hf, p, NEW_TOKENS)
    assert eng.blocks.num_free_blocks == eng.num_blocks


def test_logits_and_hidden_states_match(family_model):
    fam, path, hf = family_model
    L = hf.config.num_hidden_layers
    eng = make_engine(path, budget=16)  # prompt 30 -> two prefill chunks
    prompt = prompts_of([30], hf.config.vocab_size, seed=1)[0]
    layers = (0, 1, L)
    eng.add_request("h", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), hidden_state_layers=layers)
    toks, rows, positions = [], [], []
    while eng.has_unfinished:
        for o in eng.step():
            toks += o.new_token_ids
            if o.hidden is not None:
                rows.append(torch.from_numpy(o.hidden.copy()))
                positions.append(o.hidden_positions)
    hid = torch.cat(rows)  # [n_positions, len(layers), H]
    seq = prompt + toks[:-1]  # the last sampled token is never fed back
    assert hid.shape == (len(seq), len(layers), hf.config.hidden_size)
    assert positions[0][0] == 0 and all(a[1] == b[0] for a, b in zip(positions, positions[1:]))
    with torch.no_grad():
        ref = hf(torch.tensor([seq]), output_hidden_states=True)
    for j, l in enumerate(layers):
        torch.testing.assert_close(hid[:, j], ref.hidden_states[l][0], atol=1e-4, rtol=1e-4)
    # the engine's greedy choice at every step is HF's argmax on the same sequence
    assert toks == ref.logits[0, len(prompt) - 1 :].argmax(-1).tolist()
    # and the runner's logits equal HF's for a fresh single forward
    eng2 = make_engine(path)
    # sampled, not greedy: an all-greedy step takes argmax without the fp32 logits (greedy_ids)
    eng2.add_request("l", seq, SamplingParams(temperature=1.0, seed=0, max_tokens=1, ignore_eos=True))
    captured = {}
    orig = eng2.runner.model.compute_logits

    def spy(h):
        captured["logits"] = orig(h)
        return captured["logits"]

    eng2.runner.model.compute_logits = spy
    while eng2.has_unfinished:
        eng2.step()
    torch.testing.assert_close(captured["logits"][0], ref.logits[0, -1].float(), atol=1e-4, rtol=1e-4)


SAMPLED = [
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.2, top_k=20, repetition_penalty=1.3, seed=5, max_tokens=33, ignore_eos=True),
    SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.7, min_p=0.1, seed=99, max_tokens=25, ignore_eos=True),
]


def test_async_scheduling_gives_identical_tokens(llama_path):
    prompts = prompts_of([5, 9, 14, 21], 512, seed=4)
    a = run_staggered(make_engine(llama_path, async_scheduling=False), prompts, SAMPLED)
    b = run_staggered(make_engine(llama_path, async_scheduling=True), prompts, SAMPLED)
    assert a == b
    assert [len(x) for x in a] == [s.max_tokens for s in SAMPLED]


def test_all_greedy_steps_skip_the_fp32_logits_unless_something_changes_them(llama_path):
    """Steps whose rows are all greedy with no penalty or bias take argmax of the model-dtype
    logits (greedy_ids); a repetition penalty or a min_tokens EOS ban brings back the fp32
    logits and the sampler. Tokens: tests above (greedy == transformers)."""
    eng = make_engine(llama_path)
    model = eng.runner.model
    calls = {"logits": 0, "greedy": 0}
    logits, greedy = model.compute_logits, model.greedy_ids
    model.compute_logits = lambda *a: calls.__setitem__("logits", calls["logits"] + 1) or logits(*a)
    model.greedy_ids = lambda *a: calls.__setitem__("greedy", calls["greedy"] + 1) or greedy(*a)
    prompt = prompts_of([6], 512, seed=3)
    run_staggered(eng, prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert calls == {"logits": 0, "greedy": 5}
    for sp in (SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=5, ignore_eos=True),
               SamplingParams(temperature=0.0, min_tokens=3, max_tokens=5)):
        calls.update(logits=0, greedy=0)
        run_staggered(eng, prompt, sp)
        assert calls["logits"] >= 3 and calls["greedy"] <= 2, (sp, calls)


@pytest.mark.parametrize("async_sched", [False, True])
def test_seeded_request_same_alone_and_in_busy_batch(llama_path, async_sched):
    sp = SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.1, seed=1234, max_tokens=48, ignore_eos=True)
    prompt = prompts_of([10], 512, seed=9)[0]
    alone = make_engine(llama_path, async_scheduling=async_sched).generate([prompt], sp)[0]
    others = prompts_of([3, 30, 8, 17, 22, 5], 512, seed=10)
    noise = [SamplingParams(temperature=1.0, max_tokens=30 + i, ignore_eos=True) for i in range(len(others))]
    busy = run_staggered(make_engine(llama_path, async_scheduling=async_sched), others[:3] + [prompt] + others[3:],
                         noise[:3] + [sp] + noise[3:], join_every=2)[3]
    assert busy == alone
    different_seed = make_engine(llama_path).generate([prompt], SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.1, seed=4321, max_tokens=48, ignore_eos=True))[0]
    assert different_seed != alone


@pytest.mark.parametrize("async_sched", [False, True])
def test_preemption_with_tiny_cache_keeps_outputs(llama_path, async_sched):
    prompts = prompts_of([20, 24, 28, 18, 26, 22], 512, seed=12)
    sps = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.8, seed=s, max_tokens=40, ignore_eos=True) for s in (1, 2, 3)]
    ref = run_staggered(make_engine(llama_path, num_blocks=512), prompts, sps, join_every=0)
    small = make_engine(llama_path, num_blocks=40, async_scheduling=async_sched)  # 160 slots < 6 x 65 tokens
    got = run_staggered(small, prompts, sps, join_every=0)
    assert small.scheduler.num_preemptions > 0
    assert got == ref
    assert small.blocks.num_free_blocks == small.num_blocks
    assert all(r == 0 for r in small.blocks.ref)


def test_prefix_cache_computes_only_new_tokens(llama_path):
    eng = make_engine(llama_path, budget=256)
    prefix = prompts_of([40], 512, seed=13)[0]
    a, b = prefix + [7, 8, 9], prefix + [10, 11]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out_a = eng.generate([a], sp)[0]
    eng.add_request("b", b, sp)
    sched = eng.scheduler.schedule()
    (entry,) = sched.scheduled
    assert entry.start == 40 and entry.num_tokens == 2  # 10 cached blocks of 4 reused
    assert entry.req.num_cached_tokens == 40
    # undo the peek and run normally: same output as an engine without prefix caching
    eng2 = make_engine(llama_path, budget=256)
    eng2.add_request("b", b, sp)
    out_b = []
    while eng2.has_unfinished:
        for o in eng2.step():
            out_b += o.new_token_ids
            cached = o.num_cached_tokens
    assert cached == 0  # fresh engine: nothing cached
    nocache = make_engine(llama_path, budget=256, prefix=False)
    assert nocache.generate([b], sp)[0] == out_b
    fresh = make_engine(llama_path, budget=256)
    fresh.generate([a], sp)
    fresh.add_request("b", b, sp)
    got, cached = [], None
    while fresh.has_unfinished:
        for o in fresh.step():
            got += o.new_token_ids
            cached = o.num_cached_tokens
    assert cached == 40 and got == out_b
    assert out_a != out_b or a != b


def test_stop_token_ends_without_extra_token_async(llama_path):
    prompt = prompts_of([6], 512, seed=21)[0]
    free_run = make_engine(llama_path).generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    stop_at = 9
    stop_tok = free_run[stop_at]
    first = free_run.index(stop_tok)
    for async_sched in (False, True):
        eng = make_engine(llama_path, async_scheduling=async_sched)
        eng.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_tok]))
        toks, finals = [], []
        while eng.has_unfinished:
            for o in eng.step():
                toks += o.new_token_ids
                if o.finished:
                    finals.append(o.finish_reason)
        assert toks == free_run[: first + 1]
        assert finals == ["stop"]
        assert eng.blocks.num_free_blocks == eng.num_blocks
    # min_tokens suppresses the stop token until reached
    eng = make_engine(llama_path)
    out = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, min_tokens=first + 2, stop_token_ids=[stop_tok]))[0]
    assert len(out) >= first + 3 - 1 and stop_tok not in out[: first + 2]


def test_max_tokens_exact_and_abort_frees_blocks_async(llama_path):
    eng = make_engine(llama_path, async_scheduling=True)
    prompts = prompts_of([8, 9, 10], 512, seed=22)
    eng.add_request("a", prompts[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    eng.add_request("b", prompts[1], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    got = {"a": [], "b": []}
    for _ in range(4):
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert eng.abort_request("b")
    assert not eng.abort_request("b")
    # id reuse right away, while a late output of the old "b" may still be in flight
    eng.add_request("b", prompts[2], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    got["b"] = []
    finals = {}
    while eng.has_unfinished:
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            if o.finished:
                finals[o.request_id] = o.finish_reason
    assert len(got["a"]) == 5
    solo = make_engine(llama_path).generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert got["b"] == solo
    assert finals == {"a": "length", "b": "length"}
    assert eng.blocks.num_free_blocks == eng.num_blocks
    assert eng.stats().num_running == 0 and eng.stats().num_aborted_total == 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt_token_ids=[]), "prompt_token_ids"),
        (dict(prompt_token_ids=[1, 2, 10_000]), "prompt_token_ids"),
        (dict(prompt_token_ids=[1, -1]), "prompt_token_ids"),
        (dict(prompt_token_ids=list(range(1, 300))), "prompt_token_ids"),
        (dict(sampling=SamplingParams(max_tokens=0)), "sampling.max_tokens"),
        (dict(sampling=SamplingParams(temperature=-1.0)), "sampling.temperature"),
        (dict(sampling=SamplingParams(top_p=0.0)), "sampling.top_p"),
        (dict(sampling=SamplingParams(logit_bias={99999: 1.0})), "sampling.logit_bias"),
        (dict(hidden_state_layers=[7]), "hidden_state_layers"),
        (dict(audio=True), "audio"),
    ],
)
def test_bad_input_names_field_and_engine_keeps_serving(llama_path, kwargs, field):
    eng = make_engine(llama_path)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eng.add_request("ok", [5, 6, 7], sp)
    out = [t for o in eng.step() for t in o.new_token_ids]
    args = dict(request_id="bad", prompt_token_ids=[1, 2, 3], sampling=sp)
    args.update(kwargs)
    with pytest.raises(InvalidRequest) as ei:
        eng.add_request(**args)
    assert ei.value.field == field and field.split(".")[-1] in str(ei.value)
    while eng.has_unfinished:
        for o in eng.step():
            out += o.new_token_ids
    assert len(out) == 6


def test_unknown_sampling_field_is_named():
    from streaming.sampling_params import decode_sampling_params

    with pytest.raises(InvalidRequest) as ei:
        decode_sampling_params({"temperature": 0.5, "top_q": 1})
    assert ei.value.field == "sampling.top_q"
    with pytest.raises(InvalidRequest) as ei:
        decode_sampling_params({"top_p": "high"})
    assert ei.value.field == "sampling.top_p"


def test_duplicate_live_request_id_rejected(llama_path):
    eng = make_engine(llama_path)
    eng.add_request("x", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequest) as ei:
        eng.add_request("x", [1, 2, 3], SamplingParams(max_tokens=4))
    assert ei.value.field == "request_id"


# ---- audio requests (the embedded Orpheus-shaped default with its codec) -------------------------


@pytest.fixture(scope="module")
def audio_engine(default_model_dir):
    from runner.engine.args import engine_args
    from runner.engine.process import build_engine

    return build_engine(engine_args(str(default_model_dir), max_num_seqs=8,
                                       max_model_len=512, cpu_threads=1))


def _run_audio(eng: Engine, with_text_neighbour: bool) -> tuple[list[int], int]:
    sp = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, max_tokens=30, seed=7)
    eng.add_request("speech", list(range(20, 45)), sp, audio=True)
    if with_text_neighbour:
        eng.add_request("text", list(range(60, 70)), SamplingParams(temperature=1.0, max_tokens=30, seed=3))
    toks, samples, outputs = [], 0, 0
    while eng.has_unfinished:
        for o in eng.step():
            if o.request_id == "speech":
                outputs += 1
                toks += o.new_token_ids
                samples += 0 if o.audio is None else o.audio.size
    return toks, samples, outputs


def test_audio_request_follows_the_code_rule_and_ignores_its_neighbours(audio_engine):
    from runner.models.default_model import AUDIO_OFFSET, CODEBOOK, SPECIALS

    alone, samples, outputs = _run_audio(audio_engine, False)
    end = SPECIALS["<|end_of_speech|>"]
    assert len(alone) == 30 or alone[-1] == end
    for i, t in enumerate(alone):
        lo = AUDIO_OFFSET + (i % 7) * CODEBOOK
        assert lo <= t < lo + CODEBOOK or (t == end and i % 7 == 0), (i, t)
    assert samples == (len([t for t in alone if t != end]) // 7) * 2048
    # tokens travel with the audio chunks and the final output, not one message per token
    assert outputs < len(alone) // 2
    # a text request in the same steps samples separately: the seeded speech is unchanged
    assert _run_audio(audio_engine, True)[0] == alone


def test_warm_up_runs_an_audio_request_and_leaves_the_engine_clean(audio_engine):
    free = audio_engine.blocks.num_free_blocks
    audio_engine.warm_up()
    st = audio_engine.stats()
    assert st.num_running == st.num_waiting == 0 and st.active_request_ids == []
    assert st.num_requests_total == 0 and st.step_count == 0 and st.num_generated_tokens_total == 0
    assert audio_engine.blocks.num_free_blocks == free  # cached prefix blocks are free (reusable)
    assert len(audio_engine.codec) == 0


def test_stats_count_open_codec_streams(audio_engine):
    """EngineStats.num_codec_streams: a speech request holds a codec stream while it runs, and
    none is left once it ends or is aborted (the soak's end-of-run check reads it)."""
    sp = SamplingParams(temperature=0.8, max_tokens=30, seed=7, ignore_eos=True)
    audio_engine.add_request("s1", list(range(20, 45)), sp, audio=True)
    audio_engine.add_request("s2", list(range(20, 45)), sp, audio=True)
    audio_engine.step()
    assert audio_engine.stats().num_codec_streams == 2
    audio_engine.abort_request("s1")
    while audio_engine.has_unfinished:
        audio_engine.step()
    st = audio_engine.stats()
    assert st.num_codec_streams == 0 and st.active_request_ids == []


def test_warm_sampling_changes_no_result(audio_engine):
    """The start-up pass that runs the lm_head and the sampler at max_num_seqs padding rows
    (constrained and free) leaves every slot's state alone: the seeded speech after it is the
    same as before it."""
    before, _, _ = _run_audio(audio_engine, False)
    audio_engine.runner.warm_sampling()
    assert _run_audio(audio_engine, False)[0] == before


def test_warm_sampling_takes_the_penalty_buffers_and_changes_no_tokens(llama_path):
    """A text model has no audio warm-up request, so the penalty buffers used to appear at the
    first request with a penalty, whose step then compiled the penalty and counting record
    kernels. warm_sampling now allocates them and runs those kernels on padding
    rows only: penalised and plain requests give the tokens of an engine that never warmed."""
    sps = [SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, frequency_penalty=0.7,
                          presence_penalty=0.4, repetition_penalty=1.3),
           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    prompts = prompts_of([9, 13], 512, seed=31)
    cold = make_engine(llama_path)
    with pytest.raises(RuntimeError, match="not allocated"):
        cold.runner.slots.penalty_buffers()
    want = cold.generate(prompts, sps)
    warm = make_engine(llama_path)
    warm.runner.warm_sampling()
    mask, counts = warm.runner.slots.penalty_buffers()
    S = warm.runner.slots.num_slots
    assert not mask[:S].any() and not counts[:S].any()  # padding rows touch only the scratch row S
    assert warm.generate(prompts, sps) == want


def test_warm_up_eager_prefill_leaves_the_engine_clean_and_tokens_unchanged(llama_path):
    """The CUDA warm-up's eager prefills (a long prompt alone with hidden states, then one joining
    running decodes) end every request it added, free their slots and change no later result."""
    sps = [SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)]
    prompts = prompts_of([140, 11], 512, seed=41)  # one of them on the eager prefill path too
    want = make_engine(llama_path, budget=256).generate(prompts, sps)
    eng = make_engine(llama_path, budget=256)
    eng.warm_up_eager_prefill()
    st = eng.stats()
    assert st.num_running == st.num_waiting == 0 and st.active_request_ids == []
    assert eng.step_count > 4 and len(eng.scheduler.free_slots) == eng.cfg.scheduler.max_num_seqs
    assert eng.generate(prompts, sps) == want


def test_warm_up_eager_prefill_with_speech_decodes_leaves_no_stream(audio_engine):
    """With a codec the warm-up's running decodes are speech requests (constrained sampling and
    the codec stage, as in serving): every stream ends and the codec holds none afterwards."""
    before, _, _ = _run_audio(audio_engine, False)
    audio_engine.warm_up_eager_prefill()
    st = audio_engine.stats()
    assert st.num_running == st.num_waiting == 0 and st.active_request_ids == []
    assert len(audio_engine.codec) == 0
    assert _run_audio(audio_engine, False)[0] == before
