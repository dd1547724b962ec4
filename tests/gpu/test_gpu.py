"""The engine on CUDA: parity with transformers (fp32 exact tokens; bf16 within stated
tolerances), CUDA graphs == eager, async == sync, and the copy-stream path for hidden states.
Skipped without a GPU (CI has none; how to run them on the lent GPU machine: docs/performance.md)."""

from __future__ import annotations

import pytest
import torch

from runner.config import EngineConfig
from runner.engine.engine import Engine
from streaming.sampling_params import SamplingParams
from tests.engine.test_engine import prompts_of, run_staggered
from tests.support.engine_runs import ServedEngine
from tests.support.tiny_models import load_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def cuda_engine(path, dtype, *, graphs=True, async_sched=True, max_num_seqs=16) -> Engine:
    cfg = EngineConfig.build(path, device="cuda", dtype=dtype, max_model_len=256, max_num_batched_tokens=128,
                             max_num_seqs=max_num_seqs, block_size=16, num_blocks=256,
                             async_scheduling=async_sched, cuda_graphs=graphs)
    return Engine(cfg)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request, tiny_model_dir):
    fam = request.param
    kw = {"llama": dict(rope_llama3=True), "qwen2": dict(tie=True), "qwen3": {}}[fam]
    return tiny_model_dir(fam, seed=7, head_dim=64 if fam != "qwen3" else 32, **kw)


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def test_fp32_cuda_greedy_equals_transformers(model_dir):
    hf = load_hf(model_dir).cuda()
    prompts = prompts_of([1, 3, 7, 12, 17, 25, 33, 48], hf.config.vocab_size, seed=2)
    got = run_staggered(cuda_engine(model_dir, "float32"), prompts, GREEDY)
    for p, g in zip(prompts, got):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64,
                          min_new_tokens=64, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert g == ref


def test_bf16_logits_and_hidden_within_tolerance(model_dir):
    """bf16: hidden states of every position (prefill + decode, through the copy stream) and
    the final logits against transformers in bf16 on the same sequence: relative L2 error
    < 3e-2, and greedy argmax agreement on >= 90% of positions."""
    hf = load_hf(model_dir).to(device="cuda", dtype=torch.bfloat16)
    L = hf.config.num_hidden_layers
    eng = cuda_engine(model_dir, "bfloat16")
    prompt = prompts_of([40], hf.config.vocab_size, seed=5)[0]
    eng.add_request("h", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), hidden_state_layers=(L,))
    toks, rows = [], []
    while eng.has_unfinished:
        for o in eng.step():
            toks += o.new_token_ids
            if o.hidden is not None:
                rows.append(torch.from_numpy(o.hidden.copy()).view(torch.bfloat16))
    hid = torch.cat(rows)[:, 0].float()
    seq = prompt + toks[:-1]
    with torch.no_grad():
        ref = hf(torch.tensor([seq], device="cuda"), output_hidden_states=True)
    href = ref.hidden_states[L][0].float().cpu()
    rel = (hid - href).norm() / href.norm()
    assert rel < 3e-2, rel
    agree = (ref.logits[0, len(prompt) - 1:].argmax(-1).cpu() == torch.tensor(toks)).float().mean()
    assert agree >= 0.9, agree


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_and_async_give_same_tokens_as_eager(model_dir, dtype):
    sps = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
           SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True),
           SamplingParams(temperature=1.0, repetition_penalty=1.2, seed=4, max_tokens=44, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True)]
    prompts = prompts_of([5, 11, 20, 9], 512, seed=8)
    ref = run_staggered(cuda_engine(model_dir, dtype, graphs=False, async_sched=False), prompts, sps)
    graphs = cuda_engine(model_dir, dtype, graphs=True, async_sched=True)
    assert graphs.runner.graphs is not None
    got = run_staggered(graphs, prompts, sps)
    assert got == ref
    assert graphs.blocks.num_free_blocks == graphs.num_blocks


