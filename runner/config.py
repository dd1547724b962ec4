"""The engine's configuration tree: built and validated once at start-up, frozen, passed down.

Nothing below the engine constructor reads environment variables or mutates these objects.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from runner.kernels.tuning import TUNING_MODES
from streaming.knobs import knob

DEPTH_STEP_MODES = ("auto", "on", "off")  # RunnerConfig.depth_step

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # Sesame CSM: the engine's view is its backbone (runner/families/csm.py builds the model)
    "CsmForConditionalGeneration": "csm",
}

# runner/families/qwen3_tts.py: a talker with its own config layout (ModelConfig.from_dict)
QWEN3_TTS_ARCHITECTURE = "Qwen3TTSForConditionalGeneration"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the field."""


def parse_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """bf16 on CUDA and fp32 on CPU unless overridden."""
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype: unknown value {name!r}; choose one of {sorted(_DTYPES)} or 'auto'") from None


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, read from a Hugging Face config.json."""

    path: str
    decoder: str  # the decoder variant: "llama" | "qwen2" | "qwen3" | "csm" (SUPPORTED_ARCHITECTURES)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2, some Llamas)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    rope: RopeConfig
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @staticmethod
    def from_pretrained(path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"model: no config.json in {str(path)!r}")
        raw = json.loads(cfg_file.read_text())
        return ModelConfig.from_dict(raw, str(path))

    @staticmethod
    def from_dict(raw: dict, path: str = "") -> "ModelConfig":
        archs = raw.get("architectures") or []
        if QWEN3_TTS_ARCHITECTURE in archs:
            # Qwen3-TTS: the engine's view is its talker (runner/models/qwen3_tts_config.py
            # parses the folder; it builds its decoders with this function, hence the late import)
            from runner.models.qwen3_tts_config import Qwen3TtsConfig

            return Qwen3TtsConfig.from_dict(raw, path).engine_view
        decoder = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if decoder is None:
            raise ConfigError(
                f"model.architectures: {archs!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )

        if decoder == "csm":
            raw = _csm_backbone_view(raw)

        def need(key: str):
            if key not in raw:
                raise ConfigError(f"model config: missing field {key!r}")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ConfigError(f"model config: num_attention_heads {heads} not divisible by num_key_value_heads {kv_heads}")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            path=path,
            decoder=decoder,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=decoder == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=decoder == "qwen3",
            rope=_parse_rope(raw),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            bos_token_id=raw.get("bos_token_id"),
        )


CSM_ROPE_THETA = 500000.0  # transformers CsmConfig / CsmDepthDecoderConfig default_theta


def _csm_backbone_view(raw: dict) -> dict:
    """CSM's config.json as the engine schedules it: the backbone's shape (the top-level fields),
    prompts of text ids (text_vocab_size) and the end-of-audio position as its end id. The
    frame layout and the depth decoder are runner/models/csm_config.py's."""
    view = dict(raw, vocab_size=raw.get("text_vocab_size", 128256),
                eos_token_id=raw.get("audio_eos_token_id", 128003))
    if not view.get("rope_parameters") and "rope_theta" not in view and not view.get("rope_scaling"):
        view["rope_theta"] = CSM_ROPE_THETA
    return view


def _parse_rope(raw: dict) -> RopeConfig:
    # transformers 5 folds theta and scaling into `rope_parameters`; 4.x uses rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ("default", "llama3", "linear"):
        raise ConfigError(f"model config: rope_scaling.rope_type {rope_type!r} is not supported (default, llama3, linear)")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = knob(16, "KV cache block size in tokens (a power of two)")
    # Either an explicit block count or a memory budget; num_blocks wins when both are set.
    num_blocks: int | None = knob(None, "KV cache blocks (default: from --kv-memory-gb, else enough for every sequence)")
    kv_memory_gb: float | None = knob(None, "KV cache size (default: enough for every sequence, capped by free memory)")
    enable_prefix_caching: bool = knob(True, "reuse the KV blocks of shared prompt prefixes", flag="--no-prefix-caching")


# below this many running requests a step is cheap either way: admit at once (first audio)
ADMISSION_HOLD_MIN_RUNNING = 64


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = knob(64, "sequences decoded together (batch rows)")
    # token budget of one step (chunked prefill splits above it)
    max_num_batched_tokens: int = knob(2048, "token budget of one engine step")
    max_model_len: int | None = knob(None, "longest sequence (default: the model's max_position_embeddings)")
    # On: the emit of step N happens after step N+1 was scheduled and launched (docs/design.md
    # states the invariants); the same tokens as off, the device never waits for the host.
    async_scheduling: bool = knob(True, "overlap scheduling with the device's step", flag="--no-async-scheduling")
    # Batch admissions under load: with >= ADMISSION_HOLD_MIN_RUNNING requests running, a new
    # request waits until the oldest waiting one is this old, so arrivals join in groups and
    # fewer steps carry prefill tokens (each such step is larger, and eager when a prompt is
    # long). 0 admits at every step (docs/performance.md has the serving figures for both).
    admission_wait_ms: float = knob(
        20.0, f"with >= {ADMISSION_HOLD_MIN_RUNNING} requests running, admit new ones in groups at most this often (0: every step)")


