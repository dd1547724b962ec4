"""Triton paged-KV decode attention (one query token per sequence), CUDA-graph capturable.

Decode is memory-bound: every step streams each live sequence's whole K/V once per layer, so
the kernel is built around reading those bytes once and nothing else:

* One program per (sequence b, KV head g[, split s]). It serves all `group = Hq // Hkv` query
  heads that share KV head g (query head h uses KV head h // group, transformers' repeat_kv
  order), so each K/V tile is loaded once per group, not once per query head. The group is padded
  to >= 16 rows so QK^T and PV run as `tl.dot` on tensor cores; the padded rows cost FLOPs, not
  bytes.
* The sequence is walked in tiles of BLOCK_N tokens (a multiple of the cache block size); a
  tile's tokens are gathered through the block table, one contiguous D-vector per token.
* Online softmax in fp32 (exp2 domain, scale * log2(e) applied to the fp32 scores).
* The loop bound comes from `seq_lens` loaded inside the kernel, and the grid is
  (B, Hkv, num_splits) where num_splits depends only on B, Hkv, the block table's width and the
  SM count. Nothing changes on the host between CUDA-graph replays: a captured launch stays
  correct when seq_lens / block_tables contents change.
* Split-K (flash-decoding) when B * Hkv is small next to the SM count: split s of a sequence
  takes a contiguous run of its tiles (the run length is derived in-kernel from seq_len), writes
  an unnormalised partial (acc, running max m, running sum l) to fp32 scratch, and a second
  kernel merges the splits. Both launches are fixed-shape, so the pair captures like one.
  The split count and tile length depend on (B, Hkv, SM count) only, never on the table's
  width, so an eager step and a graph replay of the same rows compute the same values.
* Pure decode may also fuse RoPE and the KV write (`DecodeRope`,
  `TritonPagedAttention.decode_rope_fused`), unless the qkv GEMM before it has done both in its
  epilogue (runner/kernels/qkv_rope.py; then `forward_decode_cached` only attends). Split 32 ways (batch 1), it also issues every load
  the step's earlier kernels do not write (seq_len, block table, first K/V tile, RoPE rows)
  before the PDL wait, so they run under the qkv GEMM's tail (`prefetches`).

seq_len == 0 (padding rows of a graph batch) gives l == 0 and the kernels write zeros, never
NaN: the running max starts at a finite sentinel (_NEG) rather than -inf so exp2(m_old - m_new)
is never exp2(-inf - -inf).

Importing this module needs `triton`; the CPU build of torch does not bring it, so callers
import it only on CUDA (tests run it under TRITON_INTERPRET=1 on CPU where triton is installed).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from runner.kernels.fused_ops import rope_rows
from runner.kernels.gpu_info import num_sms
from runner.kernels.pdl import pdl_enter
from runner.kernels.tuning import AttentionTuning, read_table

# Finite "minus infinity" for the running max; see the module docstring. (constexpr: jit
# functions may only read globals declared as such.)
_NEG = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634

# Launch choices (runner/kernels/tuning/tiles.py AttentionTuning says what each one is). A backend
# passes its device's (`Tables.attention`, chosen once at its construction) to every launch; a
# caller that passes none (tests, benchmarks) gets REFERENCE, the reference device's table
# (runner/kernels/tuning/nvidia_h200.json). Why that table's values: tiles of 64 tokens x 128
# dims x bf16 = 16 KiB per K (or V) tile keep many loads in flight and still fit several stages;
# while the sequences are split (few programs) shorter tiles put more of them in flight. Reading
# the block table in chunks ahead of the tile loop (`TABLE_P`) lets the K/V loads run
# LOOP_STAGES - 1 tiles ahead (read per tile, the K/V loads wait on that load and Triton issues
# them one tile ahead only); it pays for split launches with several tiles per split and for
# unsplit launches of at most a short wave (those also take 32-token tiles and more stages), not
# for the 32-split batch 1 (a tile or two per split) nor for full waves of 64-token tiles (fewer
# programs per SM by shared memory). 0 turns either off (bench A/B). Split pure-decode launches
# of at least prefetch_min_splits splits load their first tile before the PDL wait
# (`prefetches`): it pays at 32 splits (batch 1: a split attends a tile or two, so its time is a
# chain of dependent loads), not at 4-16 (the peeled tile delays the loop's pipelined loads past
# the wait), nor unsplit (that form was removed).
REFERENCE: AttentionTuning = read_table("nvidia_h200").attention


@triton.jit
def _split_range(seq_lens_ptr, b, split, max_blocks, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 NUM_SPLITS: tl.constexpr):
    """(seq_len, n_tiles, t_lo, t_hi): sequence b's length and the tile run [t_lo, t_hi) of `split`."""
    # Clamp to the table's capacity so a bad seq_len can never read past the row.
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_blocks * BLOCK_SIZE)
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    t_lo = split * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, n_tiles)  # t_lo >= t_hi: empty split
    return seq_len, n_tiles, t_lo, t_hi


