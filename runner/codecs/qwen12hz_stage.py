"""Qwen3-TTS's 12 Hz codec as a codec stage: MimiCodecStage's scheduling (chunks, batched
launches, CUDA graphs, in-flight bound, priming with a reference's frames) over the 12 Hz decoder
(runner/codecs/qwen12hz.py), and its tokenizer's MimiModel encoder for reference clips.

MimiCodecConfig serves as is: `path` is the tokenizer folder (or the model folder holding its
speech_tokenizer/), `num_codebooks` None or the codec's 16 (it decodes whole frames only).
"""

from __future__ import annotations

import torch
from transformers import MimiModel

from runner.codecs.config import CodecError
from runner.codecs.mimi_stage import MimiCodecConfig, MimiCodecStage
from runner.codecs.qwen12hz import Qwen12HzStreamingDecoder, load_qwen12hz_decoder
from runner.codecs.qwen12hz_loader import load_encoder


class Qwen12HzCodecStage(MimiCodecStage):
    """Streams 24 kHz PCM for many requests from frames of 16 codes (Qwen3-TTS's talker frames)."""

    def __init__(self, cfg: MimiCodecConfig, device: torch.device, dtype: torch.dtype = torch.float32,
                 tuning: str = "auto") -> None:
        self._encoder_model: MimiModel | None = None  # _encoder(): loaded at the first encode
        super().__init__(cfg, device, dtype, tuning)

    def _load_decoder(self, cfg: MimiCodecConfig, device: torch.device, dtype: torch.dtype,
                      model) -> Qwen12HzStreamingDecoder:
        if model is not None:
            raise CodecError("Qwen12HzCodecStage: loads its codec from MimiCodecConfig.path, not a model object")
        decoder = load_qwen12hz_decoder(cfg.path, device, dtype, max_streams=cfg.max_streams)
        if cfg.num_codebooks not in (None, decoder.num_codebooks):
            raise CodecError(f"MimiCodecConfig.num_codebooks: the 12 Hz codec decodes frames of "
                             f"{decoder.num_codebooks} codes, got {cfg.num_codebooks}")
        return decoder

    def _encoder(self) -> MimiModel:
        """Loaded at the first encode: a stage that only decodes never holds it."""
        if self._encoder_model is None:
            self._encoder_model = load_encoder(self.cfg.path, self.decoder.device, self.decoder.dtype)
        return self._encoder_model
