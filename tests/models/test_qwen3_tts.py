"""runner/models/qwen3_tts.py (Qwen3-TTS talker + code predictor) against the qwen-tts 0.1.1
reference, through the golden files of tests/reference/qwen3_tts_golden.py (two tiny random
checkpoints: `custom_voice` with an Identity predictor projection, `base` with the biased
Linear; prompts built by the reference's own generate()), loaded through
runner/models/qwen3_tts_loader.py. The frames are driven batched through the frame-step API
over the paged KV cache, as test_csm.py drives CSM."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from runner.config import ConfigError
from runner.layers.attention import allocate_kv_cache
from runner.models.csm_sampling import GreedyCodebooks
from runner.models.loader import LoadError
from runner.models.qwen3_tts import NO_CODE, NO_TEXT, Qwen3TtsModel
from runner.models.qwen3_tts_speaker import SpeakerEncoder, SpeakerEncoderConfig
from runner.models.qwen3_tts_config import Qwen3TtsConfig
from runner.models.qwen3_tts_loader import expected_qwen3_tts_tensors, load_qwen3_tts
from tests.models.test_models import PagedSequences

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 128
MODELS = ("custom_voice", "base", "ends")  # tests/reference/qwen3_tts_golden.py MODELS


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def golden(qwen3_tts_golden) -> Path:
    return qwen3_tts_golden("qwen3_tts_golden")


@pytest.fixture(scope="module", params=MODELS)
def loaded(request, golden) -> tuple[Qwen3TtsModel, dict[str, dict[str, torch.Tensor]], Path]:
    """(our model, {case: the reference's arrays}, the model's golden folder)."""
    folder = golden / request.param
    cfg = Qwen3TtsConfig.from_pretrained(folder / "checkpoint")
    names = json.loads((golden / "manifest.json").read_text())["models"][request.param]
    cases = {n: {k: torch.from_numpy(v) for k, v in np.load(folder / f"{n}.npz").items()} for n in names}
    return load_qwen3_tts(cfg, "cpu", torch.float32), cases, folder


def prompt_embeds(model: Qwen3TtsModel, case: dict[str, torch.Tensor]) -> torch.Tensor:
    """The case's prompt rows through embed_parts, the x-vector added over its row."""
    embeds = model.embed_parts(case["text_ids"], case["codec_ids"])
    if "xvector" in case:
        embeds[int(case["xvector_row"])] += case["xvector"]
    return embeds


def step_text(model: Qwen3TtsModel, case: dict[str, torch.Tensor], frame: int) -> int:
    """The text id fed with generated frame `frame` (M:1689): the trailing text, then tts_pad."""
    trailing = case["trailing_ids"].tolist()
    return trailing[frame] if frame < len(trailing) else model.cfg.tts_pad_id


def step_rows(model: Qwen3TtsModel, cases: list[dict], frames: list[torch.Tensor], index: list[int]) -> torch.Tensor:
    """Generated-step inputs: frame [K] of each row + the text part of its frame index."""
    text = torch.tensor([step_text(model, c, i) for c, i in zip(cases, index)])
    return model.embed_parts(text, torch.stack(frames))


class Code0Window(GreedyCodebooks):
    """Greedy with the reference's code-0 rules (M:2044-2066): ids >= codebook_size other than
    eos suppressed, eos barred for each row's frames 0 and 1 (min_new_tokens=2). Stage 2 moves
    these into the engine's sampler; here they are the test's."""

    def __init__(self, model: Qwen3TtsModel, frame_index: list[int]):
        self.cfg = model.cfg
        self.frame_index = torch.tensor(frame_index)
        self.logits: dict[int, torch.Tensor] = {}

    def __call__(self, logits, codebook, out=None):
        self.logits[codebook] = logits.clone()
        if codebook == 0:
            cfg = self.cfg
            barred = torch.zeros_like(logits, dtype=torch.bool)
            barred[:, cfg.codebook_size:] = True
            barred[:, cfg.codec.eos] = (self.frame_index < 2)
            logits = logits.masked_fill(barred, float("-inf"))
        return super().__call__(logits, codebook, out)


def test_config_reads_both_decoders(golden):
    for kind, projects in (("custom_voice", False), ("base", True)):
        cfg = Qwen3TtsConfig.from_pretrained(golden / kind / "checkpoint")
        assert cfg.model_type == kind and cfg.predictor_projects == projects
        assert (cfg.num_code_groups, cfg.codebook_size, cfg.codec_vocab_size) == (4, 32, 32 + 1024)
        assert cfg.table_offsets == (0, 1056, 1088, 1120)
        assert cfg.talker.decoder == cfg.predictor.decoder == "qwen3" and cfg.talker.qk_norm
        assert (cfg.talker.hidden_size, cfg.predictor.hidden_size) == (64, 64 if kind == "custom_voice" else 32)
        assert cfg.talker.rope.theta == cfg.predictor.rope.theta == 10000.0  # MRoPE section ignored
        assert (cfg.codec.eos, cfg.codec.pad, cfg.codec.bos, cfg.tts_pad_id) == (42, 40, 41, 152)
    assert cfg.languages == {"english": 50, "chinese": 51, "sichuan": 52}
    cv = Qwen3TtsConfig.from_pretrained(golden / "custom_voice" / "checkpoint")
    assert cv.speakers == {"alice": 60, "bob": 61} and cv.speaker_dialects == {"alice": None, "bob": "sichuan"}


def released_config(hidden: int, intermediate: int) -> dict:
    """A config.json of the released 12 Hz folders' shape (docs/qwen3_tts.md §1-2: 0.6B is
    hidden 1024 / intermediate 3072, 1.7B 2048 / 6144; the rest is shared)."""
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"], "tts_model_type": "custom_voice",
        "tts_pad_token_id": 151671, "tts_bos_token_id": 151672, "tts_eos_token_id": 151673,
        "assistant_token_id": 77091, "sample_rate": 24000,
        "talker_config": {
            "vocab_size": 3072, "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "rope_scaling": {"mrope_section": [24, 20, 20], "interleaved": True, "rope_type": "default"},
            "use_sliding_window": False, "sliding_window": None, "attention_bias": False,
            "num_code_groups": 16, "text_vocab_size": 151936, "text_hidden_size": 2048,
            "position_id_per_seconds": 13, "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_think_id": 2154,
            "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
            "codec_language_id": {"english": 2050, "chinese": 2055, "sichuan_dialect": 2062},
            "spk_id": {"vivian": 3065, "eric": 2875}, "spk_is_dialect": {"vivian": False, "eric": "sichuan_dialect"},
            "code_predictor_config": {
                "vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5,
                "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
                "max_position_embeddings": 65536, "rope_theta": 1000000.0, "rope_scaling": None,
                "num_code_groups": 16, "use_sliding_window": False, "layer_types": ["full_attention"] * 5},
        },
    }


