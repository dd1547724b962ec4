"""The layers' backend registry: which attention, ops and sampling backend a device gets.

Chosen once, at construction (of the model, the sampler, the slot state), never per call:

    make_attention(runner, device) -> AttentionBackend   TorchPagedAttention | TritonPagedAttention
    make_ops(runner, device)       -> OpsBackend         TorchOps | TritonOps
    make_backends(runner)          -> (attention, ops) for runner.torch_device
    make_sampling(name, device, tuning) -> SamplingBackend    TorchSampling | TritonSampling
    pick_sampling_backend(device, name) -> "torch" | "triton"   (resolves "auto")

Triton on CUDA, torch elsewhere. Each factory imports its backend's module when called, so
importing runner.layers never imports triton (the CPU torch wheel does not bring it) and the
torch modules never import runner/kernels. The contracts are in runner/layers/base.py.

Tuning: each factory looks up the device's tuning tables once, `load_tables(device, tuning)`
(runner/kernels/tuning; `tuning` is RunnerConfig.tuning: "auto" the device's table, "none" the
generic one: cuBLAS for every GEMM, the always-valid attention and sampling launches), and hands
the Triton backend its part: TritonOps(tables=.linear), TritonPagedAttention(tuning=.attention),
TritonSampling(tuning=.sampling). The backends use what they were given and look nothing up per
call. `tables=` replaces the lookup (tests, benchmark variants).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runner.config import RunnerConfig
from runner.kernels.tuning import Tables, load_tables
from runner.layers.base import AttentionBackend, OpsBackend, SamplingBackend

Device = torch.device | str


def _torch_attention(runner: RunnerConfig, device: torch.device, tables: Tables) -> AttentionBackend:
    from runner.layers.attention import TorchPagedAttention

    return TorchPagedAttention()


def _triton_attention(runner: RunnerConfig, device: torch.device, tables: Tables) -> AttentionBackend:
    # needs triton, present with CUDA torch
    from runner.kernels.pdl import pdl_available
    from runner.layers.triton_attention import TritonPagedAttention

    return TritonPagedAttention(pdl=runner.pdl and pdl_available(device), rope_in_attention=runner.rope_in_attention,
                                prefetch=runner.attention_prefetch, tuning=tables.attention)


def _torch_ops(runner: RunnerConfig, device: torch.device, tables: Tables) -> OpsBackend:
    from runner.layers.ops import TorchOps

    return TorchOps()


def _triton_ops(runner: RunnerConfig, device: torch.device, tables: Tables) -> OpsBackend:
    # `skinny_linear`: decode-sized 16-bit GEMMs in Triton; `split_k`: o_proj / down hand split-K
    # partials to the add + RMSNorm; `norm_fold`: the post-attention RMSNorm inside gate_up;
    # `qkv_rope`: RoPE and the KV write in the qkv GEMM's epilogue; `pdl`: programmatic
    # dependent launch where the GPU has it (RunnerConfig says more)
    from runner.kernels.pdl import pdl_available
    from runner.layers.triton_ops import TritonOps

    return TritonOps(pdl=runner.pdl and pdl_available(device), skinny_linear=runner.skinny_linear,
                     split_k=runner.split_k, norm_fold=runner.norm_fold, qkv_rope=runner.qkv_rope,
                     depth_step=runner.depth_step, depth=tables.depth, tables=tables.linear)


def _torch_sampling(device: torch.device, tables: Tables) -> SamplingBackend:
    from runner.layers.sampling_torch import TorchSampling

    return TorchSampling(device)


def _triton_sampling(device: torch.device, tables: Tables) -> SamplingBackend:
    from runner.layers.sampling_triton import TritonSampling

    return TritonSampling(device, tables.sampling)


ATTENTION_BACKENDS: dict[str, Callable[[RunnerConfig, torch.device, Tables], AttentionBackend]] = {
    "torch": _torch_attention,
    "triton": _triton_attention,
}
OPS_BACKENDS: dict[str, Callable[[RunnerConfig, torch.device, Tables], OpsBackend]] = {
    "torch": _torch_ops,
    "triton": _triton_ops,
}
SAMPLING_BACKENDS: dict[str, Callable[[torch.device, Tables], SamplingBackend]] = {
    "torch": _torch_sampling,
    "triton": _triton_sampling,
}
SAMPLER_CHOICES = ("auto", *SAMPLING_BACKENDS)


def layer_backend(device: Device) -> str:
    """The attention / ops backend of a device: "triton" on CUDA, "torch" elsewhere."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


def _resolve(runner: RunnerConfig | None, device: Device | None,
             tables: Tables | None) -> tuple[RunnerConfig, torch.device, Tables]:
    runner = runner if runner is not None else RunnerConfig()
    dev = torch.device(device) if device is not None else runner.torch_device
    return runner, dev, tables if tables is not None else load_tables(dev, runner.tuning)


def make_attention(runner: RunnerConfig | None = None, device: Device | None = None,
                   tables: Tables | None = None) -> AttentionBackend:
    """The attention backend for `device` (default: runner.torch_device) with the runner's
    kernel options and tuning (default: RunnerConfig's); `tables` replaces the lookup."""
    runner, dev, tables = _resolve(runner, device, tables)
    return ATTENTION_BACKENDS[layer_backend(dev)](runner, dev, tables)


def make_ops(runner: RunnerConfig | None = None, device: Device | None = None,
             tables: Tables | None = None) -> OpsBackend:
    """The ops backend for `device` (default: runner.torch_device) with the runner's kernel
    options and tuning (default: RunnerConfig's); `tables` replaces the lookup."""
    runner, dev, tables = _resolve(runner, device, tables)
    return OPS_BACKENDS[layer_backend(dev)](runner, dev, tables)


def make_backends(runner: RunnerConfig, tables: Tables | None = None) -> tuple[AttentionBackend, OpsBackend]:
    """(attention backend, ops) for the runner's device, kernel options and tuning, once per
    model: one table lookup for both (`tables` replaces it)."""
    runner, dev, tables = _resolve(runner, None, tables)
    return make_attention(runner, dev, tables), make_ops(runner, dev, tables)


def pick_sampling_backend(device: Device, backend: str) -> str:
    """'torch' or 'triton'. auto = torch off CUDA, triton on CUDA when its kernels import. (The
    engine passes RunnerConfig.sampler_backend, which OMNISTREAM_SAMPLER_BACKEND sets for A/B runs.)"""
    if backend not in SAMPLER_CHOICES:
        raise ValueError(f"sampler backend must be one of {SAMPLER_CHOICES}, got {backend!r}")
    if backend == "auto":
        if torch.device(device).type != "cuda":
            return "torch"
        try:
            import runner.kernels.sampling  # noqa: F401  (triton present: CUDA torch brings it)
        except ImportError:
            return "torch"
        return "triton"
    return backend


def make_sampling(backend: str, device: Device, tuning: str = "auto", tables: Tables | None = None) -> SamplingBackend:
    """The sampling backend named `backend` ('torch' or 'triton'; pick_sampling_backend resolves
    'auto') on `device`, with the launch configuration of `load_tables(device, tuning)`
    (RunnerConfig.tuning); `tables` replaces the lookup."""
    if backend not in SAMPLING_BACKENDS:
        raise ValueError(f"sampling backend must be one of {tuple(SAMPLING_BACKENDS)}, got {backend!r}")
    dev = torch.device(device)
    return SAMPLING_BACKENDS[backend](dev, tables if tables is not None else load_tables(dev, tuning))
