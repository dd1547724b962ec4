"""`TritonPagedAttention`: the attention backend of runner/layers/base.py (`AttentionBackend`)
over the Triton paged decode kernel (runner/kernels/attention.py); prefill chunks go through the
torch path (`TorchPagedAttention` with SDPA kernels that need no per-shape plan).

Chosen once at model construction by the registry (runner/layers/__init__.py) on CUDA; the tests
also run it under Triton's interpreter on CPU. Importing this module needs `triton`.
"""

from __future__ import annotations

import copy

import torch

from runner.kernels.attention import (
    REFERENCE,
    DecodeRope,
    fused_rope_fits,
    launch_classes,
    paged_decode_attention,
)
from runner.kernels.gpu_info import num_sms
from runner.kernels.tuning import AttentionTuning
from runner.layers.attention import (
    NO_PLAN_BACKENDS,
    AttentionMetadata,
    TorchPagedAttention,
    write_kv,
)


class TritonPagedAttention:
    """Same interface as TorchPagedAttention: Triton kernel for decode, torch for prefill.

    The decode path reads no value from `meta` on the host except `max_query_len` (to pick the
    path), so a decode step can be captured in a CUDA graph.

    `accepts_prewritten_kv`: the model may write this step's K/V itself (fused into its RoPE
    launch, ops.rope_write_kv) and call `forward_prewritten_kv`, which skips the write.

    `tuning`: the device's launch choices (runner/kernels/tuning `AttentionTuning`; the registry
    passes `load_tables(device, RunnerConfig.tuning).attention`; default: the reference table,
    for tests and benchmarks), given to every launch.
    """

    accepts_prewritten_kv = True
    # `forward_decode_cached`: a pure-decode step whose K/V the qkv GEMM already wrote
    # (runner/kernels/qkv_rope.py) only attends
    decodes_from_cache = True
    supports_token_rows = True  # AttentionMetadata.token_*: short prefills as decode rows
    # `forward_decode_rope`: pure-decode steps rotate q/k and write the cache inside the kernel
    # (one launch per layer fewer) where `decode_rope_fused` says so; set per instance from
    # RunnerConfig.rope_in_attention (off only for A/B runs)
    fuses_decode_rope: bool

    def __init__(self, num_splits: int | None = None, pdl: bool = False, rope_in_attention: bool = True,
                 prefetch: bool = True, tuning: AttentionTuning = REFERENCE) -> None:
        self._torch = TorchPagedAttention(NO_PLAN_BACKENDS)
        self.tuning = tuning
        self.num_splits = num_splits  # None: choose from shapes per call
        self.pdl = pdl  # fixed at construction (the registry, runner/layers/__init__.py)
        self.fuses_decode_rope = rope_in_attention
        self.prefetch = prefetch  # the split pure-decode kernel's loads before the PDL wait

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        # decode rows' KV here; the prefill path writes its own
        if meta.max_query_len == 1 or meta.token_seq_lens is not None:
            write_kv(k, v, kv_cache, meta.slot_mapping)
        elif meta.num_decodes:
            nd = meta.num_decodes
            write_kv(k[:nd], v[:nd], kv_cache, meta.slot_mapping[:nd])
        return self.forward_prewritten_kv(q, k, v, kv_cache, meta, scale)

    def forward_prewritten_kv(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D], already in the cache at meta.slot_mapping
        v: torch.Tensor,  # [T, Hkv, D], likewise
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """`forward` for a caller that already wrote k/v to their slots.

        A mixed step (decodes first, then prefill chunks: meta.num_decodes) runs its decode
        rows through the decode kernel and only the prefill sequences through the torch path,
        whose padded gather costs B * max_seq_len: at batch 400 a single new prompt would
        otherwise make every running sequence's KV be gathered in every layer (~0.5 s)."""
        if meta.token_seq_lens is not None:  # every query row as a decode row (causal by seq_len)
            assert meta.token_block_tables is not None and q.shape[0] == meta.token_seq_lens.shape[0]
            return paged_decode_attention(q, kv_cache, meta.token_block_tables, meta.token_seq_lens, scale,
                                          num_splits=self.num_splits, pdl=self.pdl, tuning=self.tuning)
        if meta.max_query_len != 1:
            # The torch prefill path writes k/v (again, when the caller already did: the same
            # values to the same slots, redundant but harmless; prefill is not launch-bound).
            nd = meta.num_decodes
            if not nd:
                return self._torch.forward(q, k, v, kv_cache, meta, scale)
            out = torch.empty_like(q)
            paged_decode_attention(q[:nd], kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                                   out=out[:nd], num_splits=self.num_splits, pdl=self.pdl, tuning=self.tuning)
            out[nd:] = self._torch.forward(q[nd:], k[nd:], v[nd:], kv_cache, meta.prefill_part(), scale)
            return out
        # Decode: one token per sequence, so T == B and query row b belongs to sequence b.
        assert q.shape[0] == meta.seq_lens.shape[0], (q.shape, meta.seq_lens.shape)
        return paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, num_splits=self.num_splits,
                                      pdl=self.pdl, tuning=self.tuning)

    def forward_decode_cached(
        self,
        q: torch.Tensor,  # [B, Hq, D], rotated
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], this step's K/V included
        meta: AttentionMetadata,  # pure decode (meta.pure_decode)
        scale: float,
    ) -> torch.Tensor:  # [B, Hq, D]
        """A pure-decode step whose RoPE and K/V write were done before (ops.qkv_rope_write): the
        decode kernel alone, the same launch `forward_prewritten_kv` makes for such a step."""
        assert meta.pure_decode and q.shape[0] == meta.seq_lens.shape[0], (q.shape, meta.seq_lens.shape)
        return paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, num_splits=self.num_splits,
                                      pdl=self.pdl, tuning=self.tuning)

    def warm_up(self, kv_cache: torch.Tensor, num_q_heads: int) -> None:
        """Compile every variant of the unfused decode launch this cache's shape can meet
        (launch_classes: one launch a variant, block 0, one key each): an eager step's token
        rows take the variant of their row count, and frame models run every prompt chunk
        eagerly, so a 13-row step otherwise compiled one mid-serving (0.7 s, every stream
        waiting). Writes nothing but its own output."""
        _, _, _, hkv, d = kv_cache.shape
        dev = kv_cache.device
        for batch in launch_classes(hkv, num_sms(dev), self.tuning, self.num_splits):
            q = torch.zeros(batch, num_q_heads, d, device=dev, dtype=kv_cache.dtype)
            paged_decode_attention(q, kv_cache, torch.zeros(batch, 1, device=dev, dtype=torch.int32),
                                   torch.ones(batch, device=dev, dtype=torch.int32), 1.0, num_splits=self.num_splits,
                                   pdl=self.pdl, tuning=self.tuning)

    def unsplit(self) -> TritonPagedAttention:
        """The same backend with num_splits 1 (runner/layers/base.py: for one-block caches, where
        choose_num_splits would split batch 1 on 2 KV heads 32 ways over a single tile)."""
        other = copy.copy(self)
        other.num_splits = 1
        return other

    def decode_rope_fused(self, batch: int, num_kv_heads: int, device: torch.device) -> bool:
        """Whether a pure-decode step of `batch` rows runs RoPE + KV write inside the kernel (a
        function of shapes only, so eager steps and graph replays agree): while the programs fit
        in about one wave (B * Hkv <= tuning.fused_rope_programs_per_sm * SMs; batch <= 64 on 8 KV
        heads and 132 SMs), in the kernel's two forms (FOLD_CURRENT while split, write-first
        above). Why that limit: within one wave the fused launch saves the RoPE launch; over
        several waves every program's extra work (loading q twice to rotate it, k, the store
        and barrier) adds up to more than that launch cost (docs/performance.md).

        The limit need not sit at a graph bucket (eager batch 65 fuses, its bucket 80 does not):
        it always lies where the sequences are not split, and there the fused kernel computes
        the unfused pair's values bit for bit."""
        return self.fuses_decode_rope and fused_rope_fits(batch, num_kv_heads, num_sms(device), self.tuning)

    def forward_decode_rope(
        self,
        q: torch.Tensor,  # [B, Hq, D], not rotated
        k: torch.Tensor,  # [B, Hkv, D], not rotated, not yet in the cache
        v: torch.Tensor,  # [B, Hkv, D], not yet in the cache
        cos: torch.Tensor,  # [P, D] fp32 RoPE tables
        sin: torch.Tensor,
        positions: torch.Tensor,  # [B]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,  # pure decode (meta.pure_decode)
        scale: float,
    ) -> torch.Tensor:  # [B, Hq, D]
        """RoPE, KV write and attention of a pure-decode step in one launch (plus the split
        merge): the K/V the RoPE + KV write kernel would write, and its `forward_prewritten_kv`
        output up to the fp32 order of the current token's softmax step."""
        assert meta.pure_decode and q.shape[0] == meta.seq_lens.shape[0], (q.shape, meta.seq_lens.shape)
        rope = DecodeRope(k, v, cos, sin, positions, meta.slot_mapping)
        return paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale,
                                      num_splits=self.num_splits, pdl=self.pdl, rope=rope, prefetch=self.prefetch,
                                      tuning=self.tuning)

    __call__ = forward
