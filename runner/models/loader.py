"""Load a Hugging Face Llama-family checkpoint (safetensors) into `LlamaForCausalLM`.

Plan first, then allocate: every checkpoint tensor is matched to a destination (a parameter,
or a row range of a fused qkv_proj / gate_up_proj parameter) and its shape is checked from
the safetensors headers alone, so a bad folder fails with a message naming the tensor before
any device memory is taken. Then the model is allocated once, uninitialised, on the target
device, and each tensor is read (memory-mapped), cast and copied into place one at a time:
peak memory is the model plus one tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from runner.config import ModelConfig
from runner.layers.base import AttentionBackend, OpsBackend
from runner.models import model_class_for
from runner.models.llama import LlamaForCausalLM, build_empty_model, o_proj_has_bias

# Checkpoint entries that carry no weights we need (recomputed or redundant).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LoadError(ValueError):
    """The checkpoint does not match the model config; the message names the tensor."""


@dataclass(frozen=True)
class _Target:
    param: str  # our parameter name
    row_start: int  # destination rows [row_start, row_start + shape[0]) of a fused param
    shape: tuple[int, ...]  # expected checkpoint shape


def expected_tensors(cfg: ModelConfig) -> dict[str, _Target]:
    """HF tensor name -> where it goes in our model, with the shape it must have."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    out: dict[str, _Target] = {
        "model.embed_tokens.weight": _Target("embed_tokens.weight", 0, (cfg.vocab_size, h)),
        "model.norm.weight": _Target("norm.weight", 0, (h,)),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = _Target("lm_head.weight", 0, (cfg.vocab_size, h))
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        qkv = dst + "self_attn.qkv_proj."
        out[src + "self_attn.q_proj.weight"] = _Target(qkv + "weight", 0, (q, h))
        out[src + "self_attn.k_proj.weight"] = _Target(qkv + "weight", q, (kv, h))
        out[src + "self_attn.v_proj.weight"] = _Target(qkv + "weight", q + kv, (kv, h))
        if cfg.attention_bias:
            out[src + "self_attn.q_proj.bias"] = _Target(qkv + "bias", 0, (q,))
            out[src + "self_attn.k_proj.bias"] = _Target(qkv + "bias", q, (kv,))
            out[src + "self_attn.v_proj.bias"] = _Target(qkv + "bias", q + kv, (kv,))
        out[src + "self_attn.o_proj.weight"] = _Target(dst + "self_attn.o_proj.weight", 0, (h, q))
        if o_proj_has_bias(cfg):
            out[src + "self_attn.o_proj.bias"] = _Target(dst + "self_attn.o_proj.bias", 0, (h,))
        if cfg.qk_norm:
            out[src + "self_attn.q_norm.weight"] = _Target(dst + "self_attn.q_norm.weight", 0, (d,))
            out[src + "self_attn.k_norm.weight"] = _Target(dst + "self_attn.k_norm.weight", 0, (d,))
        gate_up = dst + "mlp.gate_up_proj.weight"
        out[src + "mlp.gate_proj.weight"] = _Target(gate_up, 0, (inter, h))
        out[src + "mlp.up_proj.weight"] = _Target(gate_up, inter, (inter, h))
        out[src + "mlp.down_proj.weight"] = _Target(dst + "mlp.down_proj.weight", 0, (h, inter))
        out[src + "input_layernorm.weight"] = _Target(dst + "input_layernorm.weight", 0, (h,))
        out[src + "post_attention_layernorm.weight"] = _Target(dst + "post_attention_layernorm.weight", 0, (h,))
    return out


def _check_unsupported_features(folder: Path) -> None:
    # ModelConfig keeps only what the model implements; refuse configs that would load cleanly
    # but compute something else.
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        return
    raw = json.loads(cfg_file.read_text())
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise LoadError(f"model config: hidden_act {act!r} is not supported (silu only)")
    if raw.get("use_sliding_window"):
        raise LoadError("model config: use_sliding_window=true is not supported")


