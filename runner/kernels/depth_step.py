"""A depth decoder's sub-step as one persistent kernel (CUDA, Triton): every layer, the final
norm and the codebook's head for M <= 64 rows in one launch.

Why: a sub-step of CSM's depth decoder (4 layers, hidden 1024) reads ~226 MB of weights, 55 µs
at the H200's bandwidth, but ran as ~27 dependent launches (qkv, attention, o_proj, norms,
gate_up, down per layer; the head, the gather), each paying 2-6 µs of launch ramp and tail for
a few MB: ~145 µs at one row, 31 times a frame. Here the grid is one program per SM and the
phases are separated by a grid barrier instead of a kernel boundary; weights never depend on
the activations, so a program's first weight loads of a phase are in flight while it waits.

Phases (grid-wide barrier after each; phase index = layer * 5 + j, the head last):
  j = 0  qkv: RMSNorm(x) @ Wqkv^T with RoPE (and per-head q/k norms where the model has them) in
         the epilogue; q to scratch, k / v written to the layer's cache at slot row * KC + p
  j = 1  attention of each (row, kv head) over positions 0..p of its frame (at most KC keys)
  j = 2  o_proj, residual add: x = x + attn @ Wo^T (each program owns its columns)
  j = 3  RMSNorm(x) @ [Wgate | Wup]^T -> silu(gate) * up to scratch
  j = 4  down, residual add: x = x + act @ Wdown^T
  last   final RMSNorm(x) @ head^T -> the codebook's logits [M, V]
Layer 0's x is the sub-step's input (a row of the projected codebook table, gathered here from
the previous codebook's code): nothing copies it.

Numerics are the unfused path's (runner/models/llama.py with runner/kernels/fused_ops.py and
linear.py): GEMM outputs rounded to the model dtype, RMSNorm's roundings, `rope_pair`,
`silu_mul`, residual adds in fp32 rounded once. Only summation orders differ (a GEMM's K
chunks, a norm's tree), so values agree within a rounding, not bit for bit.

Barriers: a counter per sub-step (zeroed once per frame by the caller); a program arrives with
a release add and spins until all P programs have arrived, then acquires. It needs every
program resident at once: P <= the SM count, one program per SM (the launch checks the
compiled kernel's shared memory). Activations written in the kernel are read with ".cg" (L2,
never a stale L1 line). `SYNC=False` runs one phase per launch (no barrier): the Triton
interpreter (which runs programs one after another) and the A/B against the barrier.

Used only with RunnerConfig.depth_step "on" (an A/B switch): on the H200 its narrow GEMM
phases (16-column tiles with long K loops on 48-64 programs) stream weights well below the
tuned tiles' rate, and a sub-step is slower than the layer path at every row count. One row
goes to runner/kernels/depth_row.py (GEMVs), which the tuning table's `depth` section turns on
per shape; docs/performance.md has both kernels' per-phase figures
(python -m deploy.bench.depth_step).

Importing this module needs `triton` (CUDA, or the interpreter in tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from runner.kernels.depth_common import grid_sync, head_norm
from runner.kernels.depth_row import _depth_row_kernel
from runner.kernels.linear import silu_mul
from runner.kernels.rope import rope_pair

PHASES_PER_LAYER = 5
MAX_ROWS = 64


@triton.jit
def _row_bases(layer, rows, m_mask, table_ptr, stride_t, idx_ptr, stride_idx, idx_offset, x_ptr, stride_x):
    """[BM] pointers to each row's x: the gathered table row in layer 0, the residual stream after."""
    if layer == 0:
        code = tl.load(idx_ptr + rows * stride_idx, mask=m_mask, other=0).to(tl.int64) + idx_offset
        base = table_ptr + code * stride_t
    else:
        base = x_ptr + rows.to(tl.int64) * stride_x
    return base