@pytest.mark.parametrize("hidden", [1024, 2048])
def test_released_base_folders_speaker_encoder(hidden):
    """A released Base config.json names only enc_dim (the talker's width) and sample_rate in
    speaker_encoder_config; the rest are the reference's defaults (ECAPA 512 x 4 + 1536)."""
    raw = released_config(hidden, 3 * hidden) | {"tts_model_type": "base",
                                                 "speaker_encoder_config": {"enc_dim": hidden, "sample_rate": 24000}}
    raw["talker_config"].update(spk_id={}, spk_is_dialect={})
    cfg = Qwen3TtsConfig.from_dict(raw)
    assert cfg.model_type == "base" and not cfg.speakers
    enc = SpeakerEncoderConfig.from_dict(raw["speaker_encoder_config"])
    assert (enc.enc_dim, enc.enc_channels, enc.enc_kernel_sizes, enc.mel_dim) == (
        hidden, (512, 512, 512, 512, 1536), (5, 3, 3, 3, 1), 128)
    assert SpeakerEncoder(enc)(torch.zeros(1, 20, 128)).shape == (1, hidden)


@pytest.mark.parametrize("hidden, intermediate", [(1024, 3072), (2048, 6144)])
def test_released_layouts(hidden, intermediate):
    """The 0.6B layout has no predictor projection (the Identity), the 1.7B one a biased Linear;
    the codec table is 3072 + 15 * 2048 rows, each group's table at its offset."""
    cfg = Qwen3TtsConfig.from_dict(released_config(hidden, intermediate))
    assert cfg.predictor_projects == (hidden != 1024)
    assert cfg.table_offsets == (0,) + tuple(3072 + g * 2048 for g in range(15))
    assert (cfg.talker.num_layers, cfg.talker.head_dim, cfg.talker.rope.theta) == (28, 128, 1e6)
    assert (cfg.predictor.num_layers, cfg.predictor.hidden_size, cfg.codebook_size) == (5, 1024, 2048)
    assert cfg.speaker_dialects == {"vivian": None, "eric": "sichuan_dialect"} and cfg.codec.eos == 2150
    tensors = expected_qwen3_tts_tensors(cfg)
    rows = sum(t.shape[0] for t in tensors.values() if t.param == "codec_embedding.weight")
    assert rows == 3072 + 15 * 2048
    assert sum(t.shape[0] for t in tensors.values() if t.param == "predictor.lm_head") == 15 * 2048
    projector = tensors.get("talker.code_predictor.small_to_mtp_projection.bias")
    assert (projector.shape if projector else None) == ((1024,) if hidden != 1024 else None)


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["talker_config"].update(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
     r"talker_config\.rope_scaling\.rope_type 'yarn'"),
    (lambda r: r["talker_config"].pop("code_predictor_config"),
     r"missing field 'talker_config\.code_predictor_config'"),
    (lambda r: r["talker_config"]["code_predictor_config"].update(num_code_groups=5),
     r"code_predictor_config\.num_code_groups 5 != talker_config\.num_code_groups 16"),
    (lambda r: r["talker_config"].update(codec_eos_token_id=7),
     r"talker_config\.codec_eos_token_id 7 is not in \[2048, 3072\)"),
    (lambda r: r["talker_config"].update(spk_is_dialect={"eric": "klingon"}), r"spk_is_dialect\['eric'\] 'klingon'"),
    (lambda r: r["talker_config"]["code_predictor_config"].update(hidden_act="gelu"),
     r"code_predictor_config\.hidden_act 'gelu' is not supported"),
    (lambda r: r["talker_config"].update(use_sliding_window=True), r"talker_config\.use_sliding_window True"),
    (lambda r: r.update(architectures=["CsmForConditionalGeneration"]),
     r"does not name Qwen3TTSForConditionalGeneration"),
])
def test_config_errors_name_the_field(edit, message):
    raw = released_config(1024, 3072)
    edit(raw)
    with pytest.raises(ConfigError, match=message):
        Qwen3TtsConfig.from_dict(raw)


