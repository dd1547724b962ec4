"""runner/kernels/depth_step.py's sub-step for one row (batch 1), as GEMVs whose first weight
chunks are loaded before the grid barrier (CUDA, Triton).

Why a kernel of its own: at one row every phase is latency-bound, and a phase costs at least a
DRAM round trip for its weights after the barrier opens. Weights never depend on the
activations, so each program loads the weights of its first tile of the next phase (all of them
where a tile fits in registers: qkv, o_proj, the head; the first K chunk of gate_up and down)
*before* it waits at the barrier: the round trip overlaps the other programs finishing the
phase. Each GEMV spreads K over all the program's warps (a tile of output rows x a K chunk,
reduced with tl.sum), and gate_up / down stream their K chunks double-buffered in registers
(the next chunk's load issued before the current chunk's FMAs). gate_up is one GEMV over the
gate and up rows interleaved: both halves share one stream of 32 KB chunks, twice what each
half had in flight alone.

Phases (phase index = layer * 5 + j, the head last; the barrier sits at the start of each
phase but the launch's first):
  j = 0  qkv: RMSNorm(x) @ Wqkv^T; q to scratch, k / v (not yet rotated) into the layer's cache
  j = 1  per kv head: q and this position's k normed (Qwen3) and rotated, k written back, then
         attention over positions 0..p (the past keys / values loaded before the barrier)
  j = 2  o_proj, residual add
  j = 3  RMSNorm(x) @ [Wgate | Wup]^T -> silu(gate) * up
  j = 4  down, residual add
  last   final RMSNorm(x) @ head^T -> logits [V]
Numerics as depth_step.py's (the same roundings; q/k norms and RoPE of the attention phase are
the qkv epilogue's, moved).

Importing this module needs `triton` (CUDA, or the interpreter in tests).
"""

from __future__ import annotations

import triton
import triton.language as tl

from runner.kernels.depth_common import grid_sync, head_norm
from runner.kernels.linear import silu_mul
from runner.kernels.rope import rope_pair


@triton.jit
def _w_tile(w_ptr, rows, mask, k0, K: tl.constexpr, KC: tl.constexpr):
    """W[rows, k0 : k0 + KC] of a row-major [N, K] weight ([BN, KC]; masked rows read nothing)."""
    offs = k0 + tl.arange(0, KC)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + offs[None, :], mask=mask[:, None], other=0.0)


@triton.jit
def _x_raw(x_ptr, nw_ptr, k0, KC: tl.constexpr, NORM: tl.constexpr):
    """x[k0 : k0 + KC] as stored, and the norm weight's chunk when NORM (loads only: _x_use
    finishes them, an iteration later)."""
    offs = k0 + tl.arange(0, KC)
    x = tl.load(x_ptr + offs, cache_modifier=".cg")
    if NORM:
        nw = tl.load(nw_ptr + offs)
    else:
        nw = x
    return x, nw


@triton.jit
def _x_use(x, nw, rstd, NORM: tl.constexpr):
    """The chunk in fp32, RMSNorm'd (the norm kernel's roundings) when NORM."""
    if NORM:
        dt = x.dtype
        x = (nw.to(tl.float32) * (x.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)
    return x.to(tl.float32)


@triton.jit
def _dot(acc, w, x, nw, rstd, NORM: tl.constexpr):
    return acc + tl.sum(w.to(tl.float32) * _x_use(x, nw, rstd, NORM)[None, :], axis=1)


@triton.jit
def _gemv(w_first, w_ptr, rows, mask, x_ptr, rstd, nw_ptr, K: tl.constexpr, KC: tl.constexpr, NORM: tl.constexpr):
    """[BN] fp32 W[rows] . x, w_first = W[rows, 0 : KC] already loaded. Every iteration issues
    the next chunk's loads (weights and x) before the current chunk's products, so no chunk
    waits on a load of its own. (Two or three chunks in flight ran slower on the H200: the
    buffers spill, docs/performance.md.)"""
    acc = tl.zeros_like(rows.to(tl.float32))
    w = w_first
    x, nw = _x_raw(x_ptr, nw_ptr, 0, KC, NORM)
    for k0 in range(KC, K, KC):
        w_next = _w_tile(w_ptr, rows, mask, k0, K, KC)
        x_next, nw_next = _x_raw(x_ptr, nw_ptr, k0, KC, NORM)
        acc += tl.sum(w.to(tl.float32) * _x_use(x, nw, rstd, NORM)[None, :], axis=1)
        w, x, nw = w_next, x_next, nw_next
    acc += tl.sum(w.to(tl.float32) * _x_use(x, nw, rstd, NORM)[None, :], axis=1)
    return acc


@triton.jit
def _row_rstd(x_ptr, eps, H: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, H), cache_modifier=".cg").to(tl.float32)
    return tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)