def test_prefill_burst_replays_a_token_row_graph(model_dir):
    """A burst of short prompts that fills a 1536-token step (more rows than the decode batch
    plus any fixed headroom) replays a token-row graph of a bucket above 1024 rows, and the
    tokens equal the eager, synchronous engine's (bf16, greedy and seeded sampling)."""
    from dataclasses import replace

    prompts = prompts_of([32 + i % 13 for i in range(40)], 512, seed=21)  # 1,518 tokens at once
    sps = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) if i % 2 else
           SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True) for i in range(40)]
    cfg = EngineConfig.build(model_dir, device="cuda", dtype="bfloat16", max_model_len=256, max_num_batched_tokens=1536,
                             max_num_seqs=48, block_size=16, num_blocks=1024, async_scheduling=True, cuda_graphs=True)

    def burst(eng: Engine) -> list[list[int]]:
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            eng.add_request(f"r{i}", p, sp)
        outs = {f"r{i}": [] for i in range(len(prompts))}
        while eng.has_unfinished:
            for o in eng.step():
                outs[o.request_id].extend(o.new_token_ids)
        return [outs[f"r{i}"] for i in range(len(prompts))]

    graphed = Engine(cfg)
    assert graphed.runner.graphs.max_bs == 1536
    buckets = []
    run = graphed.runner.graphs.run
    graphed.runner.graphs.run = lambda bucket, *a, **k: buckets.append(bucket) or run(bucket, *a, **k)
    got = burst(graphed)
    assert buckets[0] == 1536 > 1024  # the burst's first step: every prompt as token rows
    eager = Engine(cfg.with_(runner=replace(cfg.runner, cuda_graphs=False),
                             scheduler=replace(cfg.scheduler, async_scheduling=False)))
    assert got == burst(eager)


def test_hidden_state_graphs_equal_the_eager_hidden_states(model_dir):
    """RunnerConfig.hidden_state_graphs: a decode step in which a request wants hidden states
    replays an all-layers graph instead of running eagerly, with the same tokens and bit for
    bit the same hidden states (bf16; several layers; requests joining mid-decode, one without
    hidden states) as the engine without those graphs, where such steps run eagerly."""
    from dataclasses import replace

    import numpy as np

    cfg = EngineConfig.build(model_dir, device="cuda", dtype="bfloat16", max_model_len=256, max_num_batched_tokens=128,
                             max_num_seqs=16, block_size=16, num_blocks=256, async_scheduling=True, cuda_graphs=True)
    L = cfg.model.num_layers
    prompts = prompts_of([5, 9, 14], 512, seed=4)
    reqs = [("h0", prompts[0], (0, 1, L)), ("t", prompts[1], ()), ("h1", prompts[2], (-1,))]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def run(eng: Engine) -> dict:
        out = {rid: ([], [], []) for rid, _, _ in reqs}

        def step():
            for o in eng.step():
                toks, hid, pos = out[o.request_id]
                toks += o.new_token_ids
                if o.hidden is not None:
                    hid.append(np.array(o.hidden, copy=True))
                    pos.append(tuple(o.hidden_positions))

        for rid, p, layers in reqs:
            eng.add_request(rid, p, sp, hidden_state_layers=layers)
            for _ in range(4):
                step()
        while eng.has_unfinished:
            step()
        return out

    graphed = Engine(cfg.with_(runner=replace(cfg.runner, hidden_state_graphs=True)))
    assert graphed.runner.graphs.hidden_buckets[-1] == 16
    calls = []
    run_graph = graphed.runner.graphs.run
    graphed.runner.graphs.run = lambda *a, **k: calls.append(k.get("all_layers", False)) or run_graph(*a, **k)
    got = run(graphed)
    assert any(calls)  # hidden-state decode steps replayed the all-layers family
    eager = Engine(cfg.with_(runner=replace(cfg.runner, hidden_state_graphs=False)))  # (the default is on)
    assert eager.runner.graphs.hidden_buckets == []
    ref = run(eager)
    for rid, prompt, layers in reqs:
        toks, hid, pos = got[rid]
        rtoks, rhid, rpos = ref[rid]
        assert toks == rtoks and pos == rpos, rid
        assert len(hid) == len(rhid) and all(np.array_equal(a, b) for a, b in zip(hid, rhid)), rid
        # every position fed to the model (the prompt and all tokens but the last), each layer asked for
        assert sum(h.shape[0] for h in hid) == (len(prompt) + len(toks) - 1 if layers else 0), rid
        assert all(h.shape[1] == len(layers) for h in hid), rid