@torch.no_grad()
def test_prompt_rows_embed_as_the_reference(loaded):
    """Every prompt kind (speaker / dialect / instruct / x-vector / ICL frames, streaming and
    not): embed_parts over the rows = generate's own inputs_embeds."""
    model, cases, _ = loaded
    for name, case in cases.items():
        torch.testing.assert_close(prompt_embeds(model, case), case["prompt_embeds"], rtol=0, atol=1e-5, msg=name)
    codes = torch.full((2, model.num_codebooks), NO_CODE)
    assert torch.equal(model.embed_parts(torch.tensor([NO_TEXT, NO_TEXT]), codes), torch.zeros(2, 64))


@torch.no_grad()
def test_talker_hidden_and_logits_at_prompt_and_steps(loaded):
    """All prompts of a model in one flattened prefill step over the paged cache, then the
    reference's frames fed back (teacher-forced) in batched decode steps: hidden states and
    code-0 logits at every prompt position and every step equal the reference's."""
    model, cases, _ = loaded
    names = list(cases)
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE)
    kv = allocate_kv_cache(model.cfg.talker, NUM_BLOCKS, BLOCK_SIZE, "cpu", torch.float32)
    lens = [len(cases[n]["text_ids"]) for n in names]
    assert len(set(lens)) > 2  # prompts of different lengths share the step
    _, positions, meta = seqs.step([(i, [0] * n) for i, n in enumerate(lens)])
    embeds = torch.cat([prompt_embeds(model, cases[n]) for n in names])
    hidden, logits = model.backbone_step(embeds, positions, kv, meta, torch.arange(len(positions)))
    start = 0
    for n, length in zip(names, lens):
        ref = cases[n]
        torch.testing.assert_close(hidden[start : start + length], ref["prompt_hidden"], rtol=0, atol=ATOL, msg=n)
        torch.testing.assert_close(logits[start : start + length], ref["prompt_logits"], rtol=0, atol=ATOL, msg=n)
        torch.testing.assert_close(logits[start + length - 1], ref["step_logits"][0], rtol=0, atol=ATOL, msg=n)
        start += length
    refs = [cases[n] for n in names]
    for step in range(1, max(len(r["frames"]) for r in refs) + 1):
        live = [i for i, r in enumerate(refs) if step <= len(r["frames"])]  # rows leave after their last frame
        _, pos, meta = seqs.step([(i, [0]) for i in live])
        rows = step_rows(model, [refs[i] for i in live], [refs[i]["frames"][step - 1] for i in live],
                         [step - 1] * len(live))
        hidden, logits = model.backbone_step(rows, pos, kv, meta, torch.arange(len(live)))
        for row, i in enumerate(live):
            r, msg = refs[i], f"{names[i]} step {step}"
            torch.testing.assert_close(hidden[row], r["step_hidden"][step], rtol=0, atol=ATOL, msg=msg)
            torch.testing.assert_close(logits[row], r["step_logits"][step], rtol=0, atol=ATOL, msg=msg)


