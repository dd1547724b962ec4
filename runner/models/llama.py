"""Llama-family decoder (Llama 2/3.x, Qwen2, Qwen3) over a flattened, paged batch.

Inputs are T new tokens from any number of sequences, flattened (no batch dim); attention
reaches earlier tokens through the paged KV cache described by `AttentionMetadata`.
Numerics follow transformers (RMSNorm in fp32, RoPE cos/sin from fp32 tables cast to the
model dtype, residual adds in model dtype) so outputs match it within dtype tolerance.

The elementwise work (norms, residual adds, RoPE, SiLU*mul, KV write) goes through an ops
backend fixed at construction (runner/layers/base.py OpsBackend, chosen by the registry in
runner/layers/__init__.py): plain torch on CPU, fused Triton kernels on CUDA. Residual adds are folded into the next RMSNorm ("residual stream"): each layer takes and
returns (sublayer output, residual) and `add_rmsnorm` forms their sum, which is the same value
transformers' `h = h + sublayer(norm(h))` produces.

The forward pass never syncs with the host (no .item()/.tolist(), no branching on tensor
values): decode steps are meant to be captured in a CUDA graph. Python-level variants
(bias, q/k-norm, tied head) are fixed at construction.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runner.config import ModelConfig, RopeConfig
from runner.layers import make_attention, make_ops
from runner.layers.attention import AttentionMetadata
from runner.layers.base import AttentionBackend, OpsBackend
from runner.layers.ops import HEAD_ROW_MULTIPLE, padded_rows, row_multiple_for, torch_rmsnorm


class RMSNorm(nn.Module):
    """Holds the weight; the layers apply it through their ops (fused with the residual add)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_rmsnorm(x, self.weight, self.eps)  # reference path, unused by the model


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, computed the way transformers does (on CPU, fp32)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_type {rope.rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_position_embeddings, head_dim] in fp32, indexed by position; applied by
    the ops' `rope`. Each row is cat(f, f) (columns j and j + head_dim/2 are equal), which the
    fused kernel relies on to read only the first half.

    The tables are non-persistent buffers so they never appear in checkpoints; after building
    on the meta device call `reset(device)` to compute them for real.
    """

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope = rope
        if torch.empty(0).device.type == "meta":
            # Built under `torch.device("meta")`: shapes only; reset() fills them after to_empty.
            self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        else:
            self.register_buffer("cos", torch.empty(0), persistent=False)
            self.register_buffer("sin", torch.empty(0), persistent=False)
            self.reset(torch.empty(0).device)

    def reset(self, device: torch.device | str | None) -> None:
        # Tables are computed on the CPU in fp32 whatever the target device, then moved.
        inv_freq = rope_inv_freq(self.rope, self.head_dim)  # [D/2], CPU fp32
        pos = torch.arange(self.max_positions, dtype=torch.int64, device="cpu").float()
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2], same product as HF computes per step
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, attn: AttentionBackend, rotary: RotaryEmbedding,
                 ops: OpsBackend):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # Fused q|k|v on the output dim: one GEMM per layer instead of three.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_proj_has_bias(cfg))
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.attn = attn
        self.ops = ops
        # A backend that declares `accepts_prewritten_kv` lets the RoPE launch also write this
        # step's K/V into the cache (one launch instead of three); fixed here, not per call.
        self.fuse_kv_write = attn.accepts_prewritten_kv
        # ... and one that `fuses_decode_rope` does RoPE + KV write + attention of a pure-decode
        # step in a single launch (at the batch sizes where its `decode_rope_fused` says so).
        self.rope_in_attention = self.fuse_kv_write and attn.fuses_decode_rope
        # ... and one that `decodes_from_cache` can take a pure-decode step whose RoPE and K/V
        # write the ops did in the qkv GEMM (ops.qkv_rope_write, where they have that kernel;
        # not with per-head q/k norms, which come between the GEMM and RoPE)
        self.qkv_rope = attn.decodes_from_cache and not cfg.qk_norm
        # Shared, not owned: a plain attribute keeps it out of this module's state_dict.
        self._rotary = (rotary,)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        rot = self._rotary[0]
        if self.qkv_rope and meta.pure_decode:
            q = self.ops.qkv_rope_write(x, self.qkv_proj, self.num_heads, rot.cos, rot.sin, positions, kv_cache,
                                        meta.slot_mapping)
            if q is not None:  # q rotated, this token's K/V in the cache
                return self.attn.forward_decode_cached(q, kv_cache, meta, self.scale).reshape(t, self.q_size)
        qkv = self.ops.linear(x, self.qkv_proj)  # [T, q_size + 2*kv_size]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        # Strided views into qkv (row stride q_size + 2*kv_size); the ops handle the strides.
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # Qwen3: per-head RMSNorm over head_dim, before RoPE
            q = self.ops.rmsnorm(q, self.q_norm.weight, self.q_norm.eps)
            k = self.ops.rmsnorm(k, self.k_norm.weight, self.k_norm.eps)
        # rope may rotate q/k in place (TritonOps): the pre-RoPE q/k are not used again.
        if self.rope_in_attention and meta.pure_decode and self.attn.decode_rope_fused(t, self.num_kv_heads, x.device):
            out = self.attn.forward_decode_rope(q, k, v, rot.cos, rot.sin, positions, kv_cache, meta, self.scale)
        elif self.fuse_kv_write:
            q, k = self.ops.rope_write_kv(q, k, v, rot.cos, rot.sin, positions, kv_cache, meta.slot_mapping)
            out = self.attn.forward_prewritten_kv(q, k, v, kv_cache, meta, self.scale)  # [T, Hq, D]
        else:
            q, k = self.ops.rope(q, k, rot.cos, rot.sin, positions)
            out = self.attn.forward(q, k, v, kv_cache, meta, self.scale)  # [T, Hq, D]
        # o_proj is applied by the layer's ops.post_attention, with the add + RMSNorm after it
        return out.reshape(t, self.q_size)


def o_proj_has_bias(cfg: ModelConfig) -> bool:
    # Qwen2 biases q/k/v only; Llama and Qwen3 apply `attention_bias` to o_proj as well.
    return cfg.attention_bias and cfg.decoder != "qwen2"


class MLP(nn.Module):
    """The MLP's weights. [T, H] -> [T, 2I] -> [T, I] -> [T, H], applied by the layer's
    ops.post_attention together with o_proj and the add + RMSNorm between them (the ops may fuse
    SiLU*mul into the gate_up GEMM, and the norm into gate_up too)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate | up
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, attn: AttentionBackend, rotary: RotaryEmbedding,
                 ops: OpsBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, attn, rotary, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.ops = ops

    def forward(
        self,
        h: torch.Tensor,  # [T, H] previous layer's MLP output, or the embeddings when residual is None
        residual: torch.Tensor | None,  # [T, H] residual stream before h is added; None for layer 0
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, residual); their sum is the layer's output. The MLP
        output may be split-K partials (ops.linear's into_norm): ops.add_rmsnorm and
        ops.materialize take it.

        Same values as transformers' `h = h + attn(norm(h)); h = h + mlp(norm(h))`: each add is
        done (in the model dtype) by the add_rmsnorm (or ops.post_attention) that consumes it.
        """
        ops = self.ops
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:  # layer 0 (fixed per layer, not data-dependent)
            residual = h
            x = ops.rmsnorm(h, ln1.weight, ln1.eps)
        else:
            x, residual = ops.add_rmsnorm(h, residual, ln1.weight, ln1.eps)
        out = self.self_attn(x, positions, kv_cache, meta)  # [T, Hq * D], before o_proj
        mlp = self.mlp
        return ops.post_attention(out, self.self_attn.o_proj, residual, ln2.weight, ln2.eps, mlp.gate_up_proj,
                                  mlp.down_proj)


def run_decoder(layers: nn.ModuleList, norm: RMSNorm, ops: OpsBackend, h: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata, capture_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Decoder layers and the final norm over input embeddings h [T, H] (LlamaForCausalLM, and
    CSM's two stacks): (final hidden after the norm [T, H], {layer: [T, H]} for capture_layers,
    indexed as transformers' output_hidden_states: 0 = the embeddings, i = decoder layer i-1's
    output, len(layers) = after the norm)."""
    n = len(layers)
    assert n > 0
    captured: dict[int, torch.Tensor] = {0: h} if 0 in capture_layers else {}
    residual = None
    for i, layer in enumerate(layers):
        h, residual = layer(h, residual, positions, kv_caches[i], meta)
        if i + 1 < n and (i + 1) in capture_layers:
            # The layer's output is only formed inside the next add_rmsnorm; materialise it
            # (one extra add, only when asked; bit-identical to the fused sum).
            captured[i + 1] = ops.materialize(h) + residual
    h, _ = ops.add_rmsnorm(h, residual, norm.weight, norm.eps)
    if n in capture_layers:
        captured[n] = h
    return h, captured


class LlamaForCausalLM(nn.Module):
    """Parameter names mirror HF's minus the split projections (qkv_proj, gate_up_proj).

    `attn` (attention backend) and `ops` (runner/layers/base.py) default to the registry's
    choice for the default device; build_empty_model passes the target device's.
    """

    def __init__(self, cfg: ModelConfig, attn: AttentionBackend | None = None, ops: OpsBackend | None = None):
        super().__init__()
        self.cfg = cfg
        self.attn = attn if attn is not None else make_attention(None, torch.get_default_device())
        self.ops = ops if ops is not None else make_ops(None, torch.get_default_device())
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.attn, self.rotary, self.ops) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tied = cfg.tie_word_embeddings
        if not self.tied:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

        # [V', H] with V' = V rounded up to HEAD_ROW_MULTIPLE, rows >= V zero, whose first V
        # rows are the head's weight (see pad_lm_head); None: the head is used as it is
        self.lm_head_padded: torch.Tensor | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tied else self.lm_head.weight

    @torch.no_grad()
    def pad_lm_head(self, multiple: int = HEAD_ROW_MULTIPLE) -> None:
        """Store the head's weight (the embedding, if tied) as the first V rows of a [V', H]
        tensor with V' a multiple of `multiple`, before the weights are filled (ops.padded_rows
        says why)."""
        rows, padded = padded_rows(self.lm_head_weight, multiple)
        if padded is None:
            return
        module = self.embed_tokens if self.tied else self.lm_head
        module.weight = nn.Parameter(rows, requires_grad=False)
        self.lm_head_padded = padded

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Returns (final hidden after the norm [T, H], {layer: [T, H]}).

        Layer indices follow transformers' output_hidden_states: 0 = embeddings, i = output of
        decoder layer i-1, num_layers = final output after the norm.
        """
        h = self.embed_tokens(input_ids)  # [T, H]
        return run_decoder(self.layers, self.norm, self.ops, h, positions, kv_caches, meta, capture_layers)

    def compute_logits(self, hidden: torch.Tensor, span: tuple[int, int] | None = None) -> torch.Tensor:
        """[N, H] -> [N, V] float32 (matmul in model dtype like HF, then upcast); with
        span = (lo, hi) only the logits of ids [lo, hi): [N, hi - lo], the same values (the
        rows of the weight are independent dot products)."""
        if span is not None:
            return F.linear(hidden, self.lm_head_weight[span[0] : span[1]]).float()
        # [N, V] in the model dtype; with a padded head, a view of the [N, V'] product
        logits = self.ops.head(hidden, self.lm_head_weight, self.lm_head_padded)
        if self.lm_head_padded is not None:
            # Row stride V always: `.float()` keeps a one-row view's padded stride V' (torch
            # counts a [1, V] slice of [1, V'] as contiguous), so one sampled row would reach
            # the sampling kernels with another row stride than several (a Triton
            # specialisation compiled mid-serving).
            return torch.empty(logits.shape, dtype=torch.float32, device=logits.device).copy_(logits)
        return logits.float()

    def greedy_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N] int64: the ids compute_logits(hidden).argmax(-1) gives, without its fp32
        copy of the logits. The same ids: the upcast to fp32 is exact, and argmax returns the
        first index of the maximum either way (ops.greedy_head: runner/kernels/argmax.py on CUDA,
        or the argmax inside the head GEMM, runner/kernels/head_argmax.py, whose GEMM may round a
        near-tie differently from cuBLAS's)."""
        return self.ops.greedy_head(hidden, self.lm_head_weight, self.lm_head_padded)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Compute the non-parameter state (RoPE tables) on `device`; needed after meta init."""
        self.rotary.reset(device)


def build_empty_model(
    cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype, attn: AttentionBackend | None = None,
    ops: OpsBackend | None = None, model_cls: type[LlamaForCausalLM] = LlamaForCausalLM,
) -> LlamaForCausalLM:
    """Allocate the model (`model_cls`: runner.models.model_class_for(cfg) when loading) on
    `device` in `dtype` with uninitialised parameters (no init kernels, no CPU copy); RoPE tables
    are computed for real. `attn`/`ops` default to the registry's choice for `device`."""
    device = torch.device(device)
    if attn is None:
        attn = make_attention(None, device)
    if ops is None:
        ops = make_ops(None, device)
    with torch.device("meta"):
        model = model_cls(cfg, attn, ops)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.reset_buffers(device)
    model.pad_lm_head(row_multiple_for(device))  # chosen once: the alignment matters to cuBLAS only
    return model.eval().requires_grad_(False)


@torch.no_grad()
def build_random_model(
    cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0,
    attn: AttentionBackend | None = None, ops: OpsBackend | None = None,
) -> LlamaForCausalLM:
    """Random weights (std 0.02, biases 0, norms 1) generated directly on `device`, for benchmarks."""
    model = build_empty_model(cfg, device, dtype, attn, ops)
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return model