@dataclass(frozen=True)
class RunnerConfig:
    device: str = knob("auto", "cpu, cuda, cuda:N (auto: cuda if available)")
    dtype: str = knob("auto", "auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    cuda_graphs: bool = knob(True, "replay decode steps as CUDA graphs (CUDA only)", flag="--no-cuda-graphs")
    # graph rows: min(this, max(max_num_seqs, max_num_batched_tokens)) where short prefill chunks
    # run as token rows (every such step replays a graph), else min(this, max_num_seqs)
    max_graph_batch_size: int = knob(2048, "largest batch captured as a CUDA graph")
    # the OMNISTREAM_SAMPLER_BACKEND environment variable overrides "auto"
    sampler_backend: str = knob("auto", "sampler kernels: auto, torch, triton")
    # CUDA decode kernels (runner/kernels/linear.py, runner/kernels/pdl.py); off only for A/B runs
    skinny_linear: bool = knob(True, "16-bit GEMMs of <= 64 rows as Triton tiles (A/B switch)", flag="--no-skinny-linear")
    pdl: bool = knob(True, "programmatic dependent launch where the GPU has it, sm90+ (A/B switch)", flag="--no-pdl")
    # pure-decode RoPE + KV write inside the attention kernel
    rope_in_attention: bool = knob(True, "decode RoPE + KV write inside the attention kernel (A/B switch)",
                                   flag="--no-rope-in-attention")
    # ... and, where that kernel is split many ways (batch 1 on few KV heads), its loads that no
    # earlier kernel of the step writes (block table, first K/V tile, RoPE rows) issued before
    # the PDL wait (the tuning table's attention.prefetch_min_splits)
    attention_prefetch: bool = knob(True, "attention loads issued before the PDL wait (A/B switch)",
                                    flag="--no-attention-prefetch")
    # o_proj / down of 2..64 rows as split-K partials summed by the add + RMSNorm
    split_k: bool = knob(True, "o_proj / down as split-K partials at 2..64 rows (A/B switch)", flag="--no-split-k")
    # o_proj adds the residual and gate_up finishes the post-attention RMSNorm (no norm launch
    # between them) where the tuning table's fold entries say so
    norm_fold: bool = knob(True, "post-attention RMSNorm folded into o_proj + gate_up (A/B switch)",
                           flag="--no-norm-fold")
    # pure-decode steps: the qkv GEMM rotates q / k and writes this token's K/V to the cache in
    # its epilogue where its Triton tile runs (runner/kernels/qkv_rope.py), and the attention
    # kernel after it only attends
    qkv_rope: bool = knob(True, "RoPE + KV write in the qkv GEMM's epilogue (A/B switch)", flag="--no-qkv-rope")
    # a depth decoder's (CSM, Qwen3-TTS) sub-step as one persistent kernel of grid-synchronised
    # phases instead of ~27 launches (runner/kernels/depth_step.py, depth_row.py). auto: at one
    # row, for the decoder shapes the device's tuning table lists (where it measured faster);
    # on: at 1..64 rows wherever it fits (A/B); off: never
    depth_step: str = knob("auto", "a depth decoder's sub-step as one persistent kernel: auto (one row, where the "
                                   "device's tuning table says), on (1..64 rows, A/B switch), off")
    # "auto": the device's table if present; "none": generic tiles/cuBLAS everywhere
    # (runner/kernels/tuning: the tables as data, looked up once per backend)
    tuning: str = knob("auto", "kernel tuning tables: auto (the device's table if there is one), none (generic tiles "
                               "and cuBLAS everywhere, A/B switch)")
    # Also capture pure-decode graphs that keep every layer's output, so a decode step with a
    # hidden-state request replays a graph instead of running eagerly (host-bound: every stream
    # of the batch waits). Memory: (layers + 1) x max_num_seqs x hidden x dtype in the graph
    # pool, and start-up captures one graph more per bucket. Tokens and hidden states are bit
    # for bit the eager ones (tests/gpu/test_gpu.py).
    hidden_state_graphs: bool = knob(
        True, "capture all-layers decode graphs (off: decode steps with a hidden-state request run eagerly)",
        flag="--no-hidden-state-graphs")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype, self.torch_device)


