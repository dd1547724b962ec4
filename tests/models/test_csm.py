"""runner/models/csm.py (CSM: Llama backbone + depth decoder) against transformers'
CsmForConditionalGeneration, on tiny random-weight checkpoints built offline and loaded through
runner/models/csm_loader.py. The frames are driven batched through the frame-step API over the
paged KV cache, as the engine will (a small driver below keeps the blocks)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runner.layers.attention import allocate_kv_cache
from runner.layers.sampler import Sampler
from runner.layers.sampling_batch import SamplingBatch
from runner.models.csm import CsmModel
from runner.models.csm_config import CsmModelConfig
from runner.models.csm_loader import load_csm
from runner.models.csm_sampling import GreedyCodebooks, RaceCodebooks
from runner.models.loader import LoadError
from streaming.sampling_params import SamplingParams
from tests.models.test_models import PagedSequences
from tests.support.tiny_models import (
    BOS_ID,
    CSM_AUDIO_EOS_TOKEN_ID,
    CSM_AUDIO_TOKEN_ID,
    load_hf_csm,
    make_tiny_csm,
)

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 96
# prompts of different lengths (text ids < 90; 1 = BOS)
PROMPTS = [[BOS_ID, 5, 7], [BOS_ID, 11, 3, 8, 20, 33, 4, 9], [BOS_ID, 2, 60, 61, 62, 14, 15, 16, 17, 40, 41, 42, 43]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def csm_dir(tmp_path_factory):
    return make_tiny_csm(tmp_path_factory.mktemp("csm"), seed=3)


@pytest.fixture(scope="module")
def pair(csm_dir):
    cfg = CsmModelConfig.from_pretrained(csm_dir)
    return cfg, load_csm(cfg, "cpu", torch.float32), load_hf_csm(csm_dir)


def hf_generate(hf, prompt: list[int], max_frames: int) -> torch.Tensor:
    """transformers' greedy frames [N, K] for one prompt, cut after the end-of-audio frame."""
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_frames, do_sample=False,
                          depth_decoder_do_sample=False)
    frames = out[0]
    eos = (frames[:, :-1] == hf.config.codebook_eos_token_id).all(-1).nonzero()
    return frames[: int(eos[0]) + 1] if len(eos) else frames


def drive(model: CsmModel, prompts: list[list[int]], max_frames: int, sampler_for, join_at: dict[int, int] | None = None,
          audio: dict[int, torch.Tensor] | None = None, head_row_multiple: int = 1) -> dict[int, torch.Tensor]:
    """Run `prompts` through frame_step over the paged cache, batched: each step holds every live
    sequence's last frame (one row each) and the prompts joining now (a prefill chunk each); a
    sequence leaves after its end-of-audio frame or max_frames. join_at: prompt -> the step it
    joins at (default 0). sampler_for(rows) -> the CodebookSampler of a step's rows."""
    join_at = join_at or {}
    cfg = model.cfg
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE)
    kv = allocate_kv_cache(cfg.backbone, NUM_BLOCKS, BLOCK_SIZE, "cpu", torch.float32)
    model.allocate_depth_kv(len(prompts), head_row_multiple)
    frames: dict[int, list[torch.Tensor]] = {}
    live: list[int] = []
    step = 0
    while live or len(frames) < len(prompts):
        joining = [i for i in range(len(prompts)) if join_at.get(i, 0) == step]
        rows = live + joining  # decode rows first, as the scheduler orders them
        if rows:
            chunks = [(i, [0]) for i in live] + [(i, prompts[i]) for i in joining]
            _, positions, meta = seqs.step(chunks)
            parts = [model.embed_frames(torch.stack([frames[i][-1] for i in live]))] if live else []
            parts += [model.embed_prompt(*model.prompt_inputs(prompts[i], (audio or {}).get(i))) for i in joining]
            last_rows = meta.query_start_loc[1:].long() - 1
            out = model.frame_step(torch.cat(parts), positions, kv, meta, last_rows, sampler_for(rows))
            done = model.frame_is_eos(out).tolist()
            for r, i in enumerate(rows):
                frames.setdefault(i, []).append(out[r])
            live = [i for r, i in enumerate(rows) if not done[r] and len(frames[i]) < max_frames]
        step += 1
    return {i: torch.stack(f) for i, f in frames.items()}


