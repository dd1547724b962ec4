"""The model registry: decoder variant (ModelConfig.decoder, from config.json's `architectures`
through runner.config.SUPPORTED_ARCHITECTURES, the one list of accepted names) -> the class
that implements it.

The loader builds `model_class_for(cfg)`; a new architecture adds its name to
SUPPORTED_ARCHITECTURES and its class here. Llama, Qwen2 and Qwen3 share one decoder
(runner/models/llama.py), its variants (biases, q/k norms, tied head) fixed at construction from
the ModelConfig.
"""

from __future__ import annotations

from torch import nn

from runner.config import ModelConfig
from runner.models.csm import CsmModel
from runner.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    # two decoders and a frame layout (runner/models/csm_config.py): built and loaded by its
    # family (runner/families/csm.py, runner/models/csm_loader.py), not by loader.load_model
    "csm": CsmModel,
}


def model_class_for(cfg: ModelConfig) -> type[nn.Module]:
    """The class of a parsed config (ModelConfig.from_dict already refused other architectures)."""
    return MODEL_REGISTRY[cfg.decoder]
