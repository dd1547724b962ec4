"""`TritonOps`: the ops contract of runner/layers/base.py (`OpsBackend`) with one Triton launch
per op, over the kernels of runner/kernels/ (fused_ops, linear, qkv_rope, argmax, head_argmax).

Chosen once at model construction by the registry (runner/layers/__init__.py) on CUDA; the tests
also run it under Triton's interpreter on CPU. Importing this module needs `triton`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.kernels.argmax import row_argmax
from runner.kernels.fused_ops import rmsnorm, rope_, silu_and_mul
from runner.kernels.head_argmax import head_argmax
from runner.kernels.linear import (
    GATED,
    PLAIN,
    REFERENCE,
    LinearTile,
    Partials,
    materialize,
    residual_linear,
    skinny_linear,
)
from runner.kernels.qkv_rope import qkv_rope_write
from runner.kernels.depth_step import MAX_ROWS as DEPTH_STEP_MAX_ROWS
from runner.kernels.tuning import DepthTuning, LinearTables
from runner.layers.ops import torch_head, unfolded_post_attention

_SKINNY_DTYPES = (torch.bfloat16, torch.float16)  # fp32 keeps cuBLAS (tl.dot would round to tf32)


class TritonOps:
    """The OpsBackend contract with one Triton launch per op (CUDA; interpreter in tests).

    `tables`: the device's GEMM tables (runner/kernels/tuning `LinearTables`; the registry passes
    `load_tables(device, RunnerConfig.tuning).linear`; default: the reference table, for tests
    and benchmarks). The generic tables (tuning "none") name no shape: every GEMM in cuBLAS.
    `pdl`: launch every kernel with programmatic dependent launch (runner/kernels/pdl.py; only
    where `pdl_available`). `skinny_linear`: 16-bit GEMMs of M <= 64 rows (decode) run in
    runner/kernels/linear.py where `tables` says so (gate_up with the SiLU*mul fused in);
    otherwise F.linear (cuBLAS). `split_k`: a `linear(..., into_norm=True)` (o_proj, down) may
    return split-K `Partials` where the `split` rows say so; `add_rmsnorm` sums them. `norm_fold`:
    `post_attention` runs o_proj as residual_linear and finishes the RMSNorm inside gate_up where
    the `fold` rows say so. `qkv_rope`: `qkv_rope_write` runs the qkv GEMM with RoPE and the KV
    write in its epilogue (runner/kernels/qkv_rope.py) wherever qkv's tile is an MMA tile.
    `depth_step` ("auto" / "on" / "off", RunnerConfig's) with `depth` (the device table's
    DepthTuning): `depth_step_rows`. All
    fixed at construction; the tile (or none) per call from the GEMM's shape and M.
    """

    def __init__(self, pdl: bool = False, skinny_linear: bool = True, split_k: bool = True,
                 norm_fold: bool = True, qkv_rope: bool = True, depth_step: str = "off",
                 depth: DepthTuning = DepthTuning(), tables: LinearTables = REFERENCE) -> None:
        self.tables = tables
        self.depth_step = depth_step
        self.depth = depth
        self.pdl = pdl
        self.skinny = skinny_linear
        self.split_k = skinny_linear and split_k
        self.norm_fold = skinny_linear and norm_fold
        self.qkv_rope = skinny_linear and qkv_rope

    @staticmethod
    def _skinny_dtypes(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """x @ weight^T may run in runner/kernels/linear.py at all (16-bit, same dtype on both sides)."""
        return x.dtype in _SKINNY_DTYPES and weight.dtype == x.dtype

    def _tile(self, kind: int, x: torch.Tensor, lin: torch.nn.Linear) -> LinearTile | None:
        """The skinny GEMM's tile for x @ lin, or None: cuBLAS (decided from shapes and dtypes)."""
        if not self.skinny or not self._skinny_dtypes(x, lin.weight):
            return None
        n, k = lin.weight.shape
        return self.tables.tile(kind, n, k, x.shape[0])

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rmsnorm(x, weight, eps, pdl=self.pdl)

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rmsnorm(x, weight, eps, residual=residual, pdl=self.pdl)

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_(q, k, cos, sin, positions, pdl=self.pdl)

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
        return rope_(q, k, cos, sin, positions, v=v, kv_cache=kv_cache, slot_mapping=slot_mapping, pdl=self.pdl)

    def qkv_rope_write(self, x: torch.Tensor, qkv_proj: torch.nn.Linear, num_q_heads: int, cos: torch.Tensor,
                       sin: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """One launch where qkv runs as an MMA tile of the table (no bias, the cache in the model
        dtype, head_dim / 2 a multiple of the tile's half-width); else None (from shapes and
        dtypes only, so an eager step and its graph bucket agree). Why: the attention kernel
        after it then starts on K/V at once, with no RoPE + KV write launch between them
        (runner/kernels/qkv_rope.py; docs/performance.md has the measured effect)."""
        if not self.qkv_rope or qkv_proj.bias is not None or kv_cache.dtype != x.dtype:
            return None
        tile = self._tile(PLAIN, x, qkv_proj)
        if tile is None or tile.block_m == 1 or tile.groups or (kv_cache.shape[-1] // 2) % (tile.block_n // 2):
            return None
        return qkv_rope_write(x, qkv_proj.weight, tile, cos, sin, positions, kv_cache, slot_mapping, num_q_heads,
                              pdl=self.pdl)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up, pdl=self.pdl)

    def linear(self, x: torch.Tensor, lin: torch.nn.Linear, into_norm: bool = False) -> torch.Tensor | Partials:
        if into_norm and self.split_k and lin.bias is None and self._skinny_dtypes(x, lin.weight):
            split = self.tables.split_tile(*lin.weight.shape, x.shape[0])
            if split is not None:
                parts = skinny_linear(x, lin.weight, None, split[0], split_k=split[1], pdl=self.pdl)
                return Partials(parts, x.dtype)
        tile = self._tile(PLAIN, x, lin)
        if tile is None:
            return F.linear(x, lin.weight, lin.bias)
        return skinny_linear(x, lin.weight, lin.bias, tile, pdl=self.pdl)

    def mlp(self, x: torch.Tensor, gate_up: torch.nn.Linear, down: torch.nn.Linear,
            into_norm: bool = False) -> torch.Tensor | Partials:
        tile = self._tile(GATED, x, gate_up) if gate_up.bias is None else None
        if tile is None:
            act = self.silu_and_mul(self.linear(x, gate_up))
        else:  # gate_up with the SiLU*mul epilogue: [T, I] straight from the GEMM
            act = skinny_linear(x, gate_up.weight, None, tile, gated=True, pdl=self.pdl)
        return self.linear(act, down, into_norm)

    def post_attention(self, out: torch.Tensor, o_proj: torch.nn.Linear, residual: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float, gate_up: torch.nn.Linear,
                       down: torch.nn.Linear) -> tuple[torch.Tensor | Partials, torch.Tensor]:
        """o_proj, add + RMSNorm, MLP. Where the `fold` rows have a tile for o_proj at this M and
        gate_up runs as a gated MMA tile, two launches instead of three: o_proj adds the residual
        and hands gate_up (h * w, the rows' sums of squares), gate_up scales its accumulator by
        the rows' rsqrt. The residual stream is the add + RMSNorm's bit for bit; the MLP input
        differs from rmsnorm(h) * w only in where it rounds (w before the row factor, the row
        factor after the product: bf16 ulps, held to transformers by tests/gpu/test_gpu.py).
        Why: the norm launch between o_proj and gate_up sits on the step's critical path
        (the `fold` rows say at which shapes and row counts dropping it pays)."""
        fold = self._fold_tiles(out, o_proj, residual, norm_weight, gate_up)
        if fold is None:
            return unfolded_post_attention(self, out, o_proj, residual, norm_weight, eps, gate_up, down)
        o_tile, g_tile = fold
        h, xg, scale = residual_linear(out, o_proj.weight, residual, norm_weight, eps, o_tile, pdl=self.pdl)
        act = skinny_linear(xg, gate_up.weight, None, g_tile, gated=True, pdl=self.pdl, row_scale=scale)
        return self.linear(act, down, into_norm=True), h

    def _fold_tiles(self, out: torch.Tensor, o_proj: torch.nn.Linear, residual: torch.Tensor,
                    norm_weight: torch.Tensor, gate_up: torch.nn.Linear) -> tuple[LinearTile, LinearTile] | None:
        """(o_proj's residual_linear tile, gate_up's gated MMA tile) where post_attention folds
        the norm, else None (from shapes and dtypes only)."""
        if not self.norm_fold or o_proj.bias is not None or gate_up.bias is not None:
            return None
        dt = out.dtype
        if not self._skinny_dtypes(out, o_proj.weight) or residual.dtype != dt or norm_weight.dtype != dt:
            return None
        o_tile = self.tables.fold_tile(*o_proj.weight.shape, out.shape[0])
        g_tile = self._tile(GATED, residual, gate_up)
        if o_tile is None or g_tile is None or g_tile.block_m == 1:
            return None
        return o_tile, g_tile

    def materialize(self, h: torch.Tensor | Partials) -> torch.Tensor:
        return materialize(h)

    def head(self, x: torch.Tensor, weight: torch.Tensor, padded: torch.Tensor | None) -> torch.Tensor:
        # Only a head whose shape the tile table names runs here (default_tile is for the
        # decoder's GEMMs; a vocabulary-sized GEMM is measured on its own)
        if self.skinny and self._skinny_dtypes(x, weight) and self.tables.tunes_head(*weight.shape):
            tile = self.tables.tile(PLAIN, *weight.shape, x.shape[0])
            if tile is not None:
                return skinny_linear(x, weight, None, tile, pdl=self.pdl)
        return torch_head(x, weight, padded)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return row_argmax(x, pdl=self.pdl)

    def greedy_head(self, x: torch.Tensor, weight: torch.Tensor, padded: torch.Tensor | None) -> torch.Tensor:
        # the argmax in the head GEMM's epilogue where the `head` rows name the shape and row count
        if self.skinny and self._skinny_dtypes(x, weight):
            tile = self.tables.head_tile(*weight.shape, x.shape[0])
            if tile is not None:
                return head_argmax(x, weight, tile, pdl=self.pdl)
        return self.argmax(self.head(x, weight, padded))

    def depth_step_rows(self, hidden: int, inter: int) -> int:
        if self.depth_step == "on":
            return DEPTH_STEP_MAX_ROWS
        return 1 if self.depth_step == "auto" and self.depth.one_row_fits(hidden, inter) else 0
