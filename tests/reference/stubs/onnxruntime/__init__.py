"""Stub of onnxruntime for the Qwen3-TTS reference environment: qwen_tts imports it at package
import for the 25 Hz tokenizer only (tokenizer_25hz/vq/speech_vq.py), which the 12 Hz models
never run; the real wheel is 78 MB of the reference install for nothing."""


class InferenceSession:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("onnxruntime stub (tests/reference/stubs): the 25 Hz tokenizer is not supported")


class SessionOptions:
    pass
