"""The backend contracts of the decoder's layers, as Protocols.

A backend is chosen once, at model construction, by the registry (runner/layers/__init__.py):
plain torch (`TorchPagedAttention`, `TorchOps`: CPU, and the numerical reference) or Triton
(`TritonPagedAttention`, `TritonOps`: CUDA). What a backend can do is declared as class (or
construction-time instance) attributes that every backend sets, so a caller reads
`attn.supports_token_rows` and never probes with getattr / hasattr.

Shapes: T tokens, B sequences, hidden H, heads Hq / Hkv, head_dim D, intermediate I, vocab V;
the paged KV cache of a layer is [2, num_blocks, block_size, Hkv, D] (runner/layers/attention.py).
None of the methods reads a tensor value on the host, so a decode step stays CUDA-graph capturable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:  # annotations only: attention.py holds the metadata, base.py no behaviour
    from runner.layers.attention import AttentionMetadata
    from runner.layers.sampling_batch import SamplingBatch
    from runner.layers.slot_state import SlotState


class AttentionBackend(Protocol):
    """Paged attention over one layer's KV cache.

    Capabilities (every backend declares each one):
      supports_token_rows   honours AttentionMetadata.token_*: a short prefill chunk runs as one
                            decode row per token (the runner builds those rows only then)
      accepts_prewritten_kv `forward_prewritten_kv` may be called after the ops wrote this
                            step's K/V (ops.rope_write_kv): the model fuses the KV write into RoPE
      decodes_from_cache    `forward_decode_cached` may be called for a pure-decode step whose
                            RoPE and K/V write the qkv GEMM did (ops.qkv_rope_write)
      fuses_decode_rope     `forward_decode_rope` may be called for a pure-decode step where
                            `decode_rope_fused(...)` says so (RoPE + KV write + attention in one)
    """

    supports_token_rows: bool
    accepts_prewritten_kv: bool
    decodes_from_cache: bool
    fuses_decode_rope: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k / v [T, Hkv, D] (RoPE applied) -> [T, Hq, D]; writes k / v to their
        slots (meta.slot_mapping) first."""
        ...

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
        ...

    def forward_prewritten_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """`forward` for a caller that already wrote k / v to their slots."""
        ...

    def forward_decode_cached(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
        """Pure decode (meta.pure_decode): q [B, Hq, D] rotated, this step's K/V already in the
        cache -> [B, Hq, D]."""
        ...

    def decode_rope_fused(self, batch: int, num_kv_heads: int, device: torch.device) -> bool:
        """Whether a pure-decode step of `batch` rows goes through `forward_decode_rope` (a
        function of shapes only, so an eager step and its graph replay agree)."""
        ...

    def forward_decode_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Pure decode, q / k not rotated, k / v not in the cache: RoPE, the KV write and
        attention in one launch -> [B, Hq, D]."""
        ...

    def warm_up(self, kv_cache: torch.Tensor, num_q_heads: int) -> None:
        """Start-up (Engine.warm_up): compile or load whatever a first step of some batch size
        would otherwise compile mid-serving, for caches of this shape."""
        ...

    def unsplit(self) -> AttentionBackend:
        """This backend for caches of one short block per sequence (CSM's depth decoder: K
        slots a row): decode launches never split a sequence's KV, because a split-K launch
        (and its merge) over a context of one tile only adds work. Chosen once, by the model
        that owns such a cache."""
        ...


class OpsBackend(Protocol):
    """The decoder's per-layer ops (norms, residual adds, RoPE, KV write, GEMMs, the head).

    TorchOps computes exactly what transformers computes, op by op, in the same dtypes;
    TritonOps does each op in one fused launch with the same roundings.


    * rmsnorm(x [..., N], w [N], eps) -> [..., N]        normalise in fp32, cast to x.dtype, * w
    * add_rmsnorm(x, residual, w, eps) -> (normed, new_residual)
          new_residual = x + residual in the model dtype (a fresh tensor: inputs are never
          modified), normed = rmsnorm(new_residual)
    * rope(q [T, Hq, D], k [T, Hkv, D], cos, sin [P, D] fp32, positions [T]) -> (q', k')
          rotate-half RoPE with the tables cast to q.dtype first (transformers' order). MAY WORK
          IN PLACE: callers must treat the q/k they passed as consumed. q/k may be strided views
          (columns of the fused qkv output).
    * rope_write_kv(q, k, v, cos, sin, positions, kv_cache, slot_mapping) -> (q', k')
          rope, then the rotated k and v written to their flat slots of kv_cache
          (same contract as runner.layers.attention.write_kv).
    * qkv_rope_write(x [T, H], qkv_proj [(Hq + 2 Hkv) D, H], num_q_heads, cos, sin, positions,
          kv_cache, slot_mapping) -> q' [T, Hq, D] | None
          linear(x, qkv_proj), then rope_write_kv of its q / k / v views, as one launch where
          the ops have such a kernel for this shape; only q comes back, k and v are in the
          cache. None: no such kernel here, the caller runs the two (TorchOps always).
    * silu_and_mul(gate_up [T, 2I]) -> [T, I]            silu(gate) * up, gate = first half
    * linear(x [T, K], lin: nn.Linear [N, K], into_norm=False) -> [T, N]   x @ W^T + b
          into_norm=True: the result only feeds add_rmsnorm (as its x) or materialize, and
          TritonOps may return it as split-K `Partials` (runner/kernels/linear.py) that those
          two sum
    * mlp(x [T, H], gate_up [2I, H], down [H, I], into_norm=False) -> [T, H]
          linear(silu_and_mul(linear(x, gate_up)), down, into_norm); TritonOps may fold the
          SiLU*mul into the gate_up GEMM
    * post_attention(out [T, Hq*D], o_proj, residual [T, H], w [H], eps, gate_up, down)
          -> (mlp_out, new_residual): the decoder layer's second half: h = linear(out, o_proj);
          (x, new_residual) = add_rmsnorm(h, residual, w, eps); mlp_out = mlp(x, gate_up, down,
          into_norm=True). TritonOps may finish the RMSNorm inside gate_up instead.
    * materialize(h) -> h as a tensor (identity unless h is Partials)
    * head(x [N, H], weight [V, H], padded [V', H] | None) -> [N, V]   x @ weight^T, the lm_head
          (padded: weight's rows as the first V of a wider zero-padded copy, which cuBLAS
          prefers); may be a column view of a wider product
    * argmax(x [N, V]) -> [N] int64    torch.argmax(x, dim=-1): the first index of the maximum
          (x may be a column slice of wider logits)
    * greedy_head(x [N, H], weight [V, H], padded) -> [N] int64   argmax(head(x, weight, padded));
          TritonOps may take the ids in the head GEMM's epilogue without writing the logits
    * depth_step_rows(hidden, inter) -> int   the most rows a depth decoder of that shape
          (runner/models/csm_parts.py) runs a sub-step for as runner/kernels/depth_step.py's one
          persistent launch (0: never; TorchOps always 0)
    """

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def qkv_rope_write(self, x: torch.Tensor, qkv_proj: torch.nn.Linear, num_q_heads: int, cos: torch.Tensor,
                       sin: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> torch.Tensor | None: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def linear(self, x: torch.Tensor, lin: torch.nn.Linear, into_norm: bool = False) -> torch.Tensor: ...

    def mlp(self, x: torch.Tensor, gate_up: torch.nn.Linear, down: torch.nn.Linear,
            into_norm: bool = False) -> torch.Tensor: ...

    def post_attention(self, out: torch.Tensor, o_proj: torch.nn.Linear, residual: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float, gate_up: torch.nn.Linear,
                       down: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]: ...

    def materialize(self, h: torch.Tensor) -> torch.Tensor: ...

    def head(self, x: torch.Tensor, weight: torch.Tensor, padded: torch.Tensor | None) -> torch.Tensor: ...

    def argmax(self, x: torch.Tensor) -> torch.Tensor: ...

    def greedy_head(self, x: torch.Tensor, weight: torch.Tensor, padded: torch.Tensor | None) -> torch.Tensor: ...


class SamplingBackend(Protocol):
    """The sampler's device work (runner/layers/sampler.py has the semantics): torch
    (`TorchSampling`, radix select) or Triton (`TritonSampling`, runner/kernels/sampling.py).
    Both give the same kept sets up to fp32 summation order."""

    name: str  # "torch" | "triton"

    def apply_penalties(self, logits: torch.Tensor, batch: SamplingBatch, state: SlotState, col0: int = 0) -> None:
        """Repetition / frequency / presence penalties, in place on logits [B, N] of ids
        [col0, col0 + N), read from the state rows batch.slots."""
        ...

    def race_noise(self, seeds: torch.Tensor, counters: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Fill out [B, V] float32 with the race noise of (seeds [B], counters [B]) (noise.race_noise)."""
        ...

    def filter_and_sample(self, logits: torch.Tensor, batch: SamplingBatch, q: torch.Tensor) -> torch.Tensor:
        """Stages 3-5 on logits [B, V] (scaled in place): temperature, top-k / top-p / min-p, the
        race against q [B, V]; greedy rows take the argmax of the unscaled logits. -> [B] int64."""
        ...

    def filter_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        """Stage 4 alone, in place: scaled logits, -inf where a filter drops the token."""
        ...

    def record_tokens(self, last_token: torch.Tensor, history: torch.Tensor, counts: torch.Tensor | None,
                      slots: torch.Tensor, tokens: torch.Tensor, out_index: torch.Tensor) -> None:
        """SlotState.record on its [S+1]-row buffers: padding rows (slot < 0) touch only the
        scratch row S."""
        ...
