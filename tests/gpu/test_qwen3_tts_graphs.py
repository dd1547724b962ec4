"""Qwen3-TTS's frame step on CUDA (runner/families/qwen3_tts.py): the captured graphs (whole
decode steps, and the depth half when prompts join) give the frames the eager step gives, with
the text column of in-flight rows, the code-0 window over the released 3072-id codec table and
the groups' own sampling batch and code 0's repetition penalty inside the graphs; the groups
drawn by the fused one-launch kernel (FrameRunner.fused_groups) give the frames the sampler's
general path gives. Frames against the reference are held on the CPU
(tests/engine/test_qwen3_tts_engine.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from runner.config import EngineConfig
from runner.engine.engine import Engine
from runner.families import Qwen3TtsFamily
from runner.layers import make_backends
from streaming.profile import ModelProfile
from streaming.sampling_params import SamplingParams
from tests.models.test_qwen3_tts import released_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A small folder of the released layout (3072-id codec table, 16 groups of 2048 codes);
    head_dim 32 in both stacks (the Triton attention kernels' smallest tile). Weights are drawn
    by the family (load_model(random_weights=True)), so the safetensors file is not read."""
    raw = released_config(256, 512)
    t = raw["talker_config"]
    t.update(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=32, text_vocab_size=1000,
             text_hidden_size=128, max_position_embeddings=512)
    t["code_predictor_config"].update(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    raw.update(tts_pad_token_id=997, tts_bos_token_id=998, tts_eos_token_id=999)
    path = tmp_path_factory.mktemp("qwen3_tts_gpu")
    (path / "config.json").write_text(json.dumps(raw))
    save_file({"unused": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


def engine(path, *, graphs: bool, fused_groups: bool = True) -> Engine:
    cfg = EngineConfig.build(path, device="cuda", dtype="bfloat16", max_model_len=128, max_num_batched_tokens=64,
                             max_num_seqs=8, block_size=16, num_blocks=128, async_scheduling=True,
                             cuda_graphs=graphs, max_graph_batch_size=8)
    family = Qwen3TtsFamily(ModelProfile(family="qwen3_tts", speech=None, codec=None), str(path))
    model = family.load_model(cfg, *make_backends(cfg.runner), random_weights=True)
    with torch.no_grad():  # a code-0 head that favours eos, so the window and the eos bar matter
        model.codec_head.weight[family.config.codec.eos] *= 40.0
    eng = Engine(cfg, model=model, family=family)
    assert eng.runner.fused_groups
    # eager steps build their sampler per step: the general path from here on (graphs captured theirs)
    eng.runner.fused_groups = fused_groups or graphs
    return eng


def requests(n: int) -> list[dict]:
    g = np.random.default_rng(0)
    out = []
    for i in range(n):
        p = 6 + 3 * i
        codes = np.full((p, 16), -1, dtype=np.int64)
        codes[3:, 0] = g.choice([2148, 2149, 2154, 2156, 2157, 2050], size=p - 3)
        codes[-1, 0] = 2149
        out.append(dict(text=g.integers(0, 997, size=p).tolist(), codes=codes,
                        trailing=g.integers(0, 997, size=2 + 2 * i).tolist()))
    return out


def drive(eng: Engine, reqs: list[dict], sps: list[SamplingParams], groups: list[SamplingParams | None]) -> dict:
    got = {f"r{i}": [] for i in range(len(reqs))}
    pending, step = list(enumerate(reqs)), 0
    while pending or eng.has_unfinished:
        while pending and step >= pending[0][0] * 2:
            i, r = pending.pop(0)
            eng.add_request(f"r{i}", r["text"], sps[i], prompt_frames=r["codes"], step_text_ids=r["trailing"],
                            group_sampling=groups[i])
        for o in eng.step():
            if o.frames is not None:
                got[o.request_id].append(o.frames)
        step += 1
    return {k: np.concatenate(v) for k, v in got.items()}


def test_graphs_are_used_and_equal_eager(folder):
    sps = [SamplingParams(temperature=0.0, max_tokens=20),
           SamplingParams(temperature=0.9, top_k=50, max_tokens=20, seed=4),
           SamplingParams(temperature=1.0, top_p=0.8, max_tokens=20, seed=5),
           SamplingParams(temperature=0.0, max_tokens=20, seed=6),  # greedy code 0, default groups (sampled)
           # code 0's repetition penalty inside the graphs (the code-0 history per slot)
           SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=20),
           SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, max_tokens=20, seed=7)]
    groups = [SamplingParams(temperature=0.0), None, SamplingParams(temperature=0.7, top_k=5), None,
              SamplingParams(temperature=0.0), None]
    reqs = requests(len(sps))
    g = engine(folder, graphs=True)
    fg = g.runner.frame_graphs
    assert fg is not None and fg.graphs and fg.group_batches is not None
    replays, depth = [], []
    orig, orig_depth = fg.run, fg.run_depth
    fg.run = lambda *a: replays.append(a[0]) or orig(*a)
    fg.run_depth = lambda *a: depth.append(a[0]) or orig_depth(*a)
    got_g = drive(g, reqs, sps, groups)
    got_e = drive(engine(folder, graphs=False), reqs, sps, groups)
    got_general = drive(engine(folder, graphs=False, fused_groups=False), reqs, sps, groups)
    assert len(replays) > 10 and depth
    eos = g.family.config.codec.eos
    for k in got_e:
        np.testing.assert_array_equal(got_g[k], got_e[k], err_msg=k)
        np.testing.assert_array_equal(got_e[k], got_general[k], err_msg=f"{k}: fused groups != general path")
        code0 = got_g[k][:, 0]
        assert (code0[:-1] < 2048).all() and code0[-1] in (*range(2048), eos)
        assert len(code0) >= 3 or len(code0) == 20  # eos not at frames 0, 1
        assert (got_g[k][:, 1:] < 2048).all()