def test_config_reads_both_decoders(pair):
    cfg, ours, hf = pair
    hc = hf.config
    assert (cfg.num_codebooks, cfg.codebook_size, cfg.text_vocab_size) == (hc.num_codebooks, hc.vocab_size, hc.text_vocab_size)
    assert cfg.backbone.rope.theta == cfg.depth.rope.theta == 500000.0
    assert (cfg.depth.hidden_size, cfg.depth.num_layers, cfg.depth.head_dim) == (32, 2, 8)
    assert cfg.tie_codebook_embeddings and ours.depth.embed_tokens.weight is ours.embed_audio_tokens.weight


@torch.no_grad()
def test_backbone_logits_and_hidden_match_transformers(pair):
    """Three text prompts in one flattened step, then a frame step for each; every position."""
    cfg, ours, hf = pair
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE)
    kv = allocate_kv_cache(cfg.backbone, NUM_BLOCKS, BLOCK_SIZE, "cpu", torch.float32)
    _, positions, meta = seqs.step([(i, p) for i, p in enumerate(PROMPTS)])
    embeds = torch.cat([ours.embed_prompt(*ours.prompt_inputs(p)) for p in PROMPTS])
    hidden, logits = ours.backbone_step(embeds, positions, kv, meta, torch.arange(len(positions)))
    gen = torch.Generator().manual_seed(0)
    frames = torch.randint(0, cfg.codebook_size, (len(PROMPTS), cfg.num_codebooks), generator=gen)
    _, pos2, meta2 = seqs.step([(i, [0]) for i in range(len(PROMPTS))])
    hidden2, logits2 = ours.backbone_step(ours.embed_frames(frames), pos2, kv, meta2, torch.arange(len(PROMPTS)))
    start = 0
    for i, p in enumerate(PROMPTS):
        # transformers: the text prompt, then the frame as a [1, 1, K] codebook input with its cache
        out = hf(input_ids=torch.tensor([p]), output_hidden_states=True, use_cache=True)
        n = len(p)
        torch.testing.assert_close(hidden[start : start + n], out.hidden_states[-1][0], rtol=0, atol=ATOL)
        torch.testing.assert_close(logits[start : start + n], out.logits[0].float(), rtol=0, atol=ATOL)
        nxt = hf(input_ids=frames[i][None, None], cache=out.cache, output_hidden_states=True)
        torch.testing.assert_close(hidden2[i], nxt.hidden_states[-1][0, -1], rtol=0, atol=ATOL)
        torch.testing.assert_close(logits2[i], nxt.logits[0, -1].float(), rtol=0, atol=ATOL)
        start += n


@torch.no_grad()
def test_prompt_with_audio_frames_embeds_as_transformers(pair):
    """A voice-style prompt: text, audio frames (audio_token_id) and the audio end marker. The
    frames come from transformers' own codec encode of the clip, as its processor path does."""
    cfg, ours, hf = pair
    n_frames = 3
    clip = torch.randn(1, 1, 1920 * n_frames, generator=torch.Generator().manual_seed(1))
    codes = hf.codec_model.encode(clip).audio_codes[0].T  # [F, K]
    assert codes.shape == (n_frames, cfg.num_codebooks) and len(set(codes.flatten().tolist())) > 3
    prompt = [BOS_ID, 7, 8] + [CSM_AUDIO_TOKEN_ID] * n_frames + [CSM_AUDIO_EOS_TOKEN_ID, BOS_ID, 12, 13]
    out = hf(input_ids=torch.tensor([prompt]), input_values=clip, input_values_cutoffs=torch.tensor([[clip.shape[-1]]]),
             output_hidden_states=True)
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE)
    kv = allocate_kv_cache(cfg.backbone, NUM_BLOCKS, BLOCK_SIZE, "cpu", torch.float32)
    _, positions, meta = seqs.step([(0, prompt)])
    embeds = ours.embed_prompt(*ours.prompt_inputs(prompt, codes))
    hidden, logits = ours.backbone_step(embeds, positions, kv, meta, torch.arange(len(prompt)))
    torch.testing.assert_close(hidden, out.hidden_states[-1][0], rtol=0, atol=ATOL)
    torch.testing.assert_close(logits, out.logits[0].float(), rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match="3 audio_token_id position"):
        ours.prompt_inputs(prompt, codes[:2])