@triton.jit
def _rope_inputs(pos_ptr, cos_ptr, sin_ptr, slot_ptr, b, stride_cos, stride_sin, max_pos, offs_d):
    """Fused RoPE's per-sequence inputs: its cos and sin table rows ([1, D] fp32, the position
    clamped into the table) and its flat cache slot."""
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + b).to(tl.int64), 0), max_pos - 1)
    c = tl.load(cos_ptr + pos * stride_cos + offs_d)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + offs_d)[None, :]
    return c, s, tl.load(slot_ptr + b).to(tl.int64)


@triton.jit
def _load_kv_tile(kv_ptr, bt_row, t, live, stride_btc, stride_blk, stride_tok, head_off, stride_kvd, stride_kv,
                  offs_d, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile t's K and V [BLOCK_N, D] and its position mask (positions < `live`), gathered
    through the block table."""
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions
    n_mask = offs_n < live
    # Masked positions issue no block-table or K/V load, and their scores are -inf, so dead
    # slots (even NaN) never reach the result.
    blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_btc, mask=n_mask, other=0)
    k, v = _load_kv_rows(kv_ptr, blk, offs_n, n_mask, stride_blk, stride_tok, head_off, stride_kvd, stride_kv, offs_d,
                         BLOCK_SIZE)
    return k, v, n_mask


@triton.jit
def _load_kv_tile_gathered(kv_ptr, row_blocks, t, first_block, live, stride_blk, stride_tok, head_off, stride_kvd,
                           stride_kv, offs_d, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """_load_kv_tile with the block ids taken from a table chunk already in registers
    (`row_blocks` [TABLE_P], entries first_block...): the addresses depend on no load here."""
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < live
    # the chunk holds every block of the tile (a tile never straddles chunks); masked positions
    # past the live blocks gather a 0 and issue no load
    blk = tl.gather(row_blocks, offs_n // BLOCK_SIZE - first_block, 0)
    k, v = _load_kv_rows(kv_ptr, blk, offs_n, n_mask, stride_blk, stride_tok, head_off, stride_kvd, stride_kv, offs_d,
                         BLOCK_SIZE)
    return k, v, n_mask


@triton.jit
def _load_kv_rows(kv_ptr, blk, offs_n, n_mask, stride_blk, stride_tok, head_off, stride_kvd, stride_kv, offs_d,
                  BLOCK_SIZE: tl.constexpr):
    """K and V [BLOCK_N, D] of positions offs_n, whose cache blocks are `blk` [BLOCK_N]."""
    # int64: block * stride_blk overflows int32 on caches over 2^31 elements.
    tok_off = blk.to(tl.int64) * stride_blk + (offs_n % BLOCK_SIZE) * stride_tok + head_off  # [BLOCK_N]
    kv_off = tok_off[:, None] + offs_d[None, :] * stride_kvd  # [BLOCK_N, D]
    k = tl.load(kv_ptr + kv_off, mask=n_mask[:, None], other=0.0)
    v = tl.load(kv_ptr + stride_kv + kv_off, mask=n_mask[:, None], other=0.0)
    return k, v


@triton.jit
def _attend_tile(q, k, v, n_mask, m_i, l_i, acc, scale_log2e, DOT_PREC: tl.constexpr):
    """One online-softmax step over a K/V tile: the updated (m_i, l_i, acc)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2e  # [GROUP_P, BLOCK_N] fp32
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # >= _NEG, finite
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # masked -> exp2(-inf) = 0
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


# max_blocks and the table's row stride change with every eager step's longest sequence: not
# specialising on them (divisibility by 16, == 1) keeps one compiled variant per split count.
@triton.jit(do_not_specialize=["stride_btb", "max_blocks"])
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, D]
    kv_ptr,  # [2, NB, BS, Hkv, D]
    bt_ptr,  # [B, MB] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D]            written when NUM_SPLITS == 1
    part_acc_ptr,  # [B, Hq, S, D] fp32  written when NUM_SPLITS > 1 (unnormalised)
    part_m_ptr,  # [B, Hq, S] fp32     running max, log2 domain
    part_l_ptr,  # [B, Hq, S] fp32     running sum of exp2
    scale_log2e,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kv,  # distance K -> V (may exceed int32; triton then types it int64)
    stride_blk,
    stride_tok,
    stride_kvh,
    stride_kvd,
    stride_btb,
    stride_btc,
    stride_ob,
    stride_oh,
    stride_od,
    num_q_heads,
    max_blocks,
    # FUSED_ROPE only (pure decode): this step's unrotated k/v rows, the RoPE tables, positions
    # and cache slots; q_ptr then points at the unrotated q
    knew_ptr,  # [B, Hkv, D]
    vnew_ptr,  # [B, Hkv, D]
    cos_ptr,  # [P, D] fp32, cat(f, f) rows
    sin_ptr,
    pos_ptr,  # [B] int
    slot_ptr,  # [B] int64 flat slots
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    stride_cos,
    stride_sin,
    max_pos,
    GROUP: tl.constexpr,  # Hq // Hkv
    GROUP_P: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens), power of two
    BLOCK_N: tl.constexpr,  # tile length, multiple of BLOCK_SIZE, power of two
    NUM_SPLITS: tl.constexpr,
    DOT_PREC: tl.constexpr,  # "ieee" for fp32 caches (tf32 would cost ~1e-3), else unused
    LOOP_STAGES: tl.constexpr,
    USE_GDC: tl.constexpr,  # launched with PDL (runner/kernels/pdl.py)
    FUSED_ROPE: tl.constexpr,  # rotate q and this token's k here and write k/v to the cache
    ROUND: tl.constexpr,  # FUSED_ROPE: 16-bit model dtype (round where torch materialises)
    FOLD_CURRENT: tl.constexpr,  # FUSED_ROPE and split: the current token joins after the loop
    # FOLD_CURRENT only: everything but q and this token's k/v is loaded before the PDL wait
    PREFETCH: tl.constexpr,
    TABLE_P: tl.constexpr = 0,  # > 0: the block table is read TABLE_P entries at a time ahead of the tiles
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_P)
    offs_d = tl.arange(0, HEAD_DIM)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    head_off = kvh * stride_kvh
    if PREFETCH:
        # Split 32 ways (batch 1), a program attends a tile or two, so its time is a chain of
        # dependent loads (seq_len -> block table -> K/V), not bytes. None of them reads what
        # the kernels before it in this step write: seq_lens, tables, positions and slots come
        # from host copies before the step, and the cached positions [0, seq_len - 1) from
        # earlier steps (this token's slot is not read: it is folded in from registers). So
        # they are issued before the wait and can run under the qkv GEMM's tail; only q, k
        # and v (the GEMM's output) wait. Same values, same arithmetic as without (the first
        # tile is the loop's first iteration, peeled).
        seq_len, n_tiles, t_lo, t_hi = _split_range(seq_lens_ptr, b, split, max_blocks, BLOCK_SIZE, BLOCK_N,
                                                    NUM_SPLITS)
        c, s_, slot = _rope_inputs(pos_ptr, cos_ptr, sin_ptr, slot_ptr, b, stride_cos, stride_sin, max_pos, offs_d)
        # an empty split (t_lo >= t_hi) masks every position: the peeled step then changes nothing
        k0, v0, mask0 = _load_kv_tile(kv_ptr, bt_row, t_lo, tl.where(t_lo < t_hi, seq_len - 1, 0), stride_btc,
                                      stride_blk, stride_tok, head_off, stride_kvd, stride_kv, offs_d, BLOCK_SIZE,
                                      BLOCK_N)
    pdl_enter(USE_GDC)
    if not PREFETCH:
        seq_len, n_tiles, t_lo, t_hi = _split_range(seq_lens_ptr, b, split, max_blocks, BLOCK_SIZE, BLOCK_N,
                                                    NUM_SPLITS)

    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # [GROUP_P] query heads of this KV head
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh  # [GROUP_P, 1]
    if FUSED_ROPE:
        # The RoPE kernel's arithmetic (runner/kernels/fused_ops.py), so q and k come out bit for
        # bit as the unfused RoPE + KV write would leave them (the attention itself then differs
        # from the unfused launch in fp32 summation order only).
        if not PREFETCH:
            c, s_, slot = _rope_inputs(pos_ptr, cos_ptr, sin_ptr, slot_ptr, b, stride_cos, stride_sin, max_pos,
                                       offs_d)
        if ROUND:  # torch casts the fp32 table rows to the model dtype before use
            c = c.to(q_ptr.dtype.element_ty).to(tl.float32)
            s_ = s_.to(q_ptr.dtype.element_ty).to(tl.float32)
        q = rope_rows(q_rows, stride_qd, offs_d, g_mask[:, None], c, s_, HEAD_DIM, ROUND).to(kv_ptr.dtype.element_ty)
        # This token's rotated k and v ([1, D]). No other program of the launch reads their slot
        # (pure decode: one row per sequence). Split (FOLD_CURRENT): the split that owns position
        # seq_len - 1 adds them to its softmax after the loop (that slot is not read) and writes
        # them to the cache. Not split: every program owns its position, so it writes them
        # first and the loop reads them back like any cached position, after a CTA barrier (its
        # own stores are then visible to all its threads): the unfused kernel's arithmetic
        # exactly, and at one program per (sequence, KV head) cheaper than the fold, which sits
        # on every program's critical path (batch 64, 350 tokens: +1.8 against +3.0 us).
        k_row = knew_ptr + b * stride_knb + kvh * stride_knh + tl.zeros([1, 1], tl.int32)
        k_cur = rope_rows(k_row, 1, offs_d, offs_d[None, :] < HEAD_DIM, c, s_, HEAD_DIM, ROUND)
        k_cur = k_cur.to(kv_ptr.dtype.element_ty)
        v_cur = tl.load(vnew_ptr + b * stride_vnb + kvh * stride_vnh + offs_d)[None, :].to(kv_ptr.dtype.element_ty)
        dst = (kv_ptr + (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_tok + kvh * stride_kvh
               + offs_d[None, :] * stride_kvd)  # [1, D]
        if not FOLD_CURRENT:
            if seq_len > 0:
                tl.store(dst, k_cur)
                tl.store(dst + stride_kv, v_cur)
            tl.debug_barrier()
    else:
        q = tl.load(
            q_rows + offs_d[None, :] * stride_qd, mask=g_mask[:, None], other=0.0
        ).to(kv_ptr.dtype.element_ty)  # [GROUP_P, D], padded rows are zero (scores 0, never stored)

    m_i = tl.full([GROUP_P], _NEG, tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)

    # FOLD_CURRENT: the loop reads the positions already in the cache, [0, seq_len - 1); the
    # current token is folded in after it, from registers
    cached = seq_len - 1 if FOLD_CURRENT else seq_len
    t_first = t_lo
    if PREFETCH:
        m_i, l_i, acc = _attend_tile(q, k0, v0, mask0, m_i, l_i, acc, scale_log2e, DOT_PREC)
        t_first = t_lo + 1
    # Explicit tl.range stages: without them Triton 3.6 does not software-pipeline these loops.
    if TABLE_P > 0:
        # The block table in chunks of TABLE_P entries, each loaded whole before the tiles it
        # covers: the tile loop then computes its K/V addresses from registers (tl.gather), so
        # the pipeliner can issue K/V LOOP_STAGES - 1 tiles ahead (through the table, one).
        tiles_per_chunk: tl.constexpr = TABLE_P * BLOCK_SIZE // BLOCK_N
        offs_tb = tl.arange(0, TABLE_P)
        live_blocks = tl.cdiv(cached, BLOCK_SIZE)
        for c in range(t_first // tiles_per_chunk, tl.cdiv(t_hi, tiles_per_chunk)):
            tb = c * TABLE_P + offs_tb
            row_blocks = tl.load(bt_row + tb * stride_btc, mask=tb < live_blocks, other=0)
            c_lo = tl.maximum(t_first, c * tiles_per_chunk)
            c_hi = tl.minimum(t_hi, (c + 1) * tiles_per_chunk)
            for t in tl.range(c_lo, c_hi, num_stages=LOOP_STAGES):
                k, v, n_mask = _load_kv_tile_gathered(kv_ptr, row_blocks, t, c * TABLE_P, cached, stride_blk,
                                                      stride_tok, head_off, stride_kvd, stride_kv, offs_d, BLOCK_SIZE,
                                                      BLOCK_N)
                m_i, l_i, acc = _attend_tile(q, k, v, n_mask, m_i, l_i, acc, scale_log2e, DOT_PREC)
    else:
        # The K/V addresses depend on a block-table load in the loop: the table runs a stage
        # ahead and K/V of tile t+1 are fetched with cp.async while tile t is computed, never more.
        for t in tl.range(t_first, t_hi, num_stages=LOOP_STAGES):
            k, v, n_mask = _load_kv_tile(kv_ptr, bt_row, t, cached, stride_btc, stride_blk, stride_tok, head_off,
                                         stride_kvd, stride_kv, offs_d, BLOCK_SIZE, BLOCK_N)
            m_i, l_i, acc = _attend_tile(q, k, v, n_mask, m_i, l_i, acc, scale_log2e, DOT_PREC)

    if FOLD_CURRENT:
        last = n_tiles - 1
        if (n_tiles > 0) & (t_lo <= last) & (last < t_hi):  # this split owns position seq_len - 1
            # one more online-softmax step, for the current token (the loop's roundings: p in
            # the cache dtype before PV); then its k/v go to the cache for later steps
            s_cur = tl.sum(q.to(tl.float32) * k_cur.to(tl.float32), 1) * scale_log2e  # [GROUP_P]
            m_new = tl.maximum(m_i, s_cur)
            alpha = tl.exp2(m_i - m_new)
            p_cur = tl.exp2(s_cur - m_new)
            l_i = l_i * alpha + p_cur
            acc = acc * alpha[:, None] + p_cur.to(v_cur.dtype).to(tl.float32)[:, None] * v_cur.to(tl.float32)
            m_i = m_new
            tl.store(dst, k_cur)
            tl.store(dst + stride_kv, v_cur)

    if NUM_SPLITS == 1:
        # l_i == 0 only when the row had no keys (seq_len 0): write zeros.
        o = tl.where(l_i[:, None] > 0.0, acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], 0.0)
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None],
        )
    else:
        # Scratch is contiguous [B, Hq, S(, D)]; an empty split writes (m=_NEG, l=0, acc=0).
        row = (b * num_q_heads + heads) * NUM_SPLITS + split  # [GROUP_P]
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,  # [B, Hq, S, D] fp32
    part_m_ptr,  # [B, Hq, S] fp32
    part_l_ptr,  # [B, Hq, S] fp32
    out_ptr,  # [B, Hq, D]
    stride_ob,
    stride_oh,
    stride_od,
    num_q_heads,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,  # NUM_SPLITS padded to a power of two
    USE_GDC: tl.constexpr,
):
    pdl_enter(USE_GDC)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS
    row = (b * num_q_heads + h) * NUM_SPLITS + offs_s  # [SPLITS_P]

    m = tl.load(part_m_ptr + row, mask=s_mask, other=_NEG)
    l = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None], other=0.0)

    # Rescale every split to the global max. Empty splits carry l = 0 and acc = 0, so their
    # weight (1 when every split is empty, 0 otherwise) never matters.
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # [SPLITS_P]
    l_tot = tl.sum(l * w, 0)
    o = tl.sum(acc * w[:, None], 0)  # [D]
    o = tl.where(l_tot > 0.0, o / tl.where(l_tot > 0.0, l_tot, 1.0), 0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od, o.to(out_ptr.dtype.element_ty))


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def choose_num_splits(batch: int, num_kv_heads: int, num_sms: int, tuning: AttentionTuning | None = None) -> int:
    """Split-K count from the batch shape alone: the same for an eager step (whose block table
    is as wide as its longest sequence) and for the graph replay of its bucket (full-width
    tables), so both split every sequence into the same tile runs and compute the same values.

    No split once B * Hkv programs fill the SMs; otherwise enough splits for about
    target_programs_per_sm programs per SM (splits past a short sequence's last tile just
    exit), rounded down to a power of two: NUM_SPLITS is a compile-time constant, and each
    value compiles when the decode graphs are captured (batch 1, 2, 4, 8, 16, >= 17 on 8 KV
    heads), never mid-serving.
    """
    t = tuning or REFERENCE
    programs = batch * num_kv_heads
    if programs == 0 or programs >= num_sms:
        return 1
    n = max(1, min(math.ceil(t.target_programs_per_sm * num_sms / programs), t.max_splits))
    return 1 << (n.bit_length() - 1)