def find_safetensors(folder: str | Path) -> list[Path]:
    """The checkpoint's files: those named by model.safetensors.index.json, else every *.safetensors."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [folder / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise LoadError(f"model: {index.name} lists shard(s) {absent} that are not in {str(folder)!r}")
        if files:
            return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LoadError(f"model: no *.safetensors files found in {str(folder)!r}")
    return files


def stack_tensors(cfg: ModelConfig, src_prefix: str, dst_prefix: str) -> dict[str, _Target]:
    """expected_tensors' decoder layers and final norm of one stack inside a larger checkpoint
    (CSM's backbone and depth decoder, Qwen3-TTS's talker and code predictor), renamed: stored
    under src_prefix + "layers...", filling dst_prefix + our parameter."""
    out = {}
    for name, t in expected_tensors(cfg).items():
        if name.startswith("model.layers.") or name == "model.norm.weight":
            out[src_prefix + name[len("model."):]] = _Target(dst_prefix + t.param, t.row_start, t.shape)
    return out


def plan_tensors(expected: dict[str, _Target], files: list[Path], ignored: Callable[[str], bool],
                 where: str, aliases: dict[str, str] | None = None) -> dict[str, tuple[Path, _Target, str]]:
    """Match checkpoint tensors to destinations from the headers only: expected name -> (file,
    destination, the name it is stored under). `ignored`: stored names that carry nothing we
    load. `aliases` {stored name: expected name}: a tensor a checkpoint may store under either
    name (stored under both, the expected name's copy is used). LoadError names the tensor and
    its file on any mismatch, and lists what is missing (in `where`) or unexpected."""
    aliases = aliases or {}
    plan: dict[str, tuple[Path, _Target]] = {}
    stored: dict[str, str] = {}  # plan key -> the name it is stored under, where they differ
    unexpected: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if ignored(name):
                    continue
                key = aliases.get(name, name)
                target = expected.get(key)
                if target is None:
                    unexpected.append(name)
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != target.shape:
                    raise LoadError(f"tensor {name!r} in {path.name}: expected shape {target.shape}, got {shape}")
                if key in plan:
                    if key != name or stored.get(key, key) != key:  # one table under both names
                        continue
                    raise LoadError(f"tensor {name!r}: present in both {plan[key][0].name} and {path.name}")
                plan[key] = (path, target)
                if key != name:
                    stored[key] = name
    if unexpected:
        raise LoadError(f"unexpected tensor(s) in checkpoint: {_names(unexpected)}")
    missing = [n for n in expected if n not in plan]
    if missing:
        either = {key: name for name, key in aliases.items()}
        missing = [f"{n} (or {either[n]})" if n in either else n for n in missing]
        raise LoadError(f"missing tensor(s) in checkpoint{where}: {_names(missing)}")
    return {key: (path, target, stored.get(key, key)) for key, (path, target) in plan.items()}


def plan_load(cfg: ModelConfig, files: list[Path]) -> dict[str, tuple[Path, _Target, str]]:
    """Match checkpoint tensors to destinations from headers only; raise LoadError on any mismatch."""
    def ignored(name: str) -> bool:
        # some tied checkpoints still store the (identical) head; the embedding is the one we use
        return name.endswith(_IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and name == "lm_head.weight")

    return plan_tensors(expected_tensors(cfg), files, ignored, "")


def _check_coverage(plan: dict[str, tuple[Path, _Target]], params: dict[str, torch.Tensor]) -> None:
    # Guards against the model and expected_tensors() drifting apart: every parameter must be
    # filled completely, each fused one by row ranges that add up to its first dim.
    rows: dict[str, int] = {}
    for _, target in plan.values():
        rows[target.param] = rows.get(target.param, 0) + target.shape[0]
        if tuple(params[target.param].shape[1:]) != target.shape[1:]:
            raise LoadError(f"parameter {target.param!r}: trailing shape does not match {target.shape}")
    for pname, p in params.items():
        if rows.get(pname) != p.shape[0]:
            raise LoadError(f"parameter {pname!r}: checkpoint fills {rows.get(pname, 0)} of {p.shape[0]} rows")


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


@torch.no_grad()
def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, attn: AttentionBackend | None = None,
               ops: OpsBackend | None = None) -> LlamaForCausalLM:
    """Build the model for `cfg` (its class from the registry, runner/models/__init__.py) on
    `device` in `dtype` and fill it from the safetensors in cfg.path."""
    _check_unsupported_features(Path(cfg.path))
    plan = plan_load(cfg, find_safetensors(cfg.path))
    model = build_empty_model(cfg, device, dtype, attn, ops, model_cls=model_class_for(cfg))
    fill_planned(model, plan)
    return model


def fill_planned(model: torch.nn.Module, plan: dict[str, tuple[Path, _Target, str]]) -> None:
    """Fill the model's parameters from a plan_tensors plan, after checking that it fills every
    parameter completely (the Llama, CSM and Qwen3-TTS loaders)."""
    params = dict(model.named_parameters())
    _check_coverage({key: (path, target) for key, (path, target, _) in plan.items()}, params)
    copy_planned(params, ((path, stored, target) for path, target, stored in plan.values()))


def copy_planned(params: dict[str, torch.Tensor], plan: Iterable[tuple[Path, str, _Target]]) -> None:
    """Copy each (file, stored tensor name, target rows) into the parameters, opening each file
    once; the copy casts the dtype and moves to the device in one step."""
    by_file: dict[Path, list[tuple[str, _Target]]] = {}
    for path, stored, target in plan:
        by_file.setdefault(path, []).append((stored, target))
    for path, entries in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored, target in entries:
                params[target.param].narrow(0, target.row_start, target.shape[0]).copy_(f.get_tensor(stored))