class RecordingGreedy(GreedyCodebooks):
    def __init__(self):
        self.logits: dict[int, torch.Tensor] = {}

    def __call__(self, logits, codebook, out=None):
        self.logits[codebook] = logits.clone()
        return super().__call__(logits, codebook, out)


@torch.no_grad()
@pytest.mark.parametrize("padded", [False, True], ids=["heads", "padded_heads"])
def test_depth_decoder_codes_and_logits_match_transformers(pair, padded):
    """padded: every head's rows in a zero-padded copy (allocate_depth_kv's head_row_multiple,
    on CUDA for cuBLAS's alignment), the logits a column view of the wider product."""
    cfg, ours, hf = pair
    gen = torch.Generator().manual_seed(5)
    b = 5
    hidden = torch.randn(b, cfg.backbone.hidden_size, generator=gen)
    code0 = torch.randint(0, cfg.codebook_size, (b,), generator=gen)
    v = cfg.codebook_size
    ours.allocate_depth_kv(8, v + 5 if padded else 1)  # v + 5 never divides v: always pads
    depth = ours.depth
    if padded:
        assert depth.heads_padded.shape == (cfg.num_codebooks - 1, v + 5, cfg.depth.hidden_size)
        assert not depth.heads_padded[:, v:].any() and ours.code0_padded.shape[0] == v + 5
        # the parameters are views of the padded copies: the weights are held once
        assert depth.codebooks_head.data_ptr() == depth.heads_padded.data_ptr()
        assert ours.lm_head.weight.data_ptr() == ours.code0_padded.data_ptr()
    else:
        assert depth.heads_padded is None and ours.code0_padded is None
    rec = RecordingGreedy()
    frames = ours.depth_decode(hidden, code0, rec)
    ref = hf.depth_decoder.generate(input_ids=torch.stack([torch.zeros_like(code0), code0], 1),
                                    backbone_last_hidden_state=hidden, do_sample=False,
                                    max_new_tokens=cfg.num_codebooks - 1)
    assert torch.equal(frames, ref[:, 1:])
    # teacher-forced logits of every codebook: transformers' forward over the whole frame
    full = hf.depth_decoder(input_ids=torch.cat([torch.zeros_like(code0)[:, None], frames[:, :-1]], 1),
                            backbone_last_hidden_state=hidden)
    for k in range(1, cfg.num_codebooks):
        torch.testing.assert_close(rec.logits[k], full.logits[:, k - 1].float(), rtol=0, atol=ATOL)
    # the KV buffers are reused by the next frame: a second call with other rows agrees too
    again = ours.depth_decode(hidden[2:], code0[2:], GreedyCodebooks())
    assert torch.equal(again, frames[2:])
    with pytest.raises(ValueError, match="holds 8"):
        ours.depth_decode(hidden.repeat(2, 1), code0.repeat(2), GreedyCodebooks())


@torch.no_grad()
@pytest.mark.parametrize("head_row_multiple", [1, 64])
def test_greedy_frames_equal_transformers_generate_batched(pair, head_row_multiple):
    """Three prompts of different lengths, batched, the third joining at step 3 (a prefill
    chunk in a step of decode rows): each row's frames equal transformers' generate alone,
    with the heads as they are and padded to 64 rows (CUDA's layout)."""
    cfg, ours, hf = pair
    n = 8
    ours_frames = drive(ours, PROMPTS, n, lambda rows: GreedyCodebooks(), join_at={2: 3},
                        head_row_multiple=head_row_multiple)
    for i, p in enumerate(PROMPTS):
        ref = hf_generate(hf, p, n)
        assert torch.equal(ours_frames[i], ref), (i, ours_frames[i], ref)
        assert len(set(map(tuple, ref.tolist()))) > 2  # the frames are not one repeated value


@pytest.fixture(scope="module")
def eos_pair(tmp_path_factory):
    """Codebooks of 3 ids: the end frame (codebooks 0..K-2 all 0) is likely; with this seed
    greedy decoding ends PROMPTS[0] and [1] after 13 and 4 frames, [2] runs past 16."""
    path = make_tiny_csm(tmp_path_factory.mktemp("csm_eos"), seed=2, codebook_size=3)
    cfg = CsmModelConfig.from_pretrained(path)
    return cfg, load_csm(cfg, "cpu", torch.float32), load_hf_csm(path)


