"""The models the frame benchmarks build (deploy/bench/csm.py, csm_ramp.py, mimi.py): model folders
of CSM-1B's and Qwen3-TTS 1.7B's shapes whose weights the engine draws at random
(--random-weights), random codecs of the released shapes (Mimi, the 12 Hz tokenizer's decoder),
each model's requests and the parameter prefixes its frame-step bound counts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from deploy.bench.common import scratch

PROMPT = 32  # text tokens of each request's prompt


def csm_folder(root: Path) -> Path:
    """transformers CsmConfig() defaults (CSM-1B's shape) as a model folder; no weights
    (--random-weights); the embedded default's tokenizer and an omnistream.json for serving."""
    from transformers import CsmConfig

    from runner.models.default_model import SPECIALS, ensure_default_model

    root.mkdir(parents=True, exist_ok=True)
    cfg = CsmConfig()
    cfg.architectures = ["CsmForConditionalGeneration"]
    raw = cfg.to_dict() | {"bos_token_id": SPECIALS["<|begin_of_text|>"]}
    (root / "config.json").write_text(json.dumps(raw, indent=1))
    tiny = ensure_default_model(str(scratch("omnistream-cache")))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, root / f)
    (root / "omnistream.json").write_text(json.dumps({
        "family": "csm", "voices": ["0", "1"], "suffix_token_ids": [SPECIALS["<|eot_id|>"]],
        # random weights end at random: every utterance runs its full length
        "sampling": {"temperature": 0.9, "top_k": 50, "max_tokens": 150, "ignore_eos": True},
    }))
    return root


# Qwen3-TTS-12Hz-1.7B's talker and code predictor (config.json of the released folders): the
# shapes that set the step's cost. The special ids are valid placeholders (a random-weight run
# never reads their meaning).
QWEN3_TTS_1B7 = {
    "architectures": ["Qwen3TTSForConditionalGeneration"], "tts_model_type": "base", "tts_model_size": "1b7",
    "tokenizer_type": "qwen3_tts_tokenizer_12hz", "im_start_token_id": 151644, "im_end_token_id": 151645,
    "tts_pad_token_id": 151671, "tts_bos_token_id": 151672, "tts_eos_token_id": 151673,
    "talker_config": {
        "vocab_size": 3072, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "rope_scaling": {"mrope_section": [24, 20, 20], "interleaved": True, "rope_type": "default"},
        "num_code_groups": 16, "text_vocab_size": 151936, "text_hidden_size": 2048,
        "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_think_id": 2154,
        "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "spk_id": {}, "spk_is_dialect": {}, "codec_language_id": {"english": 2050, "chinese": 2055},
        "code_predictor_config": {
            "vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 65536,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "num_code_groups": 16}},
}


def qwen3_tts_folder(root: Path) -> Path:
    """QWEN3_TTS_1B7 as a model folder; no weights (random), no codec (the frames section)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(QWEN3_TTS_1B7, indent=1))
    return root


def qwen3_tts_served_folder(root: Path) -> Path:
    """QWEN3_TTS_1B7 as a CustomVoice folder to serve (two speakers; random weights): the embedded
    default's tokenizer (its ids fit the text vocabulary; the words are not Qwen's), and an
    omnistream.json whose utterances run their whole length."""
    from runner.models.default_model import ensure_default_model

    root.mkdir(parents=True, exist_ok=True)
    raw = json.loads(json.dumps(QWEN3_TTS_1B7)) | {"tts_model_type": "custom_voice"}
    raw["talker_config"].update(spk_id={"vivian": 3065, "ryan": 3061}, spk_is_dialect={"vivian": False, "ryan": False})
    (root / "config.json").write_text(json.dumps(raw, indent=1))
    tiny = ensure_default_model(str(scratch("omnistream-cache")))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, root / f)
    (root / "omnistream.json").write_text(json.dumps({
        "family": "qwen3_tts", "sampling": {"temperature": 0.9, "top_k": 50, "repetition_penalty": 1.05,
                                            "max_tokens": 150, "ignore_eos": True}}))
    return root


def qwen12hz_folder(root: Path) -> Path:
    """The released 12 Hz tokenizer's decoder (16 codebooks of 2048, 24 kHz), random."""
    from safetensors.torch import save_file

    from runner.codecs.qwen12hz_loader import RELEASED_DECODER_CONFIG, random_decoder_tensors, read_config

    if (root / "model.safetensors").is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({
        "model_type": "qwen3_tts_tokenizer_12hz", "decode_upsample_rate": 1920, "output_sample_rate": 24000,
        "decoder_config": RELEASED_DECODER_CONFIG}))
    save_file(random_decoder_tensors(read_config(root)), str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def frame_request(model: str, i: int) -> dict:
    """add_request arguments of request i's prompt: CSM a text prompt; Qwen3-TTS its rows (a
    text part every position, codec part -1 but the prefix's ids) and a trailing text."""
    text = [(7 * i + j) % 400 + 1 for j in range(PROMPT)]
    if model == "csm":
        return {"prompt_token_ids": text}
    c = QWEN3_TTS_1B7["talker_config"]
    frames = [[-1] * 16 for _ in text]
    for row, code in zip(frames[-5:], (c["codec_nothink_id"], c["codec_think_bos_id"], c["codec_think_eos_id"],
                                        c["codec_pad_id"], c["codec_bos_id"])):
        row[0] = code
    return {"prompt_token_ids": text, "prompt_frames": frames, "step_text_ids": text[:24]}


FRAME_MODELS = {"csm": ("csm1b-random", csm_folder), "qwen3_tts": ("qwen3tts-1b7-random", qwen3_tts_folder)}
# the model's parameter prefixes: backbone + code-0 head, the depth decoder's body, its heads
PREFIXES = {"csm": (("backbone.", "lm_head."), ("depth.layers.", "depth.norm.", "depth.inputs_embeds_projector."),
                     ("depth.codebooks_head",)),
             "qwen3_tts": (("backbone.", "codec_head."),
                           ("predictor.layers.", "predictor.norm.", "predictor.inputs_embeds_projector."),
                           ("predictor.lm_head",))}


def mimi_folder(root: Path) -> Path:
    """The real Mimi's architecture (MimiConfig() defaults: 32 codebooks of 2048, 24 kHz), random."""
    from transformers import MimiConfig, MimiModel

    if (root / "config.json").is_file():
        return root
    torch.manual_seed(0)
    MimiModel(MimiConfig()).save_pretrained(root, safe_serialization=True)
    return root
