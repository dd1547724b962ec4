"""The model registry: decoder variant (ModelConfig.decoder, from config.json's `architectures`
through runner.config.SUPPORTED_ARCHITECTURES, the one list of accepted names) -> the class
that implements it.

The loader builds `model_class_for(cfg)`; a new architecture adds its name to
SUPPORTED_ARCHITECTURES and its class here. Llama, Qwen2 and Qwen3 share one decoder
(runner/models/llama.py), its variants (biases, q/k norms, tied head) fixed at construction from
the ModelConfig.
"""

from __future__ import annotations

from runner.config import ModelConfig
from runner.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def model_class_for(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The class of a parsed config (ModelConfig.from_dict already refused other architectures)."""
    return MODEL_REGISTRY[cfg.decoder]