@triton.jit
def _barrier(counter_ptr, target, WAIT):
    if WAIT:
        grid_sync(counter_ptr, target)


@triton.jit
def _head_phase(x_ptr, norm_ptr, head_ptr, logits_ptr, V, eps, counter_ptr, target, wait, pid, nprog,
                H: tl.constexpr, BNH: tl.constexpr):
    """Final norm + this codebook's head -> logits [V]."""
    rows0 = pid * BNH + tl.arange(0, BNH)
    w0 = _w_tile(head_ptr, rows0, rows0 < V, 0, H, H)
    _barrier(counter_ptr, target, wait)
    rstd = _row_rstd(x_ptr, eps, H)
    for t in range(pid, tl.cdiv(V, BNH), nprog):
        rows = t * BNH + tl.arange(0, BNH)
        if t != pid:
            w0 = _w_tile(head_ptr, rows, rows < V, 0, H, H)
        acc = _gemv(w0, head_ptr, rows, rows < V, x_ptr, rstd, norm_ptr, H, H, True)
        tl.store(logits_ptr + rows, acc.to(logits_ptr.dtype.element_ty), mask=rows < V)


@triton.jit
def _qkv_phase(xb, w, nw, q_ptr, kv, stride_kv, pos, eps, counter_ptr, target, wait, pid, nprog,
               H: tl.constexpr, QW: tl.constexpr, KW: tl.constexpr, BNQ: tl.constexpr):
    """RMSNorm(x) @ Wqkv^T: q to scratch, k / v (not rotated yet) into the cache at `pos`."""
    NQKV: tl.constexpr = QW + 2 * KW
    rows0 = pid * BNQ + tl.arange(0, BNQ)
    w0 = _w_tile(w, rows0, rows0 < NQKV, 0, H, H)
    _barrier(counter_ptr, target, wait)
    rstd = _row_rstd(xb, eps, H)
    for t in range(pid, NQKV // BNQ, nprog):
        rows = t * BNQ + tl.arange(0, BNQ)
        if t != pid:
            w0 = _w_tile(w, rows, rows < NQKV, 0, H, H)
        y = _gemv(w0, w, rows, rows < NQKV, xb, rstd, nw, H, H, True).to(q_ptr.dtype.element_ty)
        c0 = t * BNQ  # a tile lies within one head (BNQ divides HEAD_DIM)
        if c0 < QW:
            tl.store(q_ptr + rows, y)
        else:
            is_v = c0 >= QW + KW
            col = rows - QW - tl.where(is_v, KW, 0)  # kv head * D + d
            tl.store(kv + tl.where(is_v, stride_kv, 0) + pos * KW + col, y.to(kv.dtype.element_ty))


@triton.jit
def _past_kv(kv, stride_kv, kvh, pos, KW: tl.constexpr, HEAD_DIM: tl.constexpr, SB: tl.constexpr):
    """Head kvh's keys (halves) and values at positions 0..pos-1 ([SB, D/2] x2, [SB, D]; zero
    from pos on): written by earlier sub-steps, so loadable before this one's barrier."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_s = tl.arange(0, SB)
    kr = kv + offs_s[:, None] * KW + kvh * HEAD_DIM  # [SB, 1] row bases
    past = (offs_s < pos)[:, None]
    k_a = tl.load(kr + tl.arange(0, HALF)[None, :], mask=past, other=0.0, cache_modifier=".cg")
    k_b = tl.load(kr + HALF + tl.arange(0, HALF)[None, :], mask=past, other=0.0, cache_modifier=".cg")
    vv = tl.load(kr + stride_kv + tl.arange(0, HEAD_DIM)[None, :], mask=past, other=0.0, cache_modifier=".cg")
    return k_a, k_b, vv


@triton.jit
def _attention_phase(q_ptr, kv, stride_kv, attn_ptr, qn, kn, cos_ptr, sin_ptr, stride_cos, pos, eps, scale_log2e,
                     counter_ptr, target, wait, pid, nprog, HQ: tl.constexpr, HKV: tl.constexpr,
                     HEAD_DIM: tl.constexpr, SB: tl.constexpr, GP: tl.constexpr, QK_NORM: tl.constexpr):
    """Per kv head: q and this position's k normed (Qwen3) and rotated, k written back, then
    attention over positions 0..pos. The past keys and values are loaded before the barrier;
    position pos's k and v (this sub-step's qkv phase) after it, and put in their row in
    registers (the k that is written back, so the cache is never read back here)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    KW: tl.constexpr = HKV * HEAD_DIM
    G: tl.constexpr = HQ // HKV
    # (a program past the kv heads loads nothing: no position lies below 0)
    k_a, k_b, vv = _past_kv(kv, stride_kv, tl.minimum(pid, HKV - 1), tl.where(pid < HKV, pos, 0), KW, HEAD_DIM, SB)
    _barrier(counter_ptr, target, wait)
    dt = q_ptr.dtype.element_ty
    offs_g = tl.arange(0, GP)
    offs_h = tl.arange(0, HALF)
    offs_s = tl.arange(0, SB)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = (offs_g < G)[:, None]
    at_pos = (offs_s == pos)[:, None]
    c = tl.load(cos_ptr + pos * stride_cos + offs_h).to(dt).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + offs_h).to(dt).to(tl.float32)[None, :]
    for kvh in range(pid, HKV, nprog):
        if kvh != pid:
            k_a, k_b, vv = _past_kv(kv, stride_kv, kvh, pos, KW, HEAD_DIM, SB)
        # this position's k: (norm,) rotate, write back for the later sub-steps
        kp = kv + pos * KW + kvh * HEAD_DIM + offs_h[None, :]  # [1, HALF]
        ka = tl.load(kp, cache_modifier=".cg")
        kb = tl.load(kp + HALF, cache_modifier=".cg")
        v_pos = tl.load(kv + stride_kv + pos * KW + kvh * HEAD_DIM + offs_d[None, :], cache_modifier=".cg")
        qp = q_ptr + (kvh * G + offs_g)[:, None] * HEAD_DIM + offs_h[None, :]  # [GP, HALF]
        qa = tl.load(qp, mask=g_mask, other=0.0, cache_modifier=".cg")
        qb = tl.load(qp + HALF, mask=g_mask, other=0.0, cache_modifier=".cg")
        if QK_NORM:
            ka, kb = head_norm(ka, kb, kn, offs_h, HALF, eps, HEAD_DIM)
            qa, qb = head_norm(qa, qb, qn, offs_h, HALF, eps, HEAD_DIM)
        ka, kb = rope_pair(ka, kb, c, s, True)
        qa, qb = rope_pair(qa, qb, c, s, True)
        tl.store(kp, ka)
        tl.store(kp + HALF, kb)
        cur_a = tl.where(at_pos, ka, k_a)  # [SB, HALF]
        cur_b = tl.where(at_pos, kb, k_b)
        cur_v = tl.where(at_pos, v_pos, vv)  # [SB, D]
        sc = (tl.dot(qa, tl.trans(cur_a)) + tl.dot(qb, tl.trans(cur_b))) * scale_log2e  # [GP, SB] fp32
        sc = tl.where((offs_s <= pos)[None, :], sc, float("-inf"))
        pr = tl.exp2(sc - tl.max(sc, 1)[:, None])
        o = tl.dot(pr.to(cur_v.dtype), cur_v) / tl.sum(pr, 1)[:, None]
        dst = attn_ptr + (kvh * G + offs_g)[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(dst, o.to(attn_ptr.dtype.element_ty), mask=g_mask)


@triton.jit
def _residual_phase(a_ptr, w, res, x_ptr, counter_ptr, target, wait, pid, nprog,
                    H: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, KC: tl.constexpr):
    """o_proj or down: x = res + a @ W^T (W [H, K]; K streamed in KC chunks)."""
    rows0 = pid * BN + tl.arange(0, BN)
    w0 = _w_tile(w, rows0, rows0 < H, 0, K, KC)
    _barrier(counter_ptr, target, wait)
    dt = x_ptr.dtype.element_ty
    for t in range(pid, H // BN, nprog):
        rows = t * BN + tl.arange(0, BN)
        if t != pid:
            w0 = _w_tile(w, rows, rows < H, 0, K, KC)
        y = _gemv(w0, w, rows, rows < H, a_ptr, 0.0, w, K, KC, False).to(dt)
        r = tl.load(res + rows, cache_modifier=".cg")
        tl.store(x_ptr + rows, (y.to(tl.float32) + r.to(tl.float32)).to(dt))


@triton.jit
def _gate_up_rows(t, BNG: tl.constexpr, I: tl.constexpr):
    """Tile t's weight rows of [Wgate | Wup], interleaved ([2 BNG]: gate r, up r, gate r + 1, ...),
    so one GEMV streams both halves and its result splits into (gate, up) by a reshape; and
    whether the tile exists (t < I / BNG: every row, else none)."""
    r = t * BNG + tl.arange(0, BNG)
    rows = tl.reshape(r[:, None] + (tl.arange(0, 2) * I)[None, :], (2 * BNG,))
    return rows, tl.reshape((r[:, None] < I) & (tl.arange(0, 2) < 2)[None, :], (2 * BNG,))


@triton.jit
def _gate_up_phase(x_ptr, w, nw, act_ptr, eps, counter_ptr, target, wait, pid, nprog,
                   H: tl.constexpr, I: tl.constexpr, BNG: tl.constexpr, KCG: tl.constexpr):
    """RMSNorm(x) @ [Wgate | Wup]^T -> silu(gate) * up (the gated epilogue's roundings)."""
    rows0, mask0 = _gate_up_rows(pid, BNG, I)
    w0 = _w_tile(w, rows0, mask0, 0, H, KCG)  # (a tile past I / BNG loads nothing)
    _barrier(counter_ptr, target, wait)
    rstd = _row_rstd(x_ptr, eps, H)
    dt = act_ptr.dtype.element_ty
    for t in range(pid, I // BNG, nprog):
        rows, mask = _gate_up_rows(t, BNG, I)
        if t != pid:
            w0 = _w_tile(w, rows, mask, 0, H, KCG)
        gu = _gemv(w0, w, rows, mask, x_ptr, rstd, nw, H, KCG, True)
        g, u = tl.split(tl.reshape(gu, (BNG, 2)))
        tl.store(act_ptr + t * BNG + tl.arange(0, BNG), silu_mul(g.to(dt), u.to(dt)))


@triton.jit
def _depth_row_kernel(
    table_ptr, stride_t,  # [rows, H] the projected codebook table
    idx_ptr, idx_offset,  # [1] the previous codebook's code, its table offset
    x_ptr, q_ptr, attn_ptr, act_ptr, logits_ptr,  # scratch rows: [H], [HQ * D], [HQ * D], [I]; out [V]
    wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr,  # [L, ...] stacked layer weights, row-major
    ln1_ptr, ln2_ptr, qn_ptr, kn_ptr,  # [L, H], [L, H], [L, D], [L, D]
    norm_ptr, head_ptr,  # [H], [V, H] this codebook's head
    kv_ptr,  # [L, 2, R * KC, HKV, D] the depth KV (the row's slots are 0..KC-1)
    cos_ptr, sin_ptr,  # [P, D] fp32 RoPE rows
    counter_ptr,  # int32: this sub-step's barrier
    pos, V, first_phase, last_phase, eps, scale_log2e,
    stride_kvl, stride_kv, stride_cos,
    LAYERS: tl.constexpr, H: tl.constexpr, I: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr, SB: tl.constexpr, GP: tl.constexpr, QK_NORM: tl.constexpr,
    BNQ: tl.constexpr, BNO: tl.constexpr, BNG: tl.constexpr, KCG: tl.constexpr, BND: tl.constexpr,
    KCD: tl.constexpr, BNH: tl.constexpr, SYNC: tl.constexpr,
):  # fmt: skip
    QW: tl.constexpr = HQ * HEAD_DIM
    KW: tl.constexpr = HKV * HEAD_DIM
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    src = table_ptr + (tl.load(idx_ptr).to(tl.int64) + idx_offset) * stride_t  # layer 0's x: the input row
    for ph in range(first_phase, last_phase + 1):
        layer = ph // 5
        j = ph % 5
        wait = SYNC and ph > first_phase
        target = (ph - first_phase) * nprog
        kv = kv_ptr + layer * stride_kvl
        if layer == LAYERS:
            _head_phase(x_ptr, norm_ptr, head_ptr, logits_ptr, V, eps, counter_ptr, target, wait, pid, nprog,
                        H, BNH)
        elif j == 0:
            xb = src if layer == 0 else x_ptr
            _qkv_phase(xb, wqkv_ptr + layer * (QW + 2 * KW) * H, ln1_ptr + layer * H, q_ptr, kv, stride_kv, pos, eps,
                       counter_ptr, target, wait, pid, nprog, H, QW, KW, BNQ)
        elif j == 1:
            _attention_phase(q_ptr, kv, stride_kv, attn_ptr, qn_ptr + layer * HEAD_DIM, kn_ptr + layer * HEAD_DIM,
                             cos_ptr, sin_ptr, stride_cos, pos, eps, scale_log2e, counter_ptr, target, wait, pid,
                             nprog, HQ, HKV, HEAD_DIM, SB, GP, QK_NORM)
        elif j == 2:  # o_proj + residual (layer 0's residual: the input row)
            res = src if layer == 0 else x_ptr
            _residual_phase(attn_ptr, wo_ptr + layer * H * QW, res, x_ptr, counter_ptr, target, wait, pid, nprog,
                            H, QW, BNO, QW)
        elif j == 3:
            _gate_up_phase(x_ptr, wgu_ptr + layer * 2 * I * H, ln2_ptr + layer * H, act_ptr, eps, counter_ptr, target,
                           wait, pid, nprog, H, I, BNG, KCG)
        else:  # down + residual
            _residual_phase(act_ptr, wd_ptr + layer * H * I, x_ptr, x_ptr, counter_ptr, target, wait, pid, nprog,
                            H, I, BND, KCD)