def prefetches(num_splits: int, tuning: AttentionTuning | None = None) -> bool:
    """Whether a fused-RoPE decode launch with `num_splits` splits issues its block-table, first
    K/V tile and RoPE-row loads before the PDL wait: a function of the split count alone, which
    the batch shape fixes, so eager steps and graph replays run the same kernel."""
    return num_splits > 1 and num_splits >= (tuning or REFERENCE).prefetch_min_splits


def _short_wave(batch: int, num_kv_heads: int, num_sms: int, t: AttentionTuning) -> bool:
    # strict: batch 32 on 8 KV heads and 132 SMs is in, 33 out, so the limit sits at a graph
    # bucket (32) and an eager step takes its bucket's tiles
    programs = batch * num_kv_heads
    return num_sms <= programs < t.short_wave_programs_per_sm * num_sms and t.table_chunk > 0


def choose_block_n(batch: int, num_kv_heads: int, num_sms: int, tuning: AttentionTuning | None = None) -> int:
    """Tile length from the batch shape alone (like the split count): split_block_n while the
    sequences are split or fill at most a short wave (table_chunk), block_n above."""
    t = tuning or REFERENCE
    if batch * num_kv_heads < num_sms or _short_wave(batch, num_kv_heads, num_sms, t):
        return t.split_block_n
    return t.block_n


