"""The tile and launch-parameter types of the Triton kernels, and the shape-generic choices.

Plain dataclasses with no triton import: the tuning tables (runner/kernels/tuning) are read,
written and tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

PLAIN, GATED = 0, 1  # tile-table kinds: out = x @ W^T, or the gated gate_up (out [M, I])
KIND_NAMES = {PLAIN: "plain", GATED: "gated"}

# Largest M the skinny GEMMs serve; above it cuBLAS's tensor-core GEMMs are the better choice.
MAX_M = 64

PER_SM = -1  # LinearTile.groups: one ragged column group per SM

# tl.dot input precisions of the fused SNAC kernels (runner/kernels/snac.py); stated here, in a
# module without triton, so a codec config validates on a machine without it.
MATMUL_PRECISIONS = ("tf32x3", "bf16x3", "tf32", "ieee")


@dataclass(frozen=True)
class LinearTile:
    """A tile of runner/kernels/linear.py's skinny GEMM (also head_argmax's and qkv_rope's)."""

    block_m: int  # 1: GEMV mode (M == 1); else 16/32/64, MMA mode
    block_n: int  # output columns per program (gated: of each half)
    block_k: int  # must divide K
    num_warps: int = 4
    num_stages: int = 3  # MMA mode's pipeline depth (GEMV mode double-buffers by hand)
    # MMA mode: let the next kernel launch (PDL) only after this one's stores instead of right
    # after its wait, so the next kernel's early loads do not compete with this one's stream
    late_trigger: bool = False
    # MMA mode: 0, block_n-wide column tiles; > 0, that many programs per row block split the N
    # columns into ragged groups (boundaries on multiples of 8 columns, each at most block_n
    # wide, the rest of the tile masked); PER_SM, one group per SM of the device where such
    # groups fit in block_n (else plain tiles). Why: a program streams its weights at a few
    # tens of GB/s, so a GEMM of cdiv(N, block_n) = 128 long programs on 132 SMs leaves four
    # SMs' share of the bandwidth unused
    groups: int = 0
    # MMA mode (gated column tiles: N % block_n == 0, or ragged groups): x and W tiles come in
    # through TMA (host-built tensor descriptors; rows past M or the weight's arrive as zeros, rows
    # of other columns are loaded and their results masked) instead of pointer loads, the same
    # tiles in the same order (bit for bit the pointer tile's result)
    tma: bool = False


def _largest_block_k(k: int, cap: int) -> int | None:
    bk = cap
    while bk >= 64:
        if k % bk == 0:
            return bk
        bk //= 2
    return None


def default_tile(kind: int, n: int, k: int, m: int) -> LinearTile | None:
    """Shape-generic choice (either kind): GEMV at M == 1, MMA up to MAX_M; None where no
    block_k of at least 64 divides K."""
    if m < 1 or m > MAX_M:
        return None
    if m == 1:
        bk = _largest_block_k(k, 1024)
        return LinearTile(1, 16, bk, 4, 1) if bk else None
    bk = _largest_block_k(k, 256 if m <= 16 else 128)
    if bk is None:
        return None
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    return LinearTile(bm, 32, bk, 4, 4)


@dataclass(frozen=True)
class AttentionTuning:
    """Launch choices of runner/kernels/attention.py's paged decode kernel. Each is a function of
    the batch shape and SM count only (never of the block table's width), so an eager step and
    the graph replay of its bucket run the same kernel. The defaults are the untuned choice,
    valid on any CUDA GPU: 32-token tiles in 2 stages hold 2 x 2 x 32 x 128 x 4 B = 64 KiB of
    fp32 K/V at head_dim 128, within every sm80+ part's shared memory."""

    # tokens per K/V tile (rounded up to the cache block size) once B * Hkv programs fill the SMs
    block_n: int = 32
    # ... while the sequences are split or the launch is a short wave
    split_block_n: int = 32
    num_stages: int = 2
    num_warps: int = 4
    # split-K sizing: about this many programs per SM, never more than max_splits splits
    target_programs_per_sm: int = 2
    max_splits: int = 32
    # block-table entries read per chunk ahead of the tile loop (0: each tile reads its own)
    table_chunk: int = 0
    # unsplit launches of up to this many programs per SM take split_block_n tiles,
    # short_wave_stages stages and the chunked table read (needs table_chunk > 0)
    short_wave_programs_per_sm: int = 0
    short_wave_stages: int = 2
    # split pure-decode launches of at least this many splits load their first tile before the
    # PDL wait (above max_splits: never)
    prefetch_min_splits: int = 33
    # pure-decode RoPE + KV write inside the kernel while B * Hkv <= this many programs per SM
    fused_rope_programs_per_sm: int = 4


