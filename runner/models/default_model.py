"""The embedded default: a deterministic tiny random-weight Orpheus-shaped model, its tokenizer
and a tiny SNAC, built into a cache folder with no downloads, so `omnistream serve` works with
no arguments. It speaks noise: the weights are random. It exercises every real path (HF-folder
loading, tokenizer, prompt template, the Orpheus code constraint, SNAC windows, streaming).

Token layout (vocab 1024):
  0..255     byte-level text tokens, then BPE merges up to 480
  500..507   special tokens (BOS, start/end of human, start of AI, start/end of speech, EOT)
  512..959   audio codes: 7 codebook slots x 64 codes (tiny SNAC codebook)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runner.models.builders import make_tiny_snac

VERSION = "1"
VOCAB = 1024
TEXT_VOCAB = 480
SPECIALS = {
    "<|begin_of_text|>": 500,
    "<|start_of_human|>": 501,
    "<|end_of_human|>": 502,
    "<|start_of_ai|>": 503,
    "<|start_of_speech|>": 504,
    "<|end_of_speech|>": 505,
    "<|eot_id|>": 506,
    "<|pad|>": 507,
}
AUDIO_OFFSET = 512
CODEBOOK = 64
VOICES = ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello there, how are you today? "
    "This is omnistream, a streaming speech server. It speaks as soon as the text arrives, "
    "sentence by sentence, with low latency. Numbers like 3.14 and 42 stay together. "
    "tara: leah: jess: leo: dan: mia: zac: zoe: "
) * 4


def _llama_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": SPECIALS["<|begin_of_text|>"],
        "eos_token_id": [SPECIALS["<|end_of_speech|>"], SPECIALS["<|eot_id|>"]],
        "torch_dtype": "float32",
    }


def _weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, I, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    w = {"model.embed_tokens.weight": rnd(VOCAB, H), "model.norm.weight": torch.ones(H), "lm_head.weight": rnd(VOCAB, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": rnd(q, H),
            p + "self_attn.k_proj.weight": rnd(kv, H),
            p + "self_attn.v_proj.weight": rnd(kv, H),
            p + "self_attn.o_proj.weight": rnd(H, q),
            p + "mlp.gate_proj.weight": rnd(I, H),
            p + "mlp.up_proj.weight": rnd(I, H),
            p + "mlp.down_proj.weight": rnd(H, I),
            p + "input_layernorm.weight": torch.ones(H),
            p + "post_attention_layernorm.weight": torch.ones(H),
        }
    return w


def write_tokenizer(path: Path) -> None:
    """The default's byte-level BPE (ids < TEXT_VOCAB) with SPECIALS at their fixed ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TEXT_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    n = tok.get_vocab_size()
    # pad the id space so special tokens land on their fixed ids
    filler = [f"<|reserved_{i}|>" for i in range(n, SPECIALS["<|begin_of_text|>"])]
    tok.add_special_tokens(filler + list(SPECIALS))
    for name, want in SPECIALS.items():
        got = tok.token_to_id(name)
        if got != want:
            raise RuntimeError(f"default tokenizer: {name} got id {got}, expected {want}")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}))


def ensure_default_model(cache_dir: str | Path, seed: int = 0) -> Path:
    """Build (once) and return the folder of the embedded default model."""
    root = Path(cache_dir).expanduser() / f"default-orpheus-tiny-v{VERSION}"
    if (root / ".complete").exists():
        return root
    tmp = root.with_name(root.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = _llama_config()
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(_weights(cfg, seed), str(tmp / "model.safetensors"))
    write_tokenizer(tmp)
    make_tiny_snac(tmp / "snac", seed=seed)
    profile = {
        "voices": VOICES,
        "default_voice": "tara",
        "text_template": "{voice}: {text}",
        "prefix_token_ids": [SPECIALS["<|start_of_human|>"]],
        "suffix_token_ids": [SPECIALS[k] for k in ("<|eot_id|>", "<|end_of_human|>", "<|start_of_ai|>", "<|start_of_speech|>")],
        "add_bos": True,
        "sample_rate": 24000,
        "sampling": {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.1, "max_tokens": 700,
                     "stop_token_ids": [SPECIALS["<|end_of_speech|>"]]},
        "codec": {"path": "snac", "audio_token_offset": AUDIO_OFFSET, "codebook_size": CODEBOOK,
                  "end_token_id": SPECIALS["<|end_of_speech|>"]},
    }
    (tmp / "omnistream.json").write_text(json.dumps(profile, indent=1))
    (tmp / ".complete").write_text(VERSION)
    if root.exists():  # a concurrent builder won; keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        return root
    tmp.rename(root)
    return root