def test_pdl_keeps_tokens(model_dir):
    """bf16, graphs + async: programmatic dependent launch changes only when kernels start, not
    what they compute, so the tokens are identical with and without it. (The skinny Triton
    GEMMs' numerics are held to transformers by test_bf16_logits_and_hidden_within_tolerance.)"""
    from dataclasses import replace

    prompts = prompts_of([5, 11, 20, 9, 1, 30], 512, seed=12)
    with_pdl = cuda_engine(model_dir, "bfloat16")
    assert with_pdl.model.ops.pdl
    without = Engine(with_pdl.cfg.with_(runner=replace(with_pdl.cfg.runner, pdl=False)))
    assert not without.model.ops.pdl
    assert run_staggered(with_pdl, prompts, GREEDY) == run_staggered(without, prompts, GREEDY)


def test_rope_in_attention_keeps_tokens(model_dir):
    """fp32, graphs + async: RoPE + KV write inside the decode kernel (pure-decode graphs and
    eager decode steps) gives the same tokens as the separate RoPE + KV write launch (the two
    write the same K/V and differ only in the fp32 order of the current token's softmax step;
    fp32 so that this cannot flip a greedy choice). The staggered arrivals also replay the
    token-row graphs, which keep the separate launch."""
    from dataclasses import replace

    prompts = prompts_of([5, 11, 20, 9, 1, 30], 512, seed=13)
    fused = cuda_engine(model_dir, "float32")
    assert fused.model.layers[0].self_attn.rope_in_attention
    assert set(fused.runner.graphs.families) == {True, False}
    plain = Engine(fused.cfg.with_(runner=replace(fused.cfg.runner, rope_in_attention=False)))
    assert not plain.model.layers[0].self_attn.rope_in_attention
    assert run_staggered(fused, prompts, GREEDY) == run_staggered(plain, prompts, GREEDY)


def test_attention_prefetch_keeps_tokens(model_dir):
    """bf16, graphs + async, PDL on: the split pure-decode attention kernel loading its block
    table, first K/V tile and RoPE rows before the PDL wait computes what it computes with the
    loads in the loop (peeled first tile), so the tokens are identical. A read before the wait
    of anything the step's earlier kernels write would show up here as a different token."""
    from dataclasses import replace

    prompts = prompts_of([5, 11, 20, 9, 1, 30], 512, seed=14)
    with_prefetch = cuda_engine(model_dir, "bfloat16")
    attn = with_prefetch.model.layers[0].self_attn.attn
    assert attn.prefetch and attn.pdl and with_prefetch.model.layers[0].self_attn.rope_in_attention
    without = Engine(with_prefetch.cfg.with_(runner=replace(with_prefetch.cfg.runner, attention_prefetch=False)))
    assert not without.model.layers[0].self_attn.attn.prefetch
    assert run_staggered(with_prefetch, prompts, GREEDY) == run_staggered(without, prompts, GREEDY)


def engines_get_linear_tables(monkeypatch, **parts) -> None:
    """Engines built in this test get the device's tables with these GEMM table parts (split=,
    fold=, ...: each replaced whole): the registry's one lookup at backend construction
    (runner/layers/__init__.py) returns them."""
    import dataclasses

    from runner import layers

    real = layers.load_tables

    def load_tables(device, tuning="auto"):
        t = real(device, tuning)
        return dataclasses.replace(t, linear=dataclasses.replace(t.linear, **parts))

    monkeypatch.setattr(layers, "load_tables", load_tables)


