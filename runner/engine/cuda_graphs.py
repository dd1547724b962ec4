"""CUDA graphs for decode steps.

A pure-decode batch of B <= max sequences replays the graph of the smallest captured bucket
>= B. Inputs live in persistent device buffers that the graph reads, and the graph fills them
itself: its first kernel unpacks the one array the host copied into `staged` for the step
(runner/utils/graph_inputs.py). Padded rows (B..bucket-1)
write their K/V into a scratch block that the block manager never hands out, have seq_len 0
(the decode kernel writes zeros for them) and their logits are ignored.

Captured: embedding -> layers -> final norm, i.e. the last hidden state of every row. The
lm_head and sampling stay outside: which vocabulary columns a row needs (all of them, or a
constraint's span) and which filters run are per-step choices made on the host.

Two families where the attention backend fuses RoPE into pure-decode steps
(`decode_rope_fused`): pure-decode graphs (each row a distinct sequence: RoPE and the KV write
run inside the attention kernel) for the buckets up to the most sequences a step can decode, and
token-row graphs (short prefill chunks, one row per token: rows read K/V that other rows of the
same launch write, so the KV write stays a launch of its own) for every bucket; the latter also
serve pure decode at the other buckets.

Optionally (`hidden_rows` > 0, RunnerConfig.hidden_state_graphs) a third family for pure-decode
steps in which some request wants hidden states: the same forward, in the same form as the
plain graph of its bucket (so the same values), that also keeps every layer's output (0 =
embeddings .. L = after the final norm, as the model's `capture_layers`). Without it such a step
runs eagerly, and an eager step is host-bound (several times a replay's time), which every
other stream of the batch waits for.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from runner.layers.attention import AttentionMetadata
from runner.utils.capture import capture_stream, no_gc_while_capturing
from runner.utils.graph_inputs import staged_capacity, unpack_graph_inputs_torch
from runner.utils.host_staging import staging_for

log = logging.getLogger(__name__)


def graph_buckets(max_bs: int) -> list[int]:
    # above 1024 rows (prefill bursts as token rows) padding to 128 wastes at most ~11%
    sizes = [1, 2, 4, 8] + list(range(16, 128, 16)) + list(range(128, 1025, 32)) + list(range(1152, 8193, 128))
    return [s for s in sizes if s < max_bs] + [max_bs]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_bs: int, max_blocks: int,
                 scratch_block: int, block_size: int, device: torch.device, last_token: torch.Tensor,
                 max_decode_rows: int | None = None, hidden_rows: int = 0):
        """last_token: the sampler's persistent [slots] int64 tensor of each slot's latest token
        (rows whose token is still in flight read it; runner/utils/graph_inputs.py)."""
        self.model = model
        self.kv_caches = kv_caches
        self.max_bs = max_bs
        self.buckets = graph_buckets(max_bs)
        # (pure_decode, buckets) per family; pure_decode False also serves decode steps when the
        # backend does not tell the two apart
        top = self.bucket_for(min(max_decode_rows or max_bs, max_bs))
        self.families: dict[bool, list[int]] = {False: self.buckets}
        hkv = model.cfg.num_kv_heads
        pure = [s for s in self.buckets if s <= top and model.attn.decode_rope_fused(s, hkv, device)]
        if pure:
            self.families[True] = pure
        self._pure_buckets = frozenset(self.families.get(True, ()))
        # all-layers graphs for pure decode up to hidden_rows sequences (empty: such steps run eagerly)
        top_h = self.bucket_for(min(hidden_rows, max_bs)) if hidden_rows > 0 else 0
        self.hidden_buckets = [s for s in self.buckets if s <= top_h]
        self.all_layers = tuple(range(model.cfg.num_layers + 1))
        self.device = device
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.block_size = block_size
        if (scratch_block + 1) * block_size >= 2**31:
            raise ValueError(f"{scratch_block + 1} KV blocks of {block_size}: cache slots must fit int32 (graph inputs)")
        # persistent inputs, sliced per bucket; every graph starts by filling them from `staged`
        # (runner/utils/graph_inputs.py), which one copy per step writes
        self.staged = torch.zeros(staged_capacity(max_bs, max_blocks), dtype=torch.int32, device=device)
        self.last_token = last_token
        # the step's one copy (through the pinned ring on CUDA: non-blocking) and the unpack
        # every graph starts with (the Triton kernel on CUDA; the torch reference elsewhere)
        if device.type == "cuda":
            from runner.kernels.graph_inputs import unpack_graph_inputs

            staging = staging_for(device)
            self._upload = lambda arr: staging.copy_into(self.staged, arr)
            self._unpack = unpack_graph_inputs
        else:
            self._upload = lambda arr: self.staged[: arr.size].copy_(torch.from_numpy(arr))
            self._unpack = unpack_graph_inputs_torch
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), self.scratch_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_bs, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.max_blocks = max_blocks
        # key: (bucket, pure_decode, all_layers)
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        self.hidden: dict[tuple[int, bool, bool], torch.Tensor] = {}  # final hidden [bucket, H]
        self.layers: dict[tuple[int, bool, bool], dict[int, torch.Tensor]] = {}  # all_layers: {layer: [bucket, H]}
        self.pool = None
        self.capture_stream: torch.cuda.Stream | None = None  # capture(): the graphs' own (capture_stream)

    def _meta(self, b: int, pure: bool) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,  # unused by the decode kernel
            pure_decode=pure,
        )

    def _forward(self, key: tuple[int, bool, bool]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        b, pure, all_layers = key
        self._unpack(self.staged, self.last_token, self.input_ids[:b], self.positions[:b], self.slot_mapping[:b],
                     self.seq_lens[:b], self.block_tables[:b], self.scratch_slot)
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b, pure),
                          self.all_layers if all_layers else ())

    def _keys(self) -> list[tuple[int, bool, bool]]:
        keys = [(b, pure, False) for pure, buckets in self.families.items() for b in buckets]
        # the all-layers graph of a bucket takes the form its plain pure-decode graph has
        return keys + [(b, b in self._pure_buckets, True) for b in self.hidden_buckets]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool."""
        with no_gc_while_capturing():
            self._capture()

    def _capture(self) -> None:
        stream = self.capture_stream = capture_stream(self.device)
        with torch.cuda.stream(stream):
            # every bucket once: Triton compiles a variant per split count (which depends on
            # the batch size) and compilation must not happen inside a capture
            for key in self._keys():
                self._forward(key)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.device)
        # largest first (the shared pool is sized by the first capture); only one graph replays
        # at a time, so the families share it too
        for key in sorted(self._keys(), reverse=True):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, stream=stream):
                self.hidden[key], self.layers[key] = self._forward(key)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[key] = g
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s%s%s", self.buckets,
                 f" (pure-decode graphs up to {self.families[True][-1]})" if True in self.families else "",
                 f" (all-layers graphs up to {self.hidden_buckets[-1]})" if self.hidden_buckets else "")

    def bucket_for(self, b: int, all_layers: bool = False) -> int | None:
        """The smallest captured bucket >= b (all_layers: of the all-layers family, which
        serves pure decode only), or None."""
        for s in self.hidden_buckets if all_layers else self.buckets:
            if s >= b:
                return s
        return None

    def run(self, bucket: int, staged: np.ndarray, pure_decode: bool,
            all_layers: bool = False) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Copy `staged` (pack_graph_inputs of b <= bucket rows) to the device, replay (the
        graph unpacks it: rows [0, b) real, [b, bucket) padding), and return the final hidden
        states of the real rows ([b, H]) and, with `all_layers` (a bucket from bucket_for(b,
        True), pure decode only), every layer's output {layer: [b, H]} (else {}): views of the
        graph's outputs, valid until the next replay. `pure_decode`: every row is a distinct
        sequence's one new token (else: token rows)."""
        assert pure_decode or not all_layers, "the all-layers graphs serve pure decode only"
        b = int(staged[0])
        assert 0 < b <= bucket and staged[1] <= self.max_blocks, (b, bucket, staged[1])
        key = (bucket, pure_decode and bucket in self._pure_buckets, all_layers)
        self._upload(staged)
        self.graphs[key].replay()
        return self.hidden[key][:b], {layer: t[:b] for layer, t in self.layers[key].items()}