@torch.no_grad()
def test_code_predictor_codes_and_logits_match_the_reference(loaded):
    """Groups 1..K-1 from the talker's hidden and code 0 (5 rows at once): the reference's
    greedy codes and its teacher-forced logits of every group (Identity and biased projector)."""
    model, _, folder = loaded
    ref = {k: torch.from_numpy(v) for k, v in np.load(folder / "depth.npz").items()}
    b = len(ref["hidden"])
    model.allocate_depth_kv(8)
    rec = Code0Window(model, [2] * b)
    frames = model.depth_decode(ref["hidden"], ref["frames"][:, 0], rec)
    assert torch.equal(frames, ref["frames"])
    for g in range(1, model.num_codebooks):
        torch.testing.assert_close(rec.logits[g], ref["logits"][:, g - 1], rtol=0, atol=ATOL)
    # the KV buffers are reused by the next frame: other rows agree too
    assert torch.equal(model.depth_decode(ref["hidden"][2:], ref["frames"][2:, 0], GreedyCodebooks()), frames[2:])
    with pytest.raises(ValueError, match="holds 8"):
        model.depth_decode(ref["hidden"].repeat(2, 1), ref["frames"][:, 0].repeat(2), GreedyCodebooks())


def drive(model: Qwen3TtsModel, cases: list[dict], max_frames: int, join_at: dict[int, int]) -> dict[int, torch.Tensor]:
    """Run the prompts through frame_step over the paged cache, batched: each step holds every
    live row's last frame (+ its step text) and the prompts joining now (a prefill chunk each);
    a row leaves after an eos frame (not kept: never decoded) or max_frames."""
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE)
    kv = allocate_kv_cache(model.cfg.talker, NUM_BLOCKS, BLOCK_SIZE, "cpu", torch.float32)
    model.allocate_depth_kv(len(cases))
    frames: dict[int, list[torch.Tensor]] = {}
    live: list[int] = []
    step = 0
    while live or len(frames) < len(cases):
        joining = [i for i in range(len(cases)) if join_at.get(i, 0) == step]
        rows = live + joining  # decode rows first, as the scheduler orders them
        if rows:
            chunks = [(i, [0]) for i in live] + [(i, [0] * len(cases[i]["text_ids"])) for i in joining]
            _, positions, meta = seqs.step(chunks)
            parts = [step_rows(model, [cases[i] for i in live], [frames[i][-1] for i in live],
                               [len(frames[i]) - 1 for i in live])] if live else []
            parts += [prompt_embeds(model, cases[i]) for i in joining]
            last_rows = meta.query_start_loc[1:].long() - 1
            sampler = Code0Window(model, [len(frames.get(i, [])) for i in rows])
            out = model.frame_step(torch.cat(parts), positions, kv, meta, last_rows, sampler)
            done = model.frame_is_eos(out).tolist()
            live = []
            for r, i in enumerate(rows):
                frames.setdefault(i, [])
                if done[r]:
                    continue
                frames[i].append(out[r])
                if len(frames[i]) < max_frames:
                    live.append(i)
        step += 1
    return {i: torch.stack(f) for i, f in frames.items()}


