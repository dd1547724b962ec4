"""Per-layer elementwise ops of the decoder (RMSNorm, residual add, RoPE, SiLU*mul, KV write),
as one object chosen once at model construction by `make_ops(device)`.

`TorchOps` is the plain-torch path (CPU, and the numerical reference): it computes exactly what
transformers computes, op by op, in the same dtypes. `TritonOps` (runner/kernels/fused_ops.py,
CUDA only) does each op in one fused kernel with the same roundings; a decode layer then launches
~9 kernels (4 GEMMs, attention, 4 fused ops) instead of ~41, which matters because at small
batch those tiny launches, not the weight reads, dominate the step (see the docstring there).
It also runs decode-sized GEMMs in Triton where they measured faster than cuBLAS, with the
SiLU*mul folded into gate_up, and launches its kernels with programmatic dependent launch.

Contract shared by both (shapes: T tokens, hidden H, heads Hq/Hkv, head_dim D, intermediate I):

* rmsnorm(x [..., N], w [N], eps) -> [..., N]        normalise in fp32, cast to x.dtype, * w
* add_rmsnorm(x, residual, w, eps) -> (normed, new_residual)
      new_residual = x + residual in the model dtype (a fresh tensor: inputs are never modified),
      normed = rmsnorm(new_residual)
* rope(q [T, Hq, D], k [T, Hkv, D], cos, sin [P, D] fp32, positions [T]) -> (q', k')
      rotate-half RoPE with the tables cast to q.dtype first (transformers' order). MAY WORK IN
      PLACE: callers must treat the q/k they passed as consumed. q/k may be strided views
      (columns of the fused qkv output).
* rope_write_kv(q, k, v, cos, sin, positions, kv_cache, slot_mapping) -> (q', k')
      rope, then the rotated k and v written to their flat slots of kv_cache
      [2, NB, BS, Hkv, D] (same contract as runner.layers.attention.write_kv).
* qkv_rope_write(x [T, H], qkv_proj [(Hq + 2 Hkv) D, H], num_q_heads, cos, sin, positions,
      kv_cache, slot_mapping) -> q' [T, Hq, D] | None
      linear(x, qkv_proj), then rope_write_kv of its q / k / v views, as one launch where the
      ops have such a kernel for this shape (TritonOps: runner/kernels/qkv_rope.py); only q
      comes back, k and v are in the cache. None: no such kernel here, the caller runs the two
      (TorchOps always)
* silu_and_mul(gate_up [T, 2I]) -> [T, I]            silu(gate) * up, gate = first half
* linear(x [T, K], lin: nn.Linear [N, K], into_norm=False) -> [T, N]   x @ W^T + b
      into_norm=True: the result only feeds add_rmsnorm (as its x) or materialize, and
      TritonOps may return it as split-K `Partials` (runner/kernels/linear.py) that those two sum
* mlp(x [T, H], gate_up [2I, H], down [H, I], into_norm=False) -> [T, H]
      linear(silu_and_mul(linear(x, gate_up)), down, into_norm); TritonOps may fold the
      SiLU*mul into the gate_up GEMM (runner/kernels/linear.py)
* post_attention(out [T, Hq*D], o_proj, residual [T, H], w [H], eps, gate_up, down) -> (mlp_out, new_residual)
      the decoder layer's second half: h = linear(out, o_proj); (x, new_residual) =
      add_rmsnorm(h, residual, w, eps); mlp_out = mlp(x, gate_up, down, into_norm=True).
      TritonOps may finish the RMSNorm inside gate_up instead (runner/kernels/linear.py
      residual_linear, FOLD_TUNED): no norm launch between the two GEMMs
* materialize(h) -> h as a tensor (identity unless h is Partials)
* head(x [N, H], weight [V, H], padded [V', H] | None) -> [N, V]   x @ weight^T, the lm_head
      (padded: weight's rows as the first V of a wider zero-padded copy, which cuBLAS prefers);
      may be a column view of a wider product
* argmax(x [N, V]) -> [N] int64                     torch.argmax(x, dim=-1): greedy ids (first
      index of the maximum; x may be a column slice of wider logits)
* greedy_head(x [N, H], weight [V, H], padded) -> [N] int64   argmax(head(x, weight, padded)):
      greedy ids; TritonOps may take them in the head GEMM's epilogue without writing the
      logits (runner/kernels/head_argmax.py), from its own GEMM's logits

None of them reads a tensor value on the host, so a decode step stays CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.layers.attention import write_kv


def torch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' order: normalise in fp32, cast back to the input dtype, then scale (so the
    # product with the weight rounds in the model dtype).
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def torch_head(x: torch.Tensor, weight: torch.Tensor, padded: torch.Tensor | None) -> torch.Tensor:
    """The lm_head by F.linear, on the padded copy of the weight where there is one (its first
    V columns of the product)."""
    if padded is not None:
        return F.linear(x, padded)[:, : weight.shape[0]]
    return F.linear(x, weight)


def unfolded_post_attention(ops, out: torch.Tensor, o_proj: torch.nn.Linear, residual: torch.Tensor,
                            norm_weight: torch.Tensor, eps: float, gate_up: torch.nn.Linear,
                            down: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's post_attention from its parts: linear (o_proj), add_rmsnorm, mlp. TorchOps'
    path, and TritonOps' wherever it does not fold the norm."""
    x, residual = ops.add_rmsnorm(ops.linear(out, o_proj, into_norm=True), residual, norm_weight, eps)
    return ops.mlp(x, gate_up, down, into_norm=True), residual


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchOps:
    """Reference path: plain torch ops, one small kernel each."""

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch_rmsnorm(x, weight, eps)

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x + residual == residual + x bit for bit (IEEE addition commutes), so this is the
        # unfused `h = h + sublayer(h)` of transformers.
        new_residual = x + residual
        return torch_rmsnorm(new_residual, weight, eps), new_residual

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers casts the fp32 cos/sin rows to the activation dtype before multiplying.
        c = cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        s = sin[positions].to(q.dtype).unsqueeze(1)
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s

    def rope_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.rope(q, k, cos, sin, positions)
        write_kv(k, v, kv_cache, slot_mapping)
        return q, k

    def qkv_rope_write(self, x: torch.Tensor, qkv_proj: torch.nn.Linear, num_q_heads: int, cos: torch.Tensor,
                       sin: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> torch.Tensor | None:
        return None  # no single-launch form: linear + rope_write_kv

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up

    def linear(self, x: torch.Tensor, lin: torch.nn.Linear, into_norm: bool = False) -> torch.Tensor:
        return F.linear(x, lin.weight, lin.bias)

    def mlp(self, x: torch.Tensor, gate_up: torch.nn.Linear, down: torch.nn.Linear,
            into_norm: bool = False) -> torch.Tensor:
        return self.linear(self.silu_and_mul(self.linear(x, gate_up)), down)

    def post_attention(self, out: torch.Tensor, o_proj: torch.nn.Linear, residual: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float, gate_up: torch.nn.Linear,
                       down: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        return unfolded_post_attention(self, out, o_proj, residual, norm_weight, eps, gate_up, down)

    def materialize(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def head(self, x: torch.Tensor, weight: torch.Tensor, padded: torch.Tensor | None) -> torch.Tensor:
        return torch_head(x, weight, padded)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)

    def greedy_head(self, x: torch.Tensor, weight: torch.Tensor, padded: torch.Tensor | None) -> torch.Tensor:
        return self.argmax(self.head(x, weight, padded))


def make_ops(device: torch.device | str, skinny_linear: bool = True, pdl: bool = True, split_k: bool = True,
             norm_fold: bool = True, qkv_rope: bool = True):
    """Fused Triton kernels on CUDA, plain torch elsewhere (chosen once, at construction).

    On CUDA: `skinny_linear` runs decode-sized 16-bit GEMMs in Triton (runner/kernels/linear.py),
    `split_k` lets o_proj / down hand split-K partials to the add + RMSNorm, `norm_fold` lets
    post_attention finish the post-attention RMSNorm inside gate_up, `qkv_rope` lets
    qkv_rope_write rotate q / k and write the cache in the qkv GEMM's epilogue, `pdl` launches
    the kernels with programmatic dependent launch where the GPU has it."""
    if torch.device(device).type == "cuda":
        from runner.kernels.fused_ops import (
            TritonOps,  # needs triton, present with CUDA torch
        )
        from runner.kernels.pdl import pdl_available

        return TritonOps(pdl=pdl and pdl_available(device), skinny_linear=skinny_linear, split_k=split_k,
                         norm_fold=norm_fold, qkv_rope=qkv_rope)
    return TorchOps()
