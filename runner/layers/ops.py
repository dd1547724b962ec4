"""`TorchOps`: the decoder's per-layer ops (runner/layers/base.py `OpsBackend`) in plain torch.

The CPU path and the numerical reference: it computes exactly what transformers computes, op by
op, in the same dtypes. `TritonOps` (runner/layers/triton_ops.py, CUDA) does each op in one fused
launch with the same roundings; a decode layer then launches ~9 kernels (4 GEMMs, attention,
4 fused ops) instead of ~41, which matters because at small batch those tiny launches, not the
weight reads, dominate the step. The registry (runner/layers/__init__.py) picks one of the two
once, at model construction.

`torch_head` and `unfolded_post_attention` are shared with TritonOps (its fallbacks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.layers.attention import write_kv
from runner.layers.base import OpsBackend


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


HEAD_ROW_MULTIPLE = 64  # heads' rows padded to this on CUDA (padded_rows)


def row_multiple_for(device: torch.device) -> int:
    """The row multiple heads are padded to on `device` (chosen once, at load): HEAD_ROW_MULTIPLE
    on CUDA, where cuBLAS wants the alignment; 1 (no padding) elsewhere."""
    return HEAD_ROW_MULTIPLE if device.type == "cuda" else 1


def padded_rows(w: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows, padded): w [..., V, H] copied into the first V rows of a zero-padded `padded`
    [..., V', H], V' = V rounded up to `multiple`, and `rows` = padded[..., :V, :], the view a
    caller keeps as the weight (torch_head's `padded` is the other); where V' == V: (w made
    contiguous, None). Why: a head with an odd vocabulary (Orpheus 156940, CSM 2051) writes
    logits rows that are not 16-byte aligned, and cuBLAS on Hopper falls back to a much slower
    sm80 kernel for it (a 2051-row head at 512 rows: 39 us in `cutlass_75_tensorop_s1688gemm`);
    computing V' columns and dropping the zero ones keeps the fast kernels."""
    v = w.shape[-2]
    vp = -(-v // multiple) * multiple
    if vp == v:
        return w.contiguous(), None
    padded = w.new_zeros(*w.shape[:-2], vp, w.shape[-1])
    padded[..., :v, :] = w
    return padded[..., :v, :], padded


def unfolded_post_attention(ops: OpsBackend, out: torch.Tensor, o_proj: torch.nn.Linear, residual: torch.Tensor,
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

    def depth_step_rows(self, hidden: int, inter: int) -> int:
        return 0

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