def choose_tiling(batch: int, num_kv_heads: int, num_sms: int, num_splits: int,
                  tuning: AttentionTuning | None = None) -> tuple[int, int, int]:
    """(tile length, loop stages, block-table chunk) from the batch shape and split count alone,
    so an eager step and the graph replay of its bucket tile every sequence alike (the launch
    choices' comment says where each pays)."""
    t = tuning or REFERENCE
    block_n = choose_block_n(batch, num_kv_heads, num_sms, t)
    if num_splits > 1:
        return block_n, t.num_stages, 0 if prefetches(num_splits, t) else t.table_chunk
    if _short_wave(batch, num_kv_heads, num_sms, t):
        return block_n, t.short_wave_stages, t.table_chunk
    return block_n, t.num_stages, 0


def launch_classes(num_kv_heads: int, num_sms: int, tuning: AttentionTuning | None = None,
                   num_splits: int | None = None) -> list[int]:
    """One batch size per compiled variant of an unfused decode launch (rope None: eager token
    rows, a mixed step's decodes, decode past the fused limit) on this many KV heads: its
    constexprs (split count, tile length, loop stages, block-table chunk) are functions of the
    batch alone, and past 2 * max(short_wave_programs_per_sm, target_programs_per_sm) * SMs /
    Hkv rows they no longer change. The smallest batch of each variant, ascending; `num_splits` as the launch's own
    override (a backend's fixed split count)."""
    t = tuning or REFERENCE
    classes: dict[tuple, int] = {}
    top = 2 * max(t.short_wave_programs_per_sm, t.target_programs_per_sm) * num_sms // max(num_kv_heads, 1) + 2
    for batch in range(1, top + 1):
        splits = num_splits or choose_num_splits(batch, num_kv_heads, num_sms, t)
        classes.setdefault((splits, *choose_tiling(batch, num_kv_heads, num_sms, splits, t)), batch)
    return sorted(classes.values())


