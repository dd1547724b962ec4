"""Stub: the 25 Hz tokenizer's fbank, never called on the 12 Hz path."""


def fbank(*args, **kwargs):
    raise NotImplementedError("torchaudio stub (tests/reference/stubs): the 25 Hz tokenizer is not supported")