@torch.no_grad()
def test_greedy_frames_equal_the_reference_generate_batched(loaded):
    """Every prompt kind of a model batched, rows joining at different steps (a prefill chunk in
    a step of decode rows): each row's frames equal the reference's generate() alone. The
    reference ran N steps and returned N - 1 frames (the last code 0 is never expanded)."""
    model, cases, folder = loaded
    refs = list(cases.values())
    n = json.loads((folder.parent / "manifest.json").read_text())["max_new_tokens"] - 1
    ours = drive(model, refs, n, join_at={1: 2, 2: 3})
    for i, (name, ref) in enumerate(cases.items()):
        assert torch.equal(ours[i], ref["frames"]), (name, ours[i], ref["frames"])
        assert len(ref["frames"]) < 4 or len(set(map(tuple, ref["frames"].tolist()))) > 2, name  # not one frame
    # "ends": rows end on eos (the eos frame is not audio) at different frames, one at frame 2,
    # the first eos may take (the reference's min_new_tokens=2), and one runs to the limit
    lengths = [len(ours[i]) for i in range(len(refs))]
    assert lengths == ([3, n, 5, 2] if folder.name == "ends" else [n] * len(refs))


def test_frame_is_eos_reads_code0_alone(loaded):
    model, _, _ = loaded
    eos = model.cfg.codec.eos
    frames = torch.tensor([[eos, 1, 2, 3], [5, eos, eos, eos], [eos, eos, eos, eos], [0, 0, 0, 0]])
    assert model.frame_is_eos(frames).tolist() == [True, False, True, False]


def test_missing_misshapen_and_unexpected_tensors_are_named(golden, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(golden / "base" / "checkpoint", bad)
    weights = load_file(bad / "model.safetensors")
    cfg = Qwen3TtsConfig.from_pretrained(bad)
    gone = "talker.code_predictor.small_to_mtp_projection.bias"
    kept = weights.pop(gone)
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(LoadError, match=r"missing tensor\(s\).*" + gone.replace(".", r"\.")):
        load_qwen3_tts(cfg, "cpu", torch.float32)
    weights[gone] = kept
    table = "talker.code_predictor.model.codec_embedding.2.weight"
    weights[table] = torch.zeros(31, 64)
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(LoadError, match=r"tensor '" + table.replace(".", r"\.") + r"' in model\.safetensors: "
                                        r"expected shape \(32, 64\), got \(31, 64\)"):
        load_qwen3_tts(cfg, "cpu", torch.float32)
    weights[table] = torch.zeros(32, 64)
    weights["talker.code_predictor.lm_head.3.weight"] = torch.zeros(32, 32)  # a group the config lacks
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(LoadError, match=r"unexpected tensor\(s\).*'talker\.code_predictor\.lm_head\.3\.weight'"):
        load_qwen3_tts(cfg, "cpu", torch.float32)
    # the speaker encoder's tensors are Base's x-vector encoder's: not this model's, not unexpected
    assert any(k.startswith("speaker_encoder.") for k in weights)


@torch.no_grad()
def test_loaded_tables_and_heads_are_the_checkpoints(golden):
    """The concatenated codec table and the flat predictor heads hold each checkpoint tensor at
    its offset (what the golden comparisons rely on, checked directly)."""
    path = golden / "base" / "checkpoint"
    cfg = Qwen3TtsConfig.from_pretrained(path)
    model = load_qwen3_tts(cfg, "cpu", torch.float32)
    weights = load_file(path / "model.safetensors")
    off, v = cfg.table_offsets, cfg.codebook_size
    assert torch.equal(model.codec_embedding.weight[: off[1]], weights["talker.model.codec_embedding.weight"])
    model.allocate_depth_kv(1)
    for g in range(1, cfg.num_code_groups):
        assert torch.equal(model.codec_embedding.weight[off[g] : off[g] + v],
                           weights[f"talker.code_predictor.model.codec_embedding.{g - 1}.weight"])
        assert torch.equal(model.predictor.heads[g - 1], weights[f"talker.code_predictor.lm_head.{g - 1}.weight"])
    assert model.predictor.embed_tokens.weight is model.codec_embedding.weight
