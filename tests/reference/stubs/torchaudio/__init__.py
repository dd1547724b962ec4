"""Stub of torchaudio for the Qwen3-TTS reference environment (tests/reference/build_qwen3_tts_golden.sh).

qwen_tts imports `torchaudio.compliance.kaldi` at package import, only for its 25 Hz tokenizer
(tokenizer_25hz/vq/speech_vq.py), which the 12 Hz models never run; the registry's torchaudio
wheel does not import beside the local CPU torch."""
