"""The model-family seam: what the engine asks of a model family, and nothing more.

A family says how a step's sampled ids become audio: which ids a row may sample next (a logits
constraint), which id ends speech, and which codec stage turns codes into PCM. A step yields,
per row, a frame of `codes_per_frame` codes (Orpheus: 1 token per step; a multi-codebook talker
K). The engine calls these at construction and per request, never per step on the host.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import torch

from streaming.profile import ModelProfile


class LogitsConstraint(Protocol):
    """A model-declared rule on which ids may come next, as a per-row window of allowed ids.

    vocab_span: [lo, hi), contiguous ids holding every window; the runner computes only those
    logits for constrained rows. out_index: index among the request's outputs of the token
    being sampled ([R] int64, on the device), true even in async mode. gather_window gives the
    window's logits ([R, W], -inf on ids not allowed) from logits of ids [base, base + N);
    window_ids maps sampled window columns back to token ids. The sampler's filters and race
    then run over W columns instead of the vocabulary."""

    @property
    def vocab_span(self) -> tuple[int, int]: ...

    def gather_window(self, logits: torch.Tensor, out_index: torch.Tensor, base: int = 0) -> torch.Tensor: ...

    def window_ids(self, cols: torch.Tensor, out_index: torch.Tensor) -> torch.Tensor: ...


class CodecStageLike(Protocol):
    """What the engine calls on a family's codec stage (runner/codecs/stage.py is the SNAC one)."""

    sample_rate: int

    def open(self, key: object, seed: int | None = None) -> None: ...
    def push_many(self, items: list[tuple[object, int]]) -> None: ...
    def close(self, key: object) -> None: ...
    def abort(self, key: object) -> None: ...
    def step(self, wait: bool = False) -> dict: ...
    def __len__(self) -> int: ...


class ModelFamily(ABC):
    """One family of models, built from the folder's profile (streaming/profile.py)."""

    name: ClassVar[str]
    codes_per_frame: ClassVar[int] = 1  # codes a row yields per step

    def __init__(self, profile: ModelProfile):
        self.profile = profile

    @property
    def speaks(self) -> bool:
        """Whether requests may ask for audio (the profile's rule: a speech spec and a codec)."""
        return self.profile.speaks

    @abstractmethod
    def build_codec(self, device: torch.device, dtype: torch.dtype, tuning: str = "auto") -> CodecStageLike | None:
        """The codec stage of audio requests, or None when the folder names no codec. tuning:
        RunnerConfig.tuning, the codec kernels' tuning tables ("auto" | "none")."""

    @abstractmethod
    def logits_constraint(self, backend: str) -> LogitsConstraint | None:
        """The rule audio rows sample under (backend: 'torch' or 'triton'), or None."""

    @abstractmethod
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an audio request (added to its sampling's stop ids)."""