@dataclass(frozen=True)
class ProcessConfig:
    """The engine process's own options (not the engine's)."""

    codec_dtype: str = knob("auto", "codec decode dtype: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16")
    # Tiny models on a shared machine lose badly to oversubscription, hence the cap.
    cpu_threads: int | None = knob(None, "torch threads of a CPU engine (default: half the cores, at most 4)")
    random_weights: bool = knob(False, "benchmarks only: take the shape from --model's config.json, use random weights")
    # A step that never returns (a GPU kernel that does not end) holds every client until it
    # times out; exiting instead fails the in-flight requests at once and the front end
    # starts a new engine. Far above any real step (first-use compiles take seconds).
    stall_exit_s: float = knob(120.0, "native engine loop without progress this long: report it, fail the in-flight "
                                      "requests and exit so the server restarts the engine (0: never)")

    def __post_init__(self) -> None:
        if self.stall_exit_s < 0:
            raise ConfigError(f"stall_exit_s: must be >= 0 (0: never), got {self.stall_exit_s}")


ENGINE_PARTS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "runner": RunnerConfig}


def split_knobs(knobs: dict, parts: dict[str, type] = ENGINE_PARTS) -> dict[str, dict]:
    """{field: value} -> {part: {field: value}} by field name; an unknown name is a ConfigError."""
    owner = {f.name: part for part, cls in parts.items() for f in fields(cls)}
    out: dict[str, dict] = {part: {} for part in parts}
    for name, value in knobs.items():
        if name not in owner:
            raise ConfigError(f"{name}: not a setting of {', '.join(c.__name__ for c in parts.values())}")
        out[owner[name]][name] = value
    return out


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)

    def __post_init__(self) -> None:
        s, c = self.scheduler, self.cache
        if s.max_num_seqs < 1:
            raise ConfigError("max_num_seqs: must be >= 1")
        if c.block_size < 1 or c.block_size & (c.block_size - 1):
            raise ConfigError("block_size: must be a power of two")
        if s.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens: must be >= 1")
        # the one place max_model_len is resolved: None is the model's limit, and no more than it
        limit = self.model.max_position_embeddings
        resolved = min(s.max_model_len or limit, limit)
        if resolved != s.max_model_len:
            object.__setattr__(self, "scheduler", replace(s, max_model_len=resolved))
            s = self.scheduler
        if s.max_model_len < 2:
            raise ConfigError("max_model_len: must be >= 2")
        if not 0 <= s.admission_wait_ms <= 10_000:
            raise ConfigError(f"admission_wait_ms: must be in [0, 10000], got {s.admission_wait_ms}")
        if c.num_blocks is not None and c.num_blocks < 1:
            raise ConfigError("num_blocks: must be >= 1")
        if self.runner.sampler_backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"sampler_backend: {self.runner.sampler_backend!r} is not one of auto, torch, triton")
        if self.runner.depth_step not in DEPTH_STEP_MODES:
            raise ConfigError(f"depth_step: {self.runner.depth_step!r} is not one of {', '.join(DEPTH_STEP_MODES)}")
        if self.runner.tuning not in TUNING_MODES:
            raise ConfigError(f"tuning: {self.runner.tuning!r} is not one of {', '.join(TUNING_MODES)}")
        if self.runner.torch_device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device: CUDA requested but torch.cuda.is_available() is False")

    @staticmethod
    def build(model_path: str | Path, **knobs) -> "EngineConfig":
        """The config of the model at model_path; knobs are fields of CacheConfig,
        SchedulerConfig and RunnerConfig by name (their defaults are the only ones)."""
        parts = split_knobs(knobs)
        return EngineConfig.from_parts(model_path, CacheConfig(**parts["cache"]),
                                       SchedulerConfig(**parts["scheduler"]), RunnerConfig(**parts["runner"]))

    @staticmethod
    def from_parts(model_path: str | Path, cache: CacheConfig, scheduler: SchedulerConfig,
                   runner: RunnerConfig) -> "EngineConfig":
        model = ModelConfig.from_pretrained(model_path)
        if runner.sampler_backend == "auto":
            runner = replace(runner, sampler_backend=Env.read().sampler_backend)
        return EngineConfig(model=model, cache=cache, scheduler=scheduler, runner=runner)

    def with_(self, **kw) -> "EngineConfig":
        """A copy with sub-configs replaced (tests build variants this way)."""
        return replace(self, **kw)


@dataclass(frozen=True)
class Env:
    """Environment variables, read once at start-up and typed."""

    log_level: str = "INFO"  # OMNISTREAM_LOG_LEVEL
    cache_dir: str = "~/.cache/omnistream"  # OMNISTREAM_CACHE_DIR: where the embedded default is built
    sampler_backend: str = "auto"  # OMNISTREAM_SAMPLER_BACKEND: RunnerConfig.sampler_backend's "auto"

    @staticmethod
    def read() -> "Env":
        got = {f.name: os.environ[f"OMNISTREAM_{f.name.upper()}"] for f in fields(Env)
               if f"OMNISTREAM_{f.name.upper()}" in os.environ}
        if "log_level" in got:
            got["log_level"] = got["log_level"].upper()
        return Env(**got)
