"""Golden files for Qwen3-TTS's 12 Hz codec (tokenizer v2), from the qwen-tts 0.1.1 reference.

Runs only in the reference environment (transformers 4.57.3 + qwen_tts, torchaudio stubbed; see
tests/reference/build_qwen3_tts_golden.sh), never under pytest. Usage: python qwen3_tts_codec_golden.py OUT

Writes into OUT (tests/reference/build_qwen3_tts_golden.sh: .cache/qwen3tts-golden/qwen3_tts_codec_golden/):
  speech_tokenizer/   a tiny random tokenizer v2 (save_pretrained + the feature extractor's config)
  decode.npz          codes_<n> (n, K) int64 and pcm_<n> (n * 1920,) float32: the reference
                      `Qwen3TTSTokenizer.decode` of each sequence alone, n frames (n <= 300: the
                      reference decodes past 300 frames in chunks, see docs/qwen3_tts.md §3);
                      pcm64_<n> float64: the same decode with the model in float64
  encode.npz          wav (24000,) float32 at 24 kHz and codes (frames, K) int64: `Qwen3TTSTokenizer.encode`

The tiny codec keeps the real one's structure (16 codebooks: 1 semantic + 15 acoustic, GQA in
the decoder transformer, a window of 4 frames so 300 frames cross it many times, 1920 samples a
frame) at widths of a few dozen; every parameter that initialises to a neutral value (codebook
sums and usages, norms, layer scales, ConvNeXt gammas, Snake alpha/beta) is randomised so that
the decode depends on all of them. The residual branches are scaled down and the output kept
well inside the clamp so the signal stays O(1) through the vocoder: at unit gain it grows ~64-fold
and float32 rounding with it, and the reference's own float32 decode was then ~6 int16 LSB from its
float64 one (now ~3e-6 of a 0.2-std signal), leaving no room for a 1 LSB test.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from transformers import EncodecFeatureExtractor, MimiConfig

from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model
from qwen_tts.inference.qwen3_tts_tokenizer import Qwen3TTSTokenizer

K = 16  # codebooks (as the real codec)
CB = 64  # codes per codebook (real: 2048)
SEED = 1234
DECODE_FRAMES = (1, 5, 37, 120, 300)  # 300: the reference's single-chunk limit


def tokenizer_config() -> Qwen3TTSTokenizerV2Config:
    enc = MimiConfig(hidden_size=32, num_filters=4, num_residual_layers=1, upsampling_ratios=[8, 6, 5, 4],
                     codebook_size=CB, codebook_dim=16, num_quantizers=K, vector_quantization_hidden_dimension=16,
                     upsample_groups=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
                     num_key_value_heads=2, sliding_window=6, max_position_embeddings=4096, use_conv_shortcut=False)
    dec = dict(codebook_size=CB, hidden_size=32, latent_dim=24, codebook_dim=16, max_position_embeddings=1024,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4, intermediate_size=48,
               num_hidden_layers=2, num_quantizers=K, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
               decoder_dim=32, layer_scale_initial_scale=0.5)
    return Qwen3TTSTokenizerV2Config(encoder_config=enc.to_dict(), decoder_config=dec, encoder_valid_num_quantizers=K)


@torch.no_grad()
def randomise(model: Qwen3TTSTokenizerV2Model) -> None:
    """Non-neutral values everywhere, and unit-scale activations (the 0.02 init decodes to ~0)."""
    for name, p in model.named_parameters():
        if name.endswith("embedding_sum"):
            p.copy_(torch.randn(p.shape))
        elif name.endswith("cluster_usage"):
            p.copy_(torch.rand(p.shape) * 1.5 + 0.5)
    for name, b in model.named_buffers():
        if name.endswith("embed_sum"):
            b.copy_(torch.randn(b.shape))
    for name, p in model.decoder.named_parameters():
        if name.endswith((".alpha", ".beta")):  # SnakeBeta: exp() of these
            p.copy_(0.1 * torch.randn(p.shape))
        elif name.endswith(".gamma") or name.endswith(".scale"):  # ConvNeXt gamma, layer scales
            p.copy_(0.5 + 0.2 * torch.randn(p.shape))
        elif name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape))
        elif name.endswith(".bias"):
            p.copy_(0.05 * torch.randn(p.shape))
    for m in model.decoder.modules():
        if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d, torch.nn.Linear)):
            fan_in = m.weight.shape[1] * (m.weight.shape[2] if m.weight.dim() == 3 else 1)
            m.weight.normal_(0.0, fan_in ** -0.5)
    for name, m in model.decoder.named_modules():  # residual branches at 0.3: the signal stays O(1) through
        if name.endswith(".conv2.conv"):  # 12 residual units (at unit gain it grows 2**6-fold, and fp32 rounding with it)
            m.weight.mul_(0.3)
    last = model.decoder.decoder[-1].conv
    for _ in range(4):  # the decode clamps to [-1, 1]: rescale until little is clipped
        probe = model.decoder(torch.randint(0, CB, (1, K, 32))).std()
        last.weight.mul_(0.2 / probe)
        last.bias.mul_(0.2 / probe)


def main(out: str) -> None:
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    tok_dir = os.path.join(out, "speech_tokenizer")
    model = Qwen3TTSTokenizerV2Model(tokenizer_config()).eval()
    randomise(model)
    model.save_pretrained(tok_dir)
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000).save_pretrained(tok_dir)
    tok = Qwen3TTSTokenizer.from_pretrained(tok_dir)  # reloaded: the golden PCM comes from the saved weights

    decoded = {}
    for n in DECODE_FRAMES:
        codes = rng.integers(0, CB, size=(n, K), dtype=np.int64)
        wavs, sr = tok.decode({"audio_codes": [codes]})
        assert sr == 24000 and wavs[0].shape == (n * 1920,), (sr, wavs[0].shape)
        clipped = float(np.mean(np.abs(wavs[0]) >= 1.0))
        assert clipped < 0.01 and wavs[0].std() > 0.05, (n, clipped, wavs[0].std())  # a real signal
        decoded[f"codes_{n}"] = codes
        decoded[f"pcm_{n}"] = wavs[0].astype(np.float32)
    tok.model.double()  # the same decodes in float64: what an exact port matches to ~1e-14
    for n in DECODE_FRAMES:  # the model's decode: the wrapper would round its output to float32
        with torch.inference_mode():
            wav = tok.model.decode(torch.from_numpy(decoded[f"codes_{n}"])[None], return_dict=True).audio_values[0]
        decoded[f"pcm64_{n}"] = wav.numpy()
    tok.model.float()
    np.savez(os.path.join(out, "decode.npz"), **decoded)

    t = np.arange(24000) / 24000.0
    wav = (0.3 * np.sin(2 * np.pi * 220.0 * t) + 0.05 * rng.standard_normal(24000)).astype(np.float32)
    codes = tok.encode(wav, sr=24000).audio_codes[0].cpu().numpy().astype(np.int64)  # (frames, K)
    assert codes.shape == (13, K), codes.shape  # ceil(24000 / 1920)
    np.savez(os.path.join(out, "encode.npz"), wav=wav, codes=codes)
    print(f"codec12hz golden: {out} (decode {list(DECODE_FRAMES)} frames, encode {codes.shape})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: qwen3_tts_codec_golden.py OUT")
    main(sys.argv[1])
