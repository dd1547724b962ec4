"""Golden files for Qwen3-TTS Base's speaker (x-vector) encoder, from the qwen-tts 0.1.1 reference.

Runs only in the reference environment (transformers 4.57.3 + qwen_tts, torchaudio and
onnxruntime stubbed; see tests/reference/build_qwen3_tts_golden.sh), never under pytest.
Usage: python qwen3_tts_speaker_golden.py OUT

A tiny Base model (qwen3_tts_golden.py's `config("base", ...)`) whose speaker encoder is
randomised (every conv weight and bias, at a scale that keeps the activations O(1)), saved as a
checkpoint folder, and the x-vectors that `Qwen3TTSForConditionalGeneration.extract_speaker_embedding`
(the wrapper's create_voice_clone_prompt calls it on 24 kHz audio) gives for a few clips.

Writes OUT/:
  checkpoint/     the model folder (config.json with speaker_encoder_config, model.safetensors)
  speaker.npz     mel_filters [128, 513] (librosa.filters.mel, slaney, 0-12 kHz: what
                  `mel_spectrogram` multiplies by), and per clip i: wav_<i> float32 at 24 kHz,
                  mel_<i> [frames, 128] (`mel_spectrogram`, as extract_speaker_embedding calls
                  it), xvector_<i> [enc_dim] float32
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from librosa.filters import mel as librosa_mel

from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen3_tts_golden import config, save  # noqa: E402  (the talker goldens' tiny Base layout)

SEED = 21
SR = 24000
CLIP_SECONDS = (0.37, 1.3, 3.05)  # frames: 33, 121, 285 (hop 256): short, and across the kernels' context


def clip(seconds: float, gen: torch.Generator) -> np.ndarray:
    """A voiced-like clip: a few harmonics with a moving pitch, an envelope, a little noise."""
    t = torch.arange(int(seconds * SR), dtype=torch.float64) / SR
    f0 = 110 + 60 * torch.rand(1, generator=gen, dtype=torch.float64) + 20 * torch.sin(2 * torch.pi * 1.7 * t)
    phase = 2 * torch.pi * torch.cumsum(f0, 0) / SR
    wav = sum(torch.sin(k * phase) / k for k in range(1, 6))
    wav = wav * (0.5 + 0.5 * torch.sin(2 * torch.pi * 3.1 * t).abs())
    wav = wav + 0.02 * torch.randn(len(t), generator=gen, dtype=torch.float64)
    return (0.8 * wav / wav.abs().max()).numpy().astype(np.float32)


@torch.no_grad()
def randomise_speaker_encoder(model: Qwen3TTSForConditionalGeneration, gen: torch.Generator) -> None:
    for name, p in model.speaker_encoder.named_parameters():
        if p.dim() == 1:
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        else:  # conv [out, in, k]: unit gain
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[1] * p.shape[2]) ** -0.5)


def main(out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = Qwen3TTSForConditionalGeneration(config("base", 32)).eval()
    gen = torch.Generator().manual_seed(SEED)
    randomise_speaker_encoder(model, gen)
    assert model.speaker_encoder_sample_rate == SR
    save(model, os.path.join(out, "checkpoint"))
    arrays = dict(mel_filters=librosa_mel(sr=SR, n_fft=1024, n_mels=128, fmin=0, fmax=12000))
    for i, seconds in enumerate(CLIP_SECONDS):
        wav = clip(seconds, gen)
        mel = mel_spectrogram(torch.from_numpy(wav)[None], n_fft=1024, num_mels=128, sampling_rate=SR, hop_size=256,
                              win_size=1024, fmin=0, fmax=12000).transpose(1, 2)[0]
        xvector = model.extract_speaker_embedding(wav, SR)
        assert xvector.shape == (model.config.speaker_encoder_config.enc_dim,), xvector.shape
        assert xvector.std() > 0.05, "a degenerate x-vector would test nothing"
        arrays.update({f"wav_{i}": wav, f"mel_{i}": mel.numpy(), f"xvector_{i}": xvector.float().numpy()})
        print(f"clip {i}: {len(wav)} samples, mel {tuple(mel.shape)}, x-vector std {xvector.std():.3f}")
    np.savez(os.path.join(out, "speaker.npz"), **arrays)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT")
    main(sys.argv[1])
