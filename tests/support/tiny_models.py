"""Tiny random-weight transformers checkpoints for tests (helpers, not a test module).

The weights are re-drawn from a seeded generator with larger stds than transformers' init
(and non-unit norm weights, non-zero biases) so every tensor matters to the output: a swapped
or dropped tensor changes logits, and greedy decoding does not collapse to one token.
"""

from __future__ import annotations

from pathlib import Path

import torch

BOS_ID = 1
EOS_ID = 2


def _hf_config(
    family: str,
    *,
    tie: bool,
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    rope_llama3: bool,
    max_pos: int,
    head_dim: int | None,
):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=0,
    )
    if head_dim is not None:
        common["head_dim"] = head_dim
    if family == "llama":
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if rope_llama3:
            # original_max_position_embeddings is small so that, with a tiny head_dim, some
            # frequencies are kept, some divided by `factor` and some interpolated.
            rope = {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        return LlamaConfig(**common, rope_parameters=rope)
    if family == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "qwen3":
        return Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    raise ValueError(f"unknown family {family!r}")


@torch.no_grad()
def _reinit(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name or name.endswith(".bias"):
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        else:
            # Projections larger than the embeddings: with tied embeddings a small residual
            # update makes every token predict itself and greedy output repeats one id.
            p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def make_tiny_model(
    family: str,
    path,
    *,
    tie: bool = False,
    vocab_size: int = 512,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    seed: int = 0,
    rope_llama3: bool = False,
    max_pos: int = 512,
    head_dim: int | None = None,
) -> Path:
    """Save a random transformers model of `family` ("llama", "qwen2", "qwen3") to `path`."""
    from transformers import AutoModelForCausalLM

    cfg = _hf_config(
        family,
        tie=tie,
        vocab_size=vocab_size,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        rope_llama3=rope_llama3,
        max_pos=max_pos,
        head_dim=head_dim,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _reinit(model, seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf(path):
    """The saved model as transformers loads it: fp32, eval mode, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def tiny_mimi_config(**overrides):
    """A MimiConfig of the real topology (24 kHz, 12.5 frames/s, 1920 samples a frame: upsampling
    ratios 8, 6, 5, 4 and a 2x latent upsample), tiny widths, 8 codebooks of 64, and a sliding
    window of 6 latent steps (3 frames) so short test streams run past it."""
    from transformers import MimiConfig

    cfg = dict(hidden_size=32, num_filters=4, num_residual_layers=1, upsampling_ratios=[8, 6, 5, 4],
               codebook_size=64, codebook_dim=16, num_quantizers=8, vector_quantization_hidden_dimension=16,
               upsample_groups=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=2, sliding_window=6, max_position_embeddings=4096, use_conv_shortcut=False)
    cfg.update(overrides)
    return MimiConfig(**cfg)


@torch.no_grad()
def make_tiny_mimi(path, *, seed: int = 0, **overrides) -> Path:
    """Save a random transformers MimiModel (tiny_mimi_config + overrides) to `path`. The weights
    are re-drawn so every part matters: random codebooks (transformers' init leaves them zero),
    layer scales of 0.5 instead of 0.01 (the transformer changes the output), and the last conv
    scaled so the PCM stays mostly inside [-1, 1] (clipped int16 would hide differences)."""
    from transformers import MimiModel

    torch.manual_seed(seed)
    model = MimiModel(tiny_mimi_config(**overrides)).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, b in model.named_buffers():
        if name.endswith("embed_sum"):
            b.copy_(torch.randn(b.shape, generator=gen))
    for name, p in model.named_parameters():
        if name.endswith("layer_scale.scale"):
            p.fill_(0.5)
    from runner.codecs.mimi_loader import decoder_modules

    last = decoder_modules(model)[2][-1].conv
    codes = torch.randint(0, model.config.codebook_size, (1, model.config.num_quantizers, 8), generator=gen)
    std = model.decode(codes).audio_values.std()
    last.weight.mul_(0.3 / std)
    last.bias.mul_(0.3 / std)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


CSM_TEXT_VOCAB = 100
CSM_AUDIO_TOKEN_ID = 90
CSM_AUDIO_EOS_TOKEN_ID = 91


def tiny_csm_config(*, num_codebooks: int = 4, codebook_size: int = 40, hidden: int = 64, layers: int = 2,
                    depth_hidden: int = 32, depth_layers: int = 2, tie: bool = True, text_vocab: int = CSM_TEXT_VOCAB,
                    audio_token_id: int = CSM_AUDIO_TOKEN_ID, audio_eos_token_id: int = CSM_AUDIO_EOS_TOKEN_ID,
                    bos_token_id: int = BOS_ID):
    """transformers CsmConfig of a tiny CSM: backbone 64 wide (4 / 2 heads), depth decoder 32
    wide with K + 1 positions, `num_codebooks` codebooks of `codebook_size`, text vocabulary 100
    with 90 = audio frame and 91 = audio end, 1 = BOS; codebook 0 = end of stream as in CSM-1B."""
    from transformers import CsmConfig

    return CsmConfig(
        num_codebooks=num_codebooks, vocab_size=codebook_size, text_vocab_size=text_vocab, hidden_size=hidden,
        intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, pad_token_id=audio_token_id, codebook_pad_token_id=codebook_size - 1,
        codebook_eos_token_id=0, bos_token_id=bos_token_id, audio_token_id=audio_token_id,
        audio_eos_token_id=audio_eos_token_id, tie_codebooks_embeddings=tie,
        depth_decoder_config=dict(num_codebooks=num_codebooks, backbone_hidden_size=hidden, vocab_size=codebook_size,
                                  hidden_size=depth_hidden, intermediate_size=2 * depth_hidden,
                                  num_hidden_layers=depth_layers, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=num_codebooks + 1),
        # its codec: tiny_mimi_config with one quantizer per codebook, codes < codebook_size (Mimi
        # wants a power of two)
        codec_config=tiny_mimi_config(num_quantizers=num_codebooks,
                                      codebook_size=min(1 << (codebook_size.bit_length() - 1), 64)).to_dict(),
    )


def make_tiny_csm(path, *, seed: int = 0, **config) -> Path:
    """Save a random transformers CsmForConditionalGeneration (tiny_csm_config(**config)) to
    `path`; weights re-drawn as _reinit does (the codec's too), and the codec's codebooks random
    (transformers leaves them zero, which encodes every clip to code 0)."""
    from transformers import CsmForConditionalGeneration

    torch.manual_seed(seed)
    model = CsmForConditionalGeneration(tiny_csm_config(**config)).to(torch.float32)
    _reinit(model, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.codec_model.named_buffers():
            if name.endswith("embed_sum"):
                b.copy_(torch.randn(b.shape, generator=gen))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf_csm(path):
    """The saved CSM as transformers loads it: fp32, eval mode, eager attention."""
    from transformers import CsmForConditionalGeneration

    return CsmForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def make_served_csm(path, *, seed: int = 0, max_frames: int = 40, ignore_eos: bool = False,
                    codec: dict | None = None) -> Path:
    """A tiny CSM folder the server runs as it would CSM-1B: the embedded default's byte-level
    tokenizer (BOS 500, end of text 506; text ids < 512, 508 = audio frame, 509 = audio end) and
    an omnistream.json stating the prompt ids the tiny tokenizer has instead of Llama-3's.
    ignore_eos: every utterance runs max_frames; codec: the profile's codec settings
    (MimiCodecConfig fields, e.g. max_streams)."""
    import json

    from runner.models.default_model import SPECIALS, write_tokenizer

    path = make_tiny_csm(path, seed=seed, text_vocab=512, audio_token_id=508, audio_eos_token_id=509,
                         bos_token_id=SPECIALS["<|begin_of_text|>"])
    write_tokenizer(path)
    sampling = {"temperature": 0.9, "top_k": 20, "max_tokens": max_frames} | ({"ignore_eos": True} if ignore_eos else {})
    (path / "omnistream.json").write_text(json.dumps({
        "family": "csm", "voices": ["0", "1"], "suffix_token_ids": [SPECIALS["<|eot_id|>"]], "sampling": sampling,
        **({"codec": codec} if codec else {}),
    }))
    return path
