"""CSM's frame step on CUDA: the captured graphs (whole decode steps, and the depth half after an
eager backbone when prompts join) give the frames the eager step gives (greedy and seeded
sampling, rows joining mid-run, async scheduling); audio requests stream Mimi PCM. Frames against
transformers are held on the CPU (tests/engine/test_frame_engine.py): on CUDA, kernels of other
precision flip near-tied argmaxes of a random tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.config import EngineConfig
from runner.engine.engine import Engine
from runner.families import family_for
from streaming.profile import read_profile
from streaming.sampling_params import SamplingParams
from tests.models.test_csm import PROMPTS
from tests.support.engine_runs import drive_requests
from tests.support.tiny_models import make_tiny_csm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def csm_dir(tmp_path_factory):
    # head_dim 32 in both decoders: the Triton attention kernels' smallest tile
    return make_tiny_csm(tmp_path_factory.mktemp("csm_gpu"), seed=3, hidden=128, depth_hidden=128)


def engine(path, *, graphs: bool, dtype: str = "bfloat16", async_scheduling: bool = True, codec: bool = False,
           depth_step: str = "auto") -> Engine:
    cfg = EngineConfig.build(path, device="cuda", dtype=dtype, max_model_len=128, max_num_batched_tokens=64,
                             max_num_seqs=8, block_size=16, num_blocks=128, async_scheduling=async_scheduling,
                             cuda_graphs=graphs, max_graph_batch_size=8, depth_step=depth_step)
    family = family_for(read_profile(path), str(path))
    return Engine(cfg, family=family, codec=family.build_codec(torch.device("cuda"), torch.float32) if codec else None)


def test_graphs_are_used_and_equal_eager(csm_dir):
    sps = [SamplingParams(temperature=0.0, max_tokens=20),
           SamplingParams(temperature=0.9, top_k=20, max_tokens=20, seed=4),
           SamplingParams(temperature=1.0, top_p=0.8, max_tokens=20, seed=5, ignore_eos=True)]
    g = engine(csm_dir, graphs=True)
    assert g.runner.frame_graphs is not None and g.runner.frame_graphs.graphs
    replays = []
    orig = g.runner.frame_graphs.run
    g.runner.frame_graphs.run = lambda *a: replays.append(a[0]) or orig(*a)
    depth = []
    orig_depth = g.runner.frame_graphs.run_depth
    g.runner.frame_graphs.run_depth = lambda *a: depth.append(a[0]) or orig_depth(*a)
    got_g = drive_requests(g, PROMPTS, sps, join_every=2)
    got_e = drive_requests(engine(csm_dir, graphs=False), PROMPTS, sps, join_every=2)
    assert len(replays) > 10 and depth  # whole steps, and depth halves of the steps prompts joined
    for k in got_e:
        np.testing.assert_array_equal(got_g[k]["frames"], got_e[k]["frames"])


def test_depth_step_kernel_in_graphs_equals_eager(csm_dir):
    """The persistent sub-step kernels (runner/kernels/depth_step.py at 2..8 rows, depth_row.py at
    one) inside the captured frame graphs give the eager kernels' frames, rows joining mid-run."""
    sps = [SamplingParams(temperature=0.0, max_tokens=16),
           SamplingParams(temperature=0.9, top_k=20, max_tokens=16, seed=4, ignore_eos=True),
           SamplingParams(temperature=1.0, top_p=0.8, max_tokens=16, seed=5)]
    g = engine(csm_dir, graphs=True, depth_step="on")
    assert g.model.depth_decoder.step is not None and g.model.depth_decoder.step_rows == 64
    got_g = drive_requests(g, PROMPTS, sps, join_every=2)
    got_e = drive_requests(engine(csm_dir, graphs=False, depth_step="on"), PROMPTS, sps, join_every=2)
    for k in got_e:
        np.testing.assert_array_equal(got_g[k]["frames"], got_e[k]["frames"])
    one = drive_requests(engine(csm_dir, graphs=True, depth_step="on"), PROMPTS[:1], sps[:1])  # one row: depth_row.py
    alone = drive_requests(engine(csm_dir, graphs=False, depth_step="on"), PROMPTS[:1], sps[:1])
    for k in alone:
        np.testing.assert_array_equal(one[k]["frames"], alone[k]["frames"])


def test_cuda_audio_requests_stream_pcm(csm_dir):
    eng = engine(csm_dir, graphs=True, codec=True)
    sp = SamplingParams(temperature=0.9, top_k=20, max_tokens=16, seed=1, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"a{i}", p, sp, audio=True)
    samples, finished = 0, 0
    while eng.has_unfinished:
        for o in eng.step():
            samples += 0 if o.audio is None else len(o.audio)
            finished += o.finished
            assert o.error is None, o.error
    assert finished == 3 and samples == 3 * 16 * 1920


def test_each_graph_set_captures_on_a_stream_of_its_own(csm_dir):
    """The frame-step graphs and the Mimi graphs replay at once on two streams. A captured cuBLAS
    GEMM keeps the workspace of its capture stream, so sharing torch.cuda.graph's default
    capture stream gave both sets one workspace, and a split-K GEMM spun forever on semaphores
    the other set's GEMM had overwritten (cuda-gdb on a CSM server stalled at 1000 streams:
    one block of a cutlass split-K GEMM spinning, the step stream busy, the codec idle)."""
    eng = engine(csm_dir, graphs=True, codec=True)
    frames = eng.runner.frame_graphs.capture_stream
    mimi = eng.codec.decoder.graphs.capture_stream
    shared = torch.cuda.graphs.graph.default_capture_stream
    assert frames is not None and mimi is not None
    streams = {frames.cuda_stream, mimi.cuda_stream, torch.cuda.current_stream().cuda_stream}
    assert len(streams) == 3
    assert shared is None or shared.cuda_stream not in streams


def test_serving_compiles_no_triton_kernel_for_any_prompt_length(csm_dir):
    """Frame models run every prompt chunk eagerly, as decode rows of the paged attention
    kernel, whose launch variant (split count, tiling) follows the step's row count; a 13-row
    step compiled one mid-serving (0.7 s, every stream waiting). After Engine.warm_up as the
    server runs it (ModelRunner.warm_attention compiles every variant), prompts of 1..40
    tokens, alone and joining running requests, compile nothing."""
    from tests.support.engine_runs import ServedEngine

    def prompt(n: int) -> list[int]:  # below the tiny CSM's audio tokens (90, 91)
        return [(5 * i + n) % 80 + 1 for i in range(n)]

    with ServedEngine(csm_dir, max_num_seqs=8, max_model_len=256) as t:
        for n in range(1, 41):  # alone: the step's rows are the prompt's length
            t.eng.add_request(f"alone{n}", prompt(n), SamplingParams(max_tokens=2))
            t.run()
        t.eng.add_request("running", prompt(7), SamplingParams(max_tokens=60, ignore_eos=True))
        t.run(2)
        for n in range(1, 41, 3):  # joining a running request: rows = its decode + the chunk
            t.eng.add_request(f"joins{n}", prompt(n), SamplingParams(max_tokens=2))
            t.run(3)
        t.run()
    assert t.compiled == []