def fused_rope_fits(batch: int, num_kv_heads: int, num_sms: int, tuning: AttentionTuning | None = None) -> bool:
    """Whether a pure-decode launch of `batch` rows has few enough programs for RoPE + KV write
    inside the kernel (B * Hkv <= fused_rope_programs_per_sm per SM: about one wave)."""
    return batch * num_kv_heads <= (tuning or REFERENCE).fused_rope_programs_per_sm * num_sms


class DecodeRope(NamedTuple):
    """Inputs of the RoPE + KV write fused into the decode kernel (pure decode only: one row per
    sequence, so no row reads a slot another program of the launch writes)."""

    k: torch.Tensor  # [B, Hkv, D] this step's k, not rotated (last dim contiguous)
    v: torch.Tensor  # [B, Hkv, D]
    cos: torch.Tensor  # [P, D] fp32, cat(f, f) rows
    sin: torch.Tensor
    positions: torch.Tensor  # [B], seq_lens - 1
    slot_mapping: torch.Tensor  # [B] int64 flat cache slots


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, MB] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,  # [B, Hq, D]
    *,
    num_splits: int | None = None,  # None: choose_num_splits
    block_n: int | None = None,  # tile length in tokens; None: choose_tiling
    pdl: bool = False,  # launch with programmatic dependent launch (runner/kernels/pdl.py)
    rope: DecodeRope | None = None,
    num_warps: int | None = None,  # None: the tuning's (bench sweeps pass others)
    num_stages: int | None = None,  # None: choose_tiling
    prefetch: bool = True,  # with `rope`: load all but q/k/v before the PDL wait (prefetches())
    table_chunk: int | None = None,  # block-table entries read ahead of the tiles; None: choose_tiling
    tuning: AttentionTuning | None = None,  # the device's launch choices; None: REFERENCE
) -> torch.Tensor:  # [B, Hq, D], q's dtype unless `out` is given
    """Attention of one query token per sequence over positions [0, seq_lens[b]) of its paged KV.

    The current token's K/V must already be in the cache, unless `rope` is given: then q is not
    yet rotated; the kernel rotates q and rope.k and writes the K/V (k rotated, v as is) to
    rope.slot_mapping, bit for bit what the RoPE + KV write kernel writes. Not split, it writes
    them first and reads them back: the output is that kernel's followed by this one's, bit for
    bit. Split, the owning split attends to the current token from registers after its loop:
    the output then differs in the fp32 order of that one softmax step. Only for pure decode
    (each sequence once in the batch). Reads only tensor shapes on the host (never tensor
    values), so a launch can be captured in a CUDA graph; the Triton kernels must have been
    compiled (one eager call with the same shapes/dtypes) before capture.
    """
    assert q.dim() == 3 and kv_cache.dim() == 5 and kv_cache.shape[0] == 2, (q.shape, kv_cache.shape)
    bsz, hq, d = q.shape
    _, _, bs, hkv, d_kv = kv_cache.shape
    assert d == d_kv and _is_pow2(d), f"head_dim {d} vs cache {d_kv}; must be a power of two"
    assert hq % hkv == 0, f"Hq={hq} not a multiple of Hkv={hkv}"
    assert _is_pow2(bs), f"block size {bs} must be a power of two"
    assert block_tables.dim() == 2 and block_tables.shape[0] == bsz and block_tables.dtype == torch.int32
    assert seq_lens.shape == (bsz,) and seq_lens.dtype == torch.int32 and seq_lens.stride(0) == 1
    assert kv_cache.dtype in (torch.bfloat16, torch.float16, torch.float32), kv_cache.dtype
    assert q.device == kv_cache.device == block_tables.device == seq_lens.device

    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape
    if bsz == 0:
        return out

    group = hq // hkv
    group_p = max(16, triton.next_power_of_2(group))
    sms = num_sms(q.device)
    max_blocks = block_tables.shape[1]
    t = tuning or REFERENCE
    splits = num_splits or choose_num_splits(bsz, hkv, sms, t)
    auto_bn, auto_stages, auto_chunk = choose_tiling(bsz, hkv, sms, splits, t)
    bn = max(block_n or auto_bn, bs)
    assert _is_pow2(bn), f"block_n {bn} must be a power of two"
    dot_prec = "ieee" if kv_cache.dtype == torch.float32 else "tf32"

    if splits > 1:
        # Fresh scratch each call: under capture it comes from the graph's private pool.
        part_acc = torch.empty(bsz, hq, splits, d, device=q.device, dtype=torch.float32)
        part_m = torch.empty(bsz, hq, splits, device=q.device, dtype=torch.float32)
        part_l = torch.empty(bsz, hq, splits, device=q.device, dtype=torch.float32)
    else:
        part_acc = part_m = part_l = out  # never touched (NUM_SPLITS == 1 branch)

    if rope is not None:
        assert rope.k.shape == (bsz, hkv, d) and rope.v.shape == (bsz, hkv, d), (rope.k.shape, rope.v.shape)
        assert rope.k.stride(2) == 1 and rope.v.stride(2) == 1 and q.dtype == rope.k.dtype
        assert rope.cos.dtype == rope.sin.dtype == torch.float32 and rope.cos.shape == rope.sin.shape
        assert rope.cos.shape[1] == d and rope.cos.stride(1) == 1 and rope.sin.stride(1) == 1
        assert rope.positions.shape == (bsz,) and rope.slot_mapping.shape == (bsz,)
        r = rope
        rope_args = (r.k, r.v, r.cos, r.sin, r.positions, r.slot_mapping, r.k.stride(0), r.k.stride(1),
                     r.v.stride(0), r.v.stride(1), r.cos.stride(0), r.sin.stride(0), r.cos.shape[0])
    else:
        rope_args = (q, q, q, q, seq_lens, seq_lens, 0, 0, 0, 0, 0, 0, 1)  # never touched
    stages = num_stages or auto_stages
    fold = rope is not None and splits > 1
    chunk = auto_chunk if table_chunk is None else table_chunk
    table_p = max(triton.next_power_of_2(chunk), bn // bs) if chunk > 0 else 0  # a tile never straddles chunks
    _paged_decode_kernel[(bsz, hkv, splits)](
        q, kv_cache, block_tables, seq_lens, out, part_acc, part_m, part_l,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        hq, max_blocks, *rope_args,
        GROUP=group, GROUP_P=group_p, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_N=bn,
        NUM_SPLITS=splits, DOT_PREC=dot_prec, LOOP_STAGES=stages,
        num_warps=num_warps or t.num_warps, num_stages=stages, USE_GDC=pdl, launch_pdl=pdl,
        FUSED_ROPE=rope is not None, ROUND=q.dtype != torch.float32, FOLD_CURRENT=fold,
        PREFETCH=fold and prefetch and prefetches(splits, t), TABLE_P=table_p,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(bsz, hq)](
            part_acc, part_m, part_l, out,
            out.stride(0), out.stride(1), out.stride(2),
            hq,
            HEAD_DIM=d, NUM_SPLITS=splits, SPLITS_P=triton.next_power_of_2(splits),
            num_warps=t.num_warps, USE_GDC=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out