@torch.no_grad()
def test_end_of_audio_frame_ends_each_row_as_transformers(eos_pair):
    cfg, ours, hf = eos_pair
    n = 16
    ours_frames = drive(ours, PROMPTS, n, lambda rows: GreedyCodebooks())
    for i, p in enumerate(PROMPTS):
        ref = hf_generate(hf, p, n)
        assert torch.equal(ours_frames[i], ref), (i, ours_frames[i], ref)
    ended = [bool(ours.frame_is_eos(f[-1:]).item()) for f in ours_frames.values()]
    assert ended == [True, True, False] and [len(f) for f in ours_frames.values()] == [13, 4, n]


@torch.no_grad()
def test_seeded_sampling_same_alone_and_in_a_batch(pair):
    cfg, ours, _ = pair
    sampler = Sampler("cpu", backend="torch")
    params = [SamplingParams(temperature=1.0, top_k=8, seed=100 + i) for i in range(len(PROMPTS))]
    frames_so_far: dict[int, int] = {}

    def sampler_for(rows):
        counters = [frames_so_far.get(i, 0) for i in rows]
        for i in rows:
            frames_so_far[i] = frames_so_far.get(i, 0) + 1
        batch = SamplingBatch.build([params[i] for i in rows], list(range(len(rows))), [params[i].seed for i in rows],
                                    counters, [], "cpu")
        return RaceCodebooks(sampler, batch, cfg.num_codebooks)

    together = drive(ours, PROMPTS, 6, sampler_for, join_at={1: 2})
    for i, p in enumerate(PROMPTS):
        frames_so_far.clear()
        alone = drive(ours, [p], 6, lambda rows: sampler_for([i]))
        assert torch.equal(alone[0], together[i])
    greedy = drive(ours, PROMPTS, 6, lambda rows: GreedyCodebooks())
    assert any(not torch.equal(greedy[i], together[i]) for i in range(len(PROMPTS)))


def test_missing_and_misshapen_tensors_are_named(csm_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(csm_dir, bad)
    weights = load_file(bad / "model.safetensors")
    gone = "depth_decoder.model.layers.1.mlp.down_proj.weight"
    del weights[gone]
    save_file(weights, bad / "model.safetensors")
    cfg = CsmModelConfig.from_pretrained(bad)
    with pytest.raises(LoadError, match=r"missing tensor\(s\).*" + gone.replace(".", r"\.")):
        load_csm(cfg, "cpu", torch.float32)
    weights[gone] = torch.zeros(3, 3)
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(LoadError, match=r"tensor '" + gone.replace(".", r"\.") + r"' in model\.safetensors: expected shape"):
        load_csm(cfg, "cpu", torch.float32)


@torch.no_grad()
def test_untied_codebook_embeddings_load_both_tables(tmp_path):
    path = make_tiny_csm(tmp_path / "untied", seed=4, tie=False, num_codebooks=3)
    cfg = CsmModelConfig.from_pretrained(path)
    ours, hf = load_csm(cfg, "cpu", torch.float32), load_hf_csm(path)
    assert not cfg.tie_codebook_embeddings
    assert torch.equal(ours.embed_audio_tokens.weight, hf.backbone_model.embed_tokens.embed_audio_tokens.weight)
    assert torch.equal(ours.depth.embed_tokens.weight, hf.depth_decoder.model.embed_tokens.weight)
    assert not torch.equal(ours.embed_audio_tokens.weight, ours.depth.embed_tokens.weight)
    frames = torch.tensor([[1, 2, 3], [4, 5, 6]])
    torch.testing.assert_close(ours.embed_frames(frames), hf.backbone_model.embed_tokens(frames[:, None])[:, 0],
                               rtol=0, atol=0)
    hidden, code0 = torch.randn(2, cfg.backbone.hidden_size), torch.tensor([7, 9])
    ours.allocate_depth_kv(2)
    ref = hf.depth_decoder.generate(input_ids=torch.stack([torch.zeros_like(code0), code0], 1),
                                    backbone_last_hidden_state=hidden, do_sample=False, max_new_tokens=2)
    assert torch.equal(ours.depth_decode(hidden, code0, GreedyCodebooks()), ref[:, 1:])
