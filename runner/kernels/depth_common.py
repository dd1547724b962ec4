"""Device helpers shared by the depth decoder's persistent kernels (runner/kernels/depth_step.py
for 1..64 rows, runner/kernels/depth_row.py for one row): the grid barrier and the per-head
RMSNorm of Qwen3's q / k.

Importing this module needs `triton` (CUDA, or the interpreter in tests).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grid_sync(counter_ptr, target):
    """Wait until `target` arrivals at counter_ptr (this program's included)."""
    tl.debug_barrier()  # every thread's stores of this phase issued before the release
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = load_acquire(counter_ptr)
    while seen < target:
        seen = load_acquire(counter_ptr)
    tl.debug_barrier()


@triton.jit
def load_acquire(ptr):
    """ld.acquire.gpu: the other programs' writes before their release are visible after it (a
    relaxed poll and an atomic after it would do too, but Triton drops an atomic whose result is
    unused)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def head_norm(xa, xb, w_ptr, part_cols, half, eps, HEAD_DIM: tl.constexpr):
    """Per-head RMSNorm (Qwen3's q_norm / k_norm) of a whole head held as halves xa, xb [BM, D/2]."""
    dt = xa.dtype
    fa = xa.to(tl.float32)
    fb = xb.to(tl.float32)
    r = tl.math.rsqrt((tl.sum(fa * fa, axis=1) + tl.sum(fb * fb, axis=1)) / HEAD_DIM + eps)
    wa = tl.load(w_ptr + part_cols).to(tl.float32)
    wb = tl.load(w_ptr + half + part_cols).to(tl.float32)
    oa = (wa[None, :] * (fa * r[:, None]).to(dt).to(tl.float32)).to(dt)
    ob = (wb[None, :] * (fb * r[:, None]).to(dt).to(tl.float32)).to(dt)
    return oa, ob
