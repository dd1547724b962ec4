"""Qwen3-TTS Base's speaker encoder against qwen-tts 0.1.1 (tests/reference/qwen3_tts_speaker_golden.py):
the mel filters, the log-mel front end and the x-vectors of clips of several lengths, loaded
from the checkpoint folder through load_speaker_encoder."""

import json

import numpy as np
import pytest
import torch

from runner.config import ConfigError
from runner.models.loader import LoadError
from runner.models.qwen3_tts_speaker import SpeakerEncoder, SpeakerEncoderConfig, load_speaker_encoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def golden(qwen3_tts_golden):
    folder = qwen3_tts_golden("qwen3_tts_speaker_golden")
    return folder, dict(np.load(folder / "speaker.npz"))


@pytest.fixture(scope="module")
def encoder(golden):
    folder, _ = golden
    ckpt = folder / "checkpoint"
    return load_speaker_encoder(ckpt, json.loads((ckpt / "config.json").read_text()))


def clips(g: dict) -> list[int]:
    return sorted(int(k.split("_")[1]) for k in g if k.startswith("wav_"))


def test_mel_filters_equal_librosa(encoder, golden):
    _, g = golden
    np.testing.assert_allclose(encoder.mel_filters.numpy(), g["mel_filters"], rtol=1e-5, atol=1e-8)


def test_log_mel_and_x_vectors_equal_the_reference(encoder, golden):
    _, g = golden
    assert len(clips(g)) == 3
    for i in clips(g):
        wav = torch.from_numpy(g[f"wav_{i}"])
        mel = encoder.log_mel(wav)
        assert mel.shape == g[f"mel_{i}"].shape
        np.testing.assert_allclose(mel.numpy(), g[f"mel_{i}"], atol=2e-4)
        xvec = encoder.embed(g[f"wav_{i}"])
        np.testing.assert_allclose(xvec, g[f"xvector_{i}"], atol=1e-4, rtol=1e-4)
    # distinct clips, distinct vectors (else the comparison above proves little)
    assert not np.allclose(g["xvector_0"], g["xvector_2"], atol=0.1)


def test_int16_input_is_scaled_to_unit_range(encoder, golden):
    _, g = golden
    wav = g["wav_1"]
    pcm = np.round(wav * 32767).astype(np.int16)
    np.testing.assert_allclose(encoder.embed(pcm), g["xvector_1"], atol=5e-3)


def test_too_short_a_clip_is_refused(encoder):
    with pytest.raises(ValueError, match="audio: 100 samples is too short"):
        encoder.embed(np.zeros(100, np.int16))


def test_config_and_load_errors(golden, tmp_path):
    folder, _ = golden
    raw = json.loads((folder / "checkpoint" / "config.json").read_text())
    with pytest.raises(ConfigError, match="no speaker_encoder_config"):
        load_speaker_encoder(folder / "checkpoint", {})
    with pytest.raises(ConfigError, match="enc_kernel_sizes"):
        SpeakerEncoderConfig.from_dict(dict(raw["speaker_encoder_config"], enc_kernel_sizes=[5, 3]))
    wider = dict(raw, speaker_encoder_config=dict(raw["speaker_encoder_config"], enc_dim=80))
    with pytest.raises(LoadError, match=r"speaker_encoder\.fc\.(weight|bias) is \(64,.*\), expected \(80,"):
        load_speaker_encoder(folder / "checkpoint", wider)


def test_defaults_are_the_released_shape():
    enc = SpeakerEncoder(SpeakerEncoderConfig(enc_dim=2048))
    assert enc(torch.zeros(1, 40, 128)).shape == (1, 2048)
