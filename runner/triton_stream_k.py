"""Stream-K split of a skinny decode GEMM: every SM gets the same share of the K loop.

Why: at 64 rows o_proj (3072 x 3072) and down (3072 x 8192) run as split-K tiles whose grid is
48 x 2 or 24 x 4 = 96 programs, so 36 of the H200's 132 SMs stream nothing (Nsight Compute,
deploy/RESULTS.md s19: o_proj and down at 47% and 58% SM activity), and a program streams at
only ~30-45 GB/s, so idle SMs are idle bandwidth. Ragged column groups fill the SMs but waste a
quarter of each tile's rows (s19: a loss). Stream-K instead flattens the work into
U = tiles x k_steps iterations (one iteration = one [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] MMA
of one column tile) and gives program p the contiguous run [p U // G, (p + 1) U // G) of them:
every program does the same number of full-width iterations, whatever G is.

A run may start or end inside a column tile's K range, so a tile's K range is covered by the
segments of 1 to S_MAX consecutive programs. Each segment stores its fp32 sum into its own slot
of the partials [S_MAX, M, N]: slot 0 for the segment that starts the tile, slot j for the one
that starts at the j-th program boundary inside it. Slots a tile does not use are written as
zeros (by the program that starts the tile), so the consumer, the add + RMSNorm that sums
`Partials` in slot order (runner/triton_fused_ops.py), needs no per-tile count: x + 0 == x
exactly. As with split-K, each partial is a fixed-order dot product over a fixed K range, the
partition depends on (N, K, tile, G) only, never on M or on the other rows, so graph padding and
eager steps give the same values, run to run.

The loop is one flat loop over the program's iterations (the tile index is u // k_steps), so
Triton's software pipeline keeps streaming weights across a tile boundary; the store and the
accumulator reset at a boundary sit in a branch inside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.gpu_info import num_sms
from runner.triton_linear import LinearTile
from runner.triton_pdl import pdl_trigger, pdl_wait


@triton.jit
def _owner(i, U, G):
    """The program whose run [p U // G, (p + 1) U // G) holds iteration i (largest p with
    p U // G <= i, i.e. p U < (i + 1) G)."""
    return ((i + 1) * G + U - 1) // U - 1


@triton.jit(do_not_specialize=["M"])
def _stream_k_kernel(
    x_ptr,  # [M, K] bf16/fp16, last dim contiguous, row stride stride_xm
    w_ptr,  # [N, K] weight (nn.Linear layout), row stride stride_wn
    parts_ptr,  # [S_MAX, M, N] fp32 out, contiguous
    M,
    N,
    stride_xm,
    stride_wn,
    U,  # iterations in all: cdiv(N, BLOCK_N) * KS
    KS,  # iterations per column tile: K // BLOCK_K
    G,  # programs along grid dim 0
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    S_MAX: tl.constexpr,  # most segments any column tile has (stream_k_slots)
    USE_GDC: tl.constexpr,
    LATE_TRIGGER: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # the K loop's software-pipeline depth (explicit: see the loop)
):
    p = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rows < M
    cols = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    u_lo = p * U // G
    u_hi = (p + 1) * U // G
    slot_stride = M.to(tl.int64) * N
    row_off = rows.to(tl.int64)[:, None] * N  # [BM, 1] into one partial
    pdl_wait(USE_GDC)
    if not LATE_TRIGGER:
        pdl_trigger(USE_GDC)

    # Tiles that start inside this run: their unused slots get zeros (written after the wait,
    # since the buffer may be memory an earlier kernel of the step still reads).
    for t_z in range(tl.cdiv(u_lo, KS), tl.cdiv(u_hi, KS)):
        segs = _owner((t_z + 1) * KS - 1, U, G) - p + 1  # programs whose runs meet tile t_z
        n_z = t_z * BLOCK_N + cols
        z_ptrs = parts_ptr + row_off + n_z[None, :]
        z_mask = m_mask[:, None] & (n_z < N)[None, :]
        for s in tl.static_range(1, S_MAX):
            if s >= segs:
                tl.store(z_ptrs + s * slot_stride, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), mask=z_mask)

    # slot of the run's first segment: 0 if it starts its tile, else the number of program
    # boundaries inside the tile up to here
    first_slot = p - _owner((u_lo // KS) * KS, U, G)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for u in tl.range(u_lo, u_hi, num_stages=NUM_STAGES):
        t = u // KS
        k0 = (u - t * KS) * BLOCK_K
        n_idx = t * BLOCK_N + cols
        n_mask = n_idx < N
        a = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptr + n_idx.to(tl.int64)[:, None] * stride_wn + (k0 + offs_k)[None, :], mask=n_mask[:, None],
                    other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        if ((u + 1) % KS == 0) | (u + 1 == u_hi):  # the segment ends: the tile's end or the run's
            slot = tl.where(t * KS >= u_lo, 0, first_slot)
            tl.store(parts_ptr + slot * slot_stride + row_off + n_idx[None, :], acc,
                     mask=m_mask[:, None] & n_mask[None, :])
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if LATE_TRIGGER:
        pdl_trigger(USE_GDC)


def stream_k_slots(n_tiles: int, k_steps: int, programs: int) -> int:
    """S_MAX: the most program runs that meet one column tile (the partials' slot count)."""
    u = n_tiles * k_steps

    def owner(i: int) -> int:
        return ((i + 1) * programs + u - 1) // u - 1

    return max(owner((t + 1) * k_steps - 1) - owner(t * k_steps) + 1 for t in range(n_tiles))


def stream_k_programs(n: int, k: int, tile: LinearTile, device: torch.device) -> int:
    """Programs of a stream-K launch: tile.groups if > 0, else one per SM of `device`; at most
    one per iteration."""
    iters = triton.cdiv(n, tile.block_n) * (k // tile.block_k)
    return max(1, min(tile.groups if tile.groups > 0 else num_sms(device), iters))


def stream_k_linear(x: torch.Tensor, weight: torch.Tensor, tile: LinearTile, *, pdl: bool = False) -> torch.Tensor:
    """x [M, K] @ W [N, K]^T as stream-K fp32 partials [S, M, N] whose sum in slot order is the
    product (slots a column tile does not use hold zeros), in one launch of
    `stream_k_programs` programs (`tile`: an MMA tile; its `groups`, if > 0, the program count,
    else one per SM). Reads only shapes on the host, so it can be captured in a CUDA graph."""
    m, kx = x.shape
    n, k = weight.shape
    assert kx == k and x.stride(1) == 1 and weight.stride(1) == 1, (x.shape, x.stride(), weight.shape)
    assert k % tile.block_k == 0 and tile.block_m > 1, (k, tile)
    n_tiles, k_steps = triton.cdiv(n, tile.block_n), k // tile.block_k
    g = stream_k_programs(n, k, tile, x.device)
    slots = stream_k_slots(n_tiles, k_steps, g)
    parts = torch.empty(slots, m, n, device=x.device, dtype=torch.float32)
    if m:
        _stream_k_kernel[(g, triton.cdiv(m, tile.block_m))](
            x, weight, parts, m, n, x.stride(0), weight.stride(0), n_tiles * k_steps, k_steps, g,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, S_MAX=slots, USE_GDC=pdl,
            LATE_TRIGGER=tile.late_trigger, NUM_STAGES=tile.num_stages, num_warps=tile.num_warps,
            num_stages=tile.num_stages, launch_pdl=pdl,
        )  # fmt: skip
    return parts