@dataclass(frozen=True)
class SnacTiles:
    """Tile shape of a matmul kernel of runner/kernels/snac.py; BN / BK shrink to the layer
    (never below 16, tl.dot's minimum). Fixed per layer, never per batch. fast_sin: Snake
    through the SFU's approximate sine (CUDA only: inline PTX)."""

    bm: int = 128
    bn: int = 128
    bk: int = 32
    num_warps: int = 8
    num_stages: int = 3
    fast_sin: bool = False
    # (DecoderBlock index, tiles) for the blocks whose layers (transposed conv, NoiseBlock,
    # ResidualUnits) take other tiles: their channel counts (512 ... 64) and row counts (8x ...
    # 512x the latent rate) differ by 8x. The latent layers and the final conv keep these.
    per_block: tuple[tuple[int, SnacTiles], ...] = ()

    def for_block(self, i: int) -> SnacTiles:
        return next((t for j, t in self.per_block if j == i), self)

    @classmethod
    def parse(cls, spec: str) -> SnacTiles:
        """'bm,bn,bk,warps,stages[,fast_sin 0/1]', optionally followed by per-block tiles
        '+bI:bm,bn,...' (bench and tuning command lines)."""
        base, *blocks = spec.split("+")
        v = [int(x) for x in base.split(",")]
        if len(v) not in (5, 6):
            raise ValueError(f"tiles {spec!r}: expected bm,bn,bk,warps,stages[,fast_sin][+bI:...]")
        per_block = []
        for b in blocks:
            idx, _, t = b.partition(":")
            if not idx.startswith("b") or not idx[1:].isdigit():
                raise ValueError(f"tiles {spec!r}: per-block part {b!r} is not 'bI:bm,bn,bk,warps,stages[,fast_sin]'")
            per_block.append((int(idx[1:]), cls.parse(t)))
        return cls(*v[:5], fast_sin=bool(v[5]) if len(v) == 6 else False, per_block=tuple(per_block))


# Always valid on CUDA: 2 * (64 + 64) * 32 * 4 B = 32 KiB of pipeline buffers, no inline PTX.
SAFE_SNAC_TILES = SnacTiles(bm=64, bn=64, bk=32, num_warps=4, num_stages=2)


@dataclass(frozen=True)
class SamplingTuning:
    """Launch configuration of runner/kernels/sampling.py's `_filter_sample_kernel` (names as
    the kernel's constexprs). Valid on any CUDA GPU: at 8 warps the accumulators take
    2 * BLOCK_P * NP / 256 = 32 and the scratch C / 256 = 32 registers per thread."""

    BLOCK_P: int = 512  # tokens per chunk of a pivot pass (power of two)
    NP: int = 8  # pivots per pass (power of two)
    BLOCK_S: int = 2048  # tokens per chunk of the streaming passes (power of two)
    C: int = 8192  # scratch capacity: the search finishes in registers below it (power of two)
    MAX_PASSES: int = 40  # safety stop for pivot passes (the key midpoint bounds them at 32)
    num_warps: int = 8  # B > the SM count
    # B <= the SM count; equal to num_warps on purpose: a seeded request must give the same
    # tokens whatever the batch size, so the reduction tree may not depend on B
    num_warps_small: int = 8


@dataclass(frozen=True)
class DepthTuning:
    """Where a depth decoder (CSM, Qwen3-TTS) runs a one-row sub-step as runner/kernels/
    depth_row.py's persistent kernel instead of its layers: the decoders' shapes, "HxI"
    (hidden x intermediate), that measured faster that way on this device. Empty: never."""

    one_row: tuple[str, ...] = ()

    def one_row_fits(self, hidden: int, inter: int) -> bool:
        return f"{hidden}x{inter}" in self.one_row

