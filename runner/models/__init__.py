"""The model registry: Hugging Face `architectures` name -> the class that implements it.

The loader builds `model_class_for(cfg)`; a new family adds its class here. Llama, Qwen2 and
Qwen3 share one decoder (runner/models/llama.py), its variants (biases, q/k norms, tied head)
fixed at construction from the ModelConfig.
"""

from __future__ import annotations

from collections.abc import Iterable

from runner.config import SUPPORTED_ARCHITECTURES, ModelConfig
from runner.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


class UnsupportedArchitecture(ValueError):
    """No class in MODEL_REGISTRY implements any of the checkpoint's architectures."""


def model_class(architectures: Iterable[str]) -> type[LlamaForCausalLM]:
    """The class of the first of a config.json's `architectures` that the registry knows."""
    archs = list(architectures)
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise UnsupportedArchitecture(f"model.architectures: {archs!r} is not supported; supported: {sorted(MODEL_REGISTRY)}")


def model_class_for(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The class of a parsed config. ModelConfig keeps the family runner.config matched, not
    the architecture name, so the names of that family are looked up here."""
    return model_class(arch for arch, family in SUPPORTED_ARCHITECTURES.items() if family == cfg.family)