@pytest.mark.parametrize("tma", [False, True])
def test_split_k_into_norm_keeps_graphs_equal_and_hf_close(model_dir, monkeypatch, tma):
    """o_proj / down as split-K partials summed by the add + RMSNorm (the tile table pointed at
    this tiny model's shapes; the real table only has Orpheus-3B's), with pointer or TMA loads
    (LinearTile.tma, as the real table's 17..64-row tiles): graphs + async give the same tokens
    as eager, and bf16 hidden states / logits stay within tolerance of transformers."""
    import runner.layers.triton_ops as tfo
    from runner.kernels.linear import LinearTile

    cfg = load_hf(model_dir).config
    q_size = cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    tile = LinearTile(16, 32, 32, 4, 2, tma=tma)
    engines_get_linear_tables(monkeypatch, split={(cfg.hidden_size, q_size): ((64, tile, 2),),
                                                  (cfg.hidden_size, cfg.intermediate_size): ((64, tile, 4),)})
    splits = []
    real = tfo.skinny_linear
    monkeypatch.setattr(tfo, "skinny_linear", lambda *a, **k: splits.append(k.get("split_k", 1)) or real(*a, **k))
    test_cuda_graphs_and_async_give_same_tokens_as_eager(model_dir, "bfloat16")
    test_bf16_logits_and_hidden_within_tolerance(model_dir)
    assert 4 in splits  # down (o_proj too where it has no bias)


@pytest.mark.parametrize("tma", [False, True])
def test_norm_fold_keeps_graphs_equal_and_hf_close(model_dir, monkeypatch, tma):
    """o_proj adding the residual and gate_up finishing the post-attention RMSNorm (the `fold`
    rows pointed at this tiny model's o_proj at every M up to 64; the real table only has
    Orpheus-3B's, at 2..16 and 33..64 rows): graphs + async give the same tokens as eager, and bf16 hidden
    states / logits stay within tolerance of transformers."""
    import runner.layers.triton_ops as tfo
    from runner.kernels.linear import LinearTile

    cfg = load_hf(model_dir).config
    q_size = cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    engines_get_linear_tables(monkeypatch, fold={(cfg.hidden_size, q_size): ((64, LinearTile(16, 32, 64, 4, 2, tma=tma)),)})
    rows = []
    real = tfo.residual_linear
    monkeypatch.setattr(tfo, "residual_linear", lambda x, *a, **k: rows.append(x.shape[0]) or real(x, *a, **k))
    test_cuda_graphs_and_async_give_same_tokens_as_eager(model_dir, "bfloat16")
    test_bf16_logits_and_hidden_within_tolerance(model_dir)
    assert rows and max(rows) > 16  # decode rows and prefill chunks both took the folded path


def test_triton_decode_backend_matches_torch_backend(model_dir):
    """Same tokens whether decode attention runs in the Triton kernel or the torch gather path."""
    from runner.layers.attention import TorchPagedAttention
    from runner.layers.triton_attention import TritonPagedAttention
    from runner.models.loader import load_model

    eng = cuda_engine(model_dir, "float32", graphs=False)
    assert isinstance(eng.model.layers[0].self_attn.attn, TritonPagedAttention)
    prompts = prompts_of([30, 7, 90], 512, seed=9)
    a = run_staggered(eng, prompts, GREEDY)
    torch_model = load_model(eng.cfg.model, torch.device("cuda"), torch.float32, attn=TorchPagedAttention())
    ref = Engine(eng.cfg, model=torch_model)
    assert run_staggered(ref, prompts, GREEDY) == a


def test_cuda_codec_stage_streams_equal_offline(tiny_snac_dir):
    """The CUDA codec path (own stream, CUDA graphs, PCM collected once it has landed) emits
    every sample once: the streamed concatenation equals the offline decode under the same
    window rule."""
    import numpy as np

    from runner.codecs.config import CodecConfig
    from runner.codecs.decoder import offline_decode
    from runner.codecs.orpheus_tokens import codes_to_tokens
    from runner.codecs.stage import CodecStage

    st = CodecStage(CodecConfig(path=str(tiny_snac_dir), codebook_size=64), torch.device("cuda"))
    rng = np.random.default_rng(0)
    codes = {k: rng.integers(0, 64, (n, 7)) for k, n in (("a", 3), ("b", 11), ("c", 23))}
    toks = {k: codes_to_tokens(st.cfg, c) + [st.cfg.end_token_id] for k, c in codes.items()}
    for k in codes:
        st.open(k)
    got = {k: [] for k in codes}
    done = set()
    pos = {k: 0 for k in codes}
    for _ in range(500):
        for k in codes:
            n = int(rng.integers(1, 12))
            st.push(k, toks[k][pos[k] : pos[k] + n])
            pos[k] += n
        for k, r in st.step().items():
            assert r.error is None
            got[k].append(r.pcm)
            if r.done:
                done.add(k)
        if len(done) == 3:
            break
    assert done == {"a", "b", "c"}
    for k, c in codes.items():
        pcm = np.concatenate(got[k])
        ref = offline_decode(st.decoder, c, st.cfg.policy)
        assert pcm.size == ref.size == len(c) * 2048
        assert np.abs(pcm.astype(np.int32) - ref.astype(np.int32)).max() <= 1