@triton.jit
def _rstd(bases, m_mask, eps, H: tl.constexpr, BK: tl.constexpr):
    """[BM] fp32 1/rms of each row (RMSNorm's variance in fp32, as the norm kernel)."""
    offs = tl.arange(0, BK)
    ss = tl.zeros_like(m_mask.to(tl.float32))
    for k0 in tl.static_range(0, H, BK):  # unrolled: every chunk's load in flight at once
        x = tl.load(bases[:, None] + k0 + offs[None, :], mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
    return tl.math.rsqrt(ss / H + eps)


@triton.jit
def _gemm(bases, m_mask, w_ptr, stride_wn, n_a, half_off, n_mask, rstd, nw_ptr, acc_a, acc_b,
          K: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, NORM: tl.constexpr, PAIR: tl.constexpr):
    """acc_a += A @ W[n_a : n_a + BN]^T (and acc_b += A @ W[n_a + half_off ...]^T when PAIR),
    A = the rows at `bases` ([BM] pointers, K wide), RMSNorm'd with rstd and weight nw when NORM
    (the norm kernel's roundings: (x * rstd) in the model dtype, times the weight, rounded)."""
    offs_k = tl.arange(0, BK)
    cols = (n_a + tl.arange(0, BN)).to(tl.int64)
    wa = w_ptr + cols[:, None] * stride_wn + offs_k[None, :]
    wb = wa + half_off * stride_wn
    for k0 in range(0, K, BK):
        a = tl.load(bases[:, None] + k0 + offs_k[None, :], mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
        if NORM:
            dt = a.dtype
            nw = tl.load(nw_ptr + k0 + offs_k).to(tl.float32)
            a = (nw[None, :] * (a.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32)).to(dt)
        w = tl.load(wa + k0, mask=n_mask[:, None], other=0.0)
        acc_a = tl.dot(a, tl.trans(w), acc_a)
        if PAIR:
            w2 = tl.load(wb + k0, mask=n_mask[:, None], other=0.0)
            acc_b = tl.dot(a, tl.trans(w2), acc_b)
    return acc_a, acc_b


@triton.jit
def _depth_step_kernel(
    table_ptr, stride_t,  # [rows, H] the projected codebook table
    idx_ptr, stride_idx, idx_offset,  # [M] the previous codebook's codes (a frames column), its table offset
    x_ptr,  # [R, H] the residual stream (scratch)
    q_ptr,  # [R, HQ * D] scratch
    attn_ptr,  # [R, HQ * D] scratch
    act_ptr,  # [R, I] scratch
    logits_ptr,  # [R, V] out
    wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr,  # [L, ...] stacked layer weights, row-major
    ln1_ptr, ln2_ptr, qn_ptr, kn_ptr,  # [L, H], [L, H], [L, D], [L, D]
    norm_ptr, head_ptr,  # [H], [V, H] this codebook's head
    kv_ptr,  # [L, 2, R * KC, HKV, D] the depth KV
    cos_ptr, sin_ptr,  # [P, D] fp32 RoPE rows
    counter_ptr,  # int32: this sub-step's barrier
    M, pos, V, first_phase, last_phase, eps, scale_log2e,
    stride_kvl, stride_kv, stride_cos,
    LAYERS: tl.constexpr, H: tl.constexpr, I: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr, KC: tl.constexpr, SB: tl.constexpr, GP: tl.constexpr, QK_NORM: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, BKQ: tl.constexpr, BKO: tl.constexpr, BKG: tl.constexpr,
    BKD: tl.constexpr, BKH: tl.constexpr, BNQ: tl.constexpr, BNO: tl.constexpr, BNG: tl.constexpr,
    BND: tl.constexpr, BNH: tl.constexpr, SYNC: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = HEAD_DIM // 2
    PARTS: tl.constexpr = HALF // BNQ
    QW: tl.constexpr = HQ * HEAD_DIM
    NQKV: tl.constexpr = (HQ + 2 * HKV) * HEAD_DIM
    G: tl.constexpr = HQ // HKV
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, BM)
    m_mask = rows < M
    rows64 = rows.to(tl.int64)
    slot = rows64 * KC + pos  # [BM] this position's cache slot of each row
    for ph in range(first_phase, last_phase + 1):
        layer = ph // 5
        j = ph % 5
        if layer == LAYERS:  # ---- final norm + this codebook's head -> logits [M, V]
            bases = x_ptr + rows64 * H
            rstd = _rstd(bases, m_mask, eps, H, BK)
            for t in range(pid, tl.cdiv(V, BNH), nprog):
                n0 = t * BNH
                cols = n0 + tl.arange(0, BNH)
                zero = tl.zeros([BM, BNH], tl.float32)
                acc, _ = _gemm(bases, m_mask, head_ptr, H, n0, 0, cols < V, rstd, norm_ptr, zero, zero,
                               H, BKH, BNH, True, False)
                tl.store(logits_ptr + rows64[:, None] * V + cols[None, :], acc.to(logits_ptr.dtype.element_ty),
                         mask=m_mask[:, None] & (cols < V)[None, :])
        elif j == 0:  # ---- qkv + RoPE (+ q/k norms), k / v into the cache
            bases = _row_bases(layer, rows, m_mask, table_ptr, stride_t, idx_ptr, stride_idx, idx_offset, x_ptr, H)
            rstd = _rstd(bases, m_mask, eps, H, BK)
            w = wqkv_ptr + layer * NQKV * H
            for t in range(pid, (HQ + 2 * HKV) * PARTS, nprog):
                head = t // PARTS
                part = t % PARTS
                n_a = head * HEAD_DIM + part * BNQ
                pc = part * BNQ + tl.arange(0, BNQ)  # [BNQ] columns within the head's first half
                zero = tl.zeros([BM, BNQ], tl.float32)
                acc_a, acc_b = _gemm(bases, m_mask, w, H, n_a, HALF, pc >= 0, rstd, ln1_ptr + layer * H, zero,
                                     zero, H, BKQ, BNQ, True, True)
                xa = acc_a.to(x_ptr.dtype.element_ty)
                xb = acc_b.to(x_ptr.dtype.element_ty)
                if head < HQ + HKV:
                    if QK_NORM:  # whole heads per program (BNQ == D / 2)
                        if head < HQ:
                            xa, xb = head_norm(xa, xb, qn_ptr + layer * HEAD_DIM, pc, HALF, eps, HEAD_DIM)
                        else:
                            xa, xb = head_norm(xa, xb, kn_ptr + layer * HEAD_DIM, pc, HALF, eps, HEAD_DIM)
                    c = tl.load(cos_ptr + pos * stride_cos + pc).to(xa.dtype).to(tl.float32)
                    s = tl.load(sin_ptr + pos * stride_cos + pc).to(xa.dtype).to(tl.float32)
                    xa, xb = rope_pair(xa, xb, c[None, :], s[None, :], True)
                mask = m_mask[:, None]
                if head < HQ:
                    dst = q_ptr + rows64[:, None] * QW + n_a + tl.arange(0, BNQ)[None, :]
                    tl.store(dst, xa, mask=mask)
                    tl.store(dst + HALF, xb, mask=mask)
                else:
                    kvh = (head - HQ) % HKV
                    base = kv_ptr + layer * stride_kvl + kvh * HEAD_DIM + pc
                    if head >= HQ + HKV:
                        base += stride_kv
                    dst = base[None, :] + slot[:, None] * (HKV * HEAD_DIM)
                    tl.store(dst, xa, mask=mask)
                    tl.store(dst + HALF, xb, mask=mask)
        elif j == 1:  # ---- attention: one (row, kv head) per item, keys 0..pos of the row's frame
            kv = kv_ptr + layer * stride_kvl
            offs_g = tl.arange(0, GP)
            offs_s = tl.arange(0, SB)
            offs_d = tl.arange(0, HEAD_DIM)
            s_mask = offs_s <= pos
            for t in range(pid, M * HKV, nprog):
                r = t // HKV
                kvh = t % HKV
                qh = kvh * G + offs_g  # [GP] query heads of this kv head
                q = tl.load(q_ptr + r * QW + qh[:, None] * HEAD_DIM + offs_d[None, :],
                            mask=(offs_g < G)[:, None], other=0.0, cache_modifier=".cg")
                kvo = (r * KC + offs_s)[:, None] * (HKV * HEAD_DIM) + kvh * HEAD_DIM + offs_d[None, :]
                k = tl.load(kv + kvo, mask=s_mask[:, None], other=0.0, cache_modifier=".cg")
                v = tl.load(kv + stride_kv + kvo, mask=s_mask[:, None], other=0.0, cache_modifier=".cg")
                sc = tl.dot(q, tl.trans(k)) * scale_log2e  # [GP, SB] fp32
                sc = tl.where(s_mask[None, :], sc, float("-inf"))
                mx = tl.max(sc, 1)
                pr = tl.exp2(sc - mx[:, None])
                den = tl.sum(pr, 1)
                o = tl.dot(pr.to(v.dtype), v) / den[:, None]
                tl.store(attn_ptr + r * QW + qh[:, None] * HEAD_DIM + offs_d[None, :],
                         o.to(attn_ptr.dtype.element_ty), mask=(offs_g < G)[:, None])
        elif j == 2:  # ---- o_proj + residual
            res = _row_bases(layer, rows, m_mask, table_ptr, stride_t, idx_ptr, stride_idx, idx_offset, x_ptr, H)
            _residual_gemm(attn_ptr + rows64 * QW, res, wo_ptr + layer * H * QW, x_ptr, rows64, m_mask, pid, nprog,
                           H, QW, BM, BKO, BNO)
        elif j == 3:  # ---- RMSNorm + gate_up + SiLU*mul
            bases = x_ptr + rows64 * H
            rstd = _rstd(bases, m_mask, eps, H, BK)
            w = wgu_ptr + layer * 2 * I * H
            for t in range(pid, I // BNG, nprog):
                n0 = t * BNG
                cols = n0 + tl.arange(0, BNG)
                zero = tl.zeros([BM, BNG], tl.float32)
                g, u = _gemm(bases, m_mask, w, H, n0, I, cols >= 0, rstd, ln2_ptr + layer * H, zero, zero,
                             H, BKG, BNG, True, True)
                dt = act_ptr.dtype.element_ty
                y = silu_mul(g.to(dt), u.to(dt))
                tl.store(act_ptr + rows64[:, None] * I + cols[None, :], y, mask=m_mask[:, None])
        else:  # ---- down + residual
            _residual_gemm(act_ptr + rows64 * I, x_ptr + rows64 * H, wd_ptr + layer * H * I, x_ptr, rows64, m_mask,
                           pid, nprog, H, I, BM, BKD, BND)
        if SYNC:
            if ph < last_phase:
                grid_sync(counter_ptr, (ph - first_phase + 1) * nprog)


@triton.jit
def _residual_gemm(a_bases, res_bases, w, x_ptr, rows64, m_mask, pid, nprog, H: tl.constexpr, K: tl.constexpr,
                   BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """o_proj and down: x = res + A @ W^T (W [H, K]), BN columns a program."""
    for t in range(pid, H // BN, nprog):
        n0 = t * BN
        cols = n0 + tl.arange(0, BN)
        zero = tl.zeros([BM, BN], tl.float32)
        acc, _ = _gemm(a_bases, m_mask, w, K, n0, 0, cols >= 0, zero, w, zero, zero, K, BK, BN, False, False)
        _residual_store(acc, res_bases, x_ptr, rows64, cols, m_mask, H)


@triton.jit
def _residual_store(acc, res_bases, x_ptr, rows64, cols, m_mask, H: tl.constexpr):
    """x[:, cols] = res[:, cols] + acc, the GEMM's output rounded first, the sum rounded once
    (the add_rmsnorm kernel's `x + residual`)."""
    dt = x_ptr.dtype.element_ty
    res = tl.load(res_bases[:, None] + cols[None, :], mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
    y = (acc.to(dt).to(tl.float32) + res.to(tl.float32)).to(dt)
    tl.store(x_ptr + rows64[:, None] * H + cols[None, :], y, mask=m_mask[:, None])


@dataclass(frozen=True)
class StepTiles:
    """Block sizes of one row bucket: rows BM (M <= BM); per GEMM (qkv, o_proj, gate_up, down,
    head) its K chunk and its columns per program (qkv and gate_up: per half). The K chunks are
    wide where the columns are few, so each program keeps ~16-32 KB of weights in flight a stage
    (one program per SM streams a sixth of the bandwidth a 16 KB stage gives)."""

    block_m: int
    block_k: int  # the norms' row chunk
    qkv_k: int
    o_k: int
    gate_up_k: int
    down_k: int
    head_k: int
    qkv_n: int
    o_n: int = 16
    gate_up_n: int = 64
    down_n: int = 16
    head_n: int = 16
    num_warps: int = 8
    num_stages: int = 3


def _chunk(preferred: int, k: int) -> int:
    """The K chunk: `preferred`, or the largest power of two dividing k when that is smaller."""
    return min(preferred, k & -k)


def step_tiles(rows: int, hidden: int, q_width: int, inter: int, head_dim: int, qk_norm: bool) -> StepTiles:
    """The tiles for `rows` (<= MAX_ROWS): whole heads per qkv program where a per-head norm
    needs them; the A operand's chunk (BM x K) shrinks the K chunks as rows grow."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"depth step kernel: {rows} rows (1..{MAX_ROWS})")
    bm = 16 if rows <= 16 else 32 if rows <= 32 else 64
    # K chunks (qkv, gate_up, the rest) by BM: ~16-32 KB of weights and A a stage
    qkv_k, gate_up_k, wide = {16: (256, 128, 512), 32: (128, 128, 256), 64: (64, 64, 128)}[bm]
    return StepTiles(bm, _chunk(128, hidden), qkv_k=_chunk(qkv_k, hidden), o_k=_chunk(wide, q_width),
                     gate_up_k=_chunk(gate_up_k, hidden), down_k=_chunk(wide, inter), head_k=_chunk(wide, hidden),
                     qkv_n=head_dim // 2 if qk_norm else 16)


# depth_row.py's GEMV tiles at one row: output rows per program (qkv, o_proj, gate_up per half,
# down, head) and the K chunks gate_up and down stream (qkv, o_proj and the head take K whole).
# gate_up None: row_gate_up's rule
ROW_TILES = dict(qkv_n=16, o_n=8, gate_up_n=None, gate_up_k=None, down_n=8, down_k=2048, head_n=16)


def row_gate_up(inter: int, tiles: dict = ROW_TILES) -> tuple[int, int]:
    """gate_up's (rows per half, K chunk) at one row: the widest of 64 / 32 / 16 rows that still
    gives ~128 programs a tile, with a 16 KB chunk per half (CSM's I = 8192: 64 x 128; Qwen3-TTS's
    3072: 16 x 512; measured on the H200, docs/performance.md)."""
    n = tiles["gate_up_n"] or next((b for b in (64, 32) if inter // b >= 128), 16)
    return n, tiles["gate_up_k"] or 8192 // n


def row_tiles(hidden: int, inter: int, tiles: dict = ROW_TILES) -> dict[str, int]:
    """depth_row.py's tile constexprs for these widths: `tiles` (ROW_TILES' keys; a benchmark
    passes variants), row_gate_up's rule, and K chunks that divide K (what the launch passes and
    the offline compile test compiles)."""
    bng, kcg = row_gate_up(inter, tiles)
    return dict(BNQ=tiles["qkv_n"], BNO=tiles["o_n"], BNG=bng, KCG=_chunk(kcg, hidden),
                BND=tiles["down_n"], KCD=_chunk(tiles["down_k"], inter), BNH=tiles["head_n"])


def row_fits(hidden: int, inter: int, q_width: int) -> bool:
    """Whether one row runs depth_row.py's kernel: the whole-K tiles (hidden, Hq * D) are
    powers of two, and each GEMV's rows divide its width."""
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    return pow2(hidden) and pow2(q_width) and inter % row_gate_up(inter)[0] == 0 and _chunk(2048, inter) >= 16


def fits(hidden: int, inter: int, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether a depth decoder of these widths fits the kernel's tiles at every row bucket:
    every dot at least 16 wide, head halves in whole 16-column blocks, gate_up in 64-column
    blocks, every K chunk at least 16."""
    pow2 = head_dim >= 32 and head_dim & (head_dim - 1) == 0
    if not (pow2 and num_heads % num_kv_heads == 0 and hidden % 16 == 0 and inter % 64 == 0):
        return False
    for rows in (16, 32, 64):
        t = step_tiles(rows, hidden, num_heads * head_dim, inter, head_dim, False)
        if min(t.block_k, t.qkv_k, t.o_k, t.gate_up_k, t.down_k, t.head_k) < 16:
            return False
    return True


@dataclass(frozen=True)
class StepWeights:
    """A depth decoder's weights in the kernel's layout: each kind stacked over layers [L, ...]
    (the modules' parameters are re-pointed to views of these, so nothing is held twice)."""

    qkv: torch.Tensor  # [L, (Hq + 2 Hkv) D, H]
    o: torch.Tensor  # [L, H, Hq D]
    gate_up: torch.Tensor  # [L, 2 I, H]: gate rows, then up rows
    down: torch.Tensor  # [L, H, I]
    ln1: torch.Tensor  # [L, H]
    ln2: torch.Tensor  # [L, H]
    q_norm: torch.Tensor  # [L, D] (ones where the model has none: never read then)
    k_norm: torch.Tensor  # [L, D]
    norm: torch.Tensor  # [H]
    heads: torch.Tensor  # [K - 1, V, H]


class StepScratch:
    """The kernel's activations for up to MAX_ROWS rows and one barrier counter per sub-step,
    allocated once (a CUDA graph replays with these addresses)."""

    def __init__(self, hidden: int, q_width: int, inter: int, vocab: int, num_codebooks: int,
                 device: torch.device | str, dtype: torch.dtype):
        r = MAX_ROWS
        self.x = torch.zeros(r, hidden, device=device, dtype=dtype)
        self.q = torch.zeros(r, q_width, device=device, dtype=dtype)
        self.attn = torch.zeros(r, q_width, device=device, dtype=dtype)
        self.act = torch.zeros(r, inter, device=device, dtype=dtype)
        self.logits = torch.zeros(r, vocab, device=device, dtype=dtype)
        self.counters = torch.zeros(num_codebooks, device=device, dtype=torch.int32)


class StepKernel(NamedTuple):
    """What a depth decoder keeps to launch the kernels: its stacked weights, the scratch, the
    grid (one program per SM on CUDA) and whether one launch synchronises itself (CUDA) or runs
    a launch per phase (the interpreter)."""

    weights: StepWeights
    scratch: StepScratch
    programs: int
    sync: bool


def depth_step(
    w: StepWeights,
    s: StepScratch,
    kv: torch.Tensor,  # [L, 2, R, KC, Hkv, D] the depth KV (DepthKV.stacked)
    table: torch.Tensor,  # [rows, H] the projected codebook table
    codes: torch.Tensor,  # [M] int64 view: the previous codebook's codes (a frames column)
    code_offset: int,  # its table offset
    position: int,  # this sub-step's position p (2 <= p < KC): writes slot p, gives codebook p
    cos: torch.Tensor,  # [P, D] fp32 RoPE rows
    sin: torch.Tensor,
    eps: float,
    num_q_heads: int,
    qk_norm: bool,
    programs: int,  # the grid: at most the SM count (every program resident for the barrier)
    *,
    sync: bool = True,
    only: list[int] | None = None,
    tiles: dict = ROW_TILES,
) -> torch.Tensor:
    """The depth decoder at `position` for M rows -> codebook `position`'s logits [M, V] (a view
    of the scratch, overwritten by the next sub-step). Reads only shapes on the host
    (capturable). sync=False: one launch per phase (module docstring), of the phases `only`
    names when given (a benchmark's phase kind alone). tiles: the one-row kernel's
    (ROW_TILES' keys; a benchmark's variants)."""
    m = codes.shape[0]
    layers, _, rows, kc, hkv, d = kv.shape
    hidden, inter, vocab = w.qkv.shape[2], w.down.shape[2], w.heads.shape[1]
    row = m == 1 and row_fits(hidden, inter, num_q_heads * d)
    t = step_tiles(m, hidden, num_q_heads * d, inter, d, qk_norm)
    assert 2 <= position < kc and m <= rows and codes.dtype == torch.int64, (position, kc, m, rows)
    assert w.qkv.shape[1] == (num_q_heads + 2 * hkv) * d and hidden % t.o_n == 0 and inter % t.gate_up_n == 0
    assert table.dtype == w.qkv.dtype == kv.dtype == s.x.dtype and cos.dtype == sin.dtype == torch.float32
    assert kv.is_contiguous() and cos.stride() == sin.stride() and cos.stride(1) == 1
    flat = kv.view(layers, 2, rows * kc, hkv, d)
    group = num_q_heads // hkv
    phases = layers * PHASES_PER_LAYER + 1
    assert only is None or not sync
    spans = [(0, phases - 1)] if sync else [(ph, ph) for ph in (range(phases) if only is None else only)]
    for first, last in spans:
        if row:
            _depth_row_kernel[(programs,)](
                table, table.stride(0), codes, code_offset,
                s.x, s.q, s.attn, s.act, s.logits,
                w.qkv, w.o, w.gate_up, w.down, w.ln1, w.ln2, w.q_norm, w.k_norm, w.norm, w.heads[position - 1],
                flat, cos, sin, s.counters[position],
                position, vocab, first, last, eps, d**-0.5 * 1.4426950408889634,
                flat.stride(0), flat.stride(1), cos.stride(0),
                LAYERS=layers, H=hidden, I=inter, HQ=num_q_heads, HKV=hkv, HEAD_DIM=d,
                SB=max(16, triton.next_power_of_2(kc)), GP=max(16, triton.next_power_of_2(group)), QK_NORM=qk_norm,
                **row_tiles(hidden, inter, tiles), SYNC=sync, num_warps=8, num_stages=1, launch_cooperative_grid=sync,
            )  # fmt: skip
            continue
        _depth_step_kernel[(programs,)](
            table, table.stride(0), codes, codes.stride(0), code_offset,
            s.x, s.q, s.attn, s.act, s.logits,
            w.qkv, w.o, w.gate_up, w.down, w.ln1, w.ln2, w.q_norm, w.k_norm, w.norm, w.heads[position - 1],
            flat, cos, sin, s.counters[position],
            m, position, vocab, first, last, eps, d**-0.5 * 1.4426950408889634,
            flat.stride(0), flat.stride(1), cos.stride(0),
            LAYERS=layers, H=hidden, I=inter, HQ=num_q_heads, HKV=hkv, HEAD_DIM=d, KC=kc,
            SB=max(16, triton.next_power_of_2(kc)), GP=max(16, triton.next_power_of_2(group)), QK_NORM=qk_norm,
            BM=t.block_m, BK=t.block_k, BKQ=t.qkv_k, BKO=t.o_k, BKG=t.gate_up_k, BKD=t.down_k, BKH=t.head_k,
            BNQ=t.qkv_n, BNO=t.o_n, BNG=t.gate_up_n, BND=t.down_n, BNH=t.head_n,
            SYNC=sync, num_warps=t.num_warps, num_stages=t.num_stages, launch_cooperative_grid=sync,
        )  # fmt: skip
    return s.logits[:m]