# every sampling option the API takes, one set per request
TEXT_SAMPLING = [dict(temperature=1.0), dict(temperature=0.7, top_k=50), dict(temperature=0.9, min_p=0.05),
                 dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01), dict(temperature=1.0, frequency_penalty=0.5),
                 dict(temperature=1.0, presence_penalty=0.3, repetition_penalty=1.2), dict(temperature=0.0)]


def test_after_warm_up_serving_traffic_compiles_no_triton_kernel(default_model_dir):
    """After Engine.warm_up (what the server runs before it listens), the steps real traffic
    makes compile no Triton kernel: a compile mid-serving stalls every stream for ~0.5-2 s.
    Traffic: audio requests whose batch grows and shrinks, a long prompt (> 128 tokens: the
    eager prefill path) arriving alone and one joining running decodes (an eager mixed step),
    text requests with every sampling option the API takes, and a request for hidden states."""
    with ServedEngine(default_model_dir) as t:
        eng = t.eng
        audio = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=80, seed=1)
        eng.add_request("long-alone", t.prompt(300, 1), audio, audio=True)
        t.run()
        for i in range(5):  # the batch grows one request per step ...
            eng.add_request(f"a{i}", t.prompt(20 + i, 2 + i), audio, audio=True)
            t.run(1)
        eng.add_request("long-joins", t.prompt(400, 9), audio, audio=True)  # ... a long prompt joins it
        for i, kw in enumerate(TEXT_SAMPLING):  # one at a time: each gives the free rows other filter flags
            eng.add_request(f"text{i}", t.prompt(30 + i, 10 + i), SamplingParams(max_tokens=6, seed=i, **kw))
            t.run(4)
        eng.add_request("hidden", t.prompt(50, 11), SamplingParams(temperature=0.0, max_tokens=8),
                        hidden_state_layers=(-1,))
        t.run(3)
        eng.abort_request("a0")
        t.run()  # ... and shrinks as they finish
    assert t.compiled == [], "\n".join(t.compiled)


def test_after_warm_up_text_traffic_compiles_no_triton_kernel(tiny_model_dir):
    """The same for a text model whose vocabulary (1000) is not a multiple of 64, so its lm_head
    is padded on CUDA: a step that samples one row must hand the sampler the row stride that
    warm-up's many-row steps did (the GPU compiled a second sampling kernel for it).
    Traffic: long prompts alone with each sampling option, then several requests at once."""
    with ServedEngine(tiny_model_dir("llama", vocab_size=1000, head_dim=64, max_pos=1024)) as t:
        for i, kw in enumerate(TEXT_SAMPLING):
            t.eng.add_request(f"alone{i}", t.prompt(200 + i, i), SamplingParams(max_tokens=4, seed=i, **kw))
            t.run()
        for i, kw in enumerate(TEXT_SAMPLING):
            t.eng.add_request(f"together{i}", t.prompt(20 + i, 50 + i), SamplingParams(max_tokens=8, seed=i, **kw))
        t.run()
    assert t.compiled == [], "\n".join(t.compiled)


def test_stall_report_names_the_busy_gpu_stream(tiny_model_dir):
    """The watchdog's report says which of the engine's streams hold unfinished work: a step
    stream held by a long kernel reads busy, the output copy stream idle."""
    eng = cuda_engine(tiny_model_dir("llama", seed=7, head_dim=64), "float32", graphs=False)
    torch.cuda.synchronize()
    assert eng.gpu_streams_busy() == "step idle, output copy idle"
    torch.cuda._sleep(2 * 10**9)  # a couple of seconds of spinning on the step's (current) stream
    assert eng.gpu_streams_busy() == "step busy, output copy idle"
    torch.cuda.synchronize()
