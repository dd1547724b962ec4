"""The whole frame step of a multi-codebook talker as one CUDA graph per decode bucket, and its
depth half (codebook-0 head, depth decoder, sampling) as another for steps that also prefill.

A pure decode step of b rows replays one graph that: unpacks the step's inputs (the token
graphs' one-array layout, runner/utils/graph_inputs.py), takes each row's input frame (from the
host, or `last_frame[slot]` for a frame still in flight), embeds, runs the backbone over the
paged cache, the codebook-0 head, the depth decoder's K - 1 sub-steps over its preallocated
per-frame KV, and samples every codebook with the project's sampler, then records the frames in
`last_frame`. The host does three copies (inputs, input frames, sampling rows) and one replay;
nothing between sub-steps touches the host. A step with prompt chunks runs its backbone eagerly
and replays the depth graph of its sampling rows (`run_depth`): the depth decoder's hundreds of
small launches would otherwise cost a new request's first frame tens of milliseconds of host time.

Sampling inside a graph cannot take per-step shortcuts (all-greedy argmax, filters skipped when
no row uses them): the graph's batch turns every stage on, and a row that does not use a stage
carries its neutral value (top_k 0, top_p 1, min_p 0), which keeps the same ids; padding rows
are greedy with slot -1 (they write the scratch row). Graph and eager steps give the same frames
(tests/gpu/test_frame_graphs.py).
"""

from __future__ import annotations

import logging
import numpy as np
import torch

from runner.engine.cuda_graphs import graph_buckets
from runner.engine.step_inputs import StepInputs
from runner.layers.attention import AttentionMetadata
from runner.layers.sampling_batch import NUM_FLOAT_PARAMS, SamplingBatch
from runner.utils.capture import capture_stream, no_gc_while_capturing
from runner.utils.graph_inputs import pack_graph_inputs, staged_capacity
from runner.utils.host_staging import staging_for

log = logging.getLogger(__name__)

# neutral values of a padding row: greedy, no filter, no penalty (SamplingBatch float order)
_PAD_FLOATS = np.array([0.0, 1.0, 0.0, 1.0, 0.0, 0.0], dtype=np.float32)


class _GraphBatch:
    """One bucket's persistent sampling rows: ints [4, b] (top_k, slots, seeds, counters) then
    floats [6, b] in one byte buffer, so a step's rows are one host -> device copy."""

    def __init__(self, b: int, device: torch.device, repetition: bool = False):
        """repetition: the batch applies its rows' repetition penalty (code 0's, where the
        runner keeps a code-0 history); a row without one carries 1.0, an exact identity."""
        self.b = b
        self.n_int = 4 * 8 * b
        self.buf = torch.zeros(self.n_int + NUM_FLOAT_PARAMS * 4 * b, dtype=torch.uint8, device=device)
        ints = self.buf[: self.n_int].view(torch.int64).view(4, b)
        f = self.buf[self.n_int :].view(torch.float32).view(NUM_FLOAT_PARAMS, b)
        self.batch = SamplingBatch(
            temperature=f[0], top_p=f[1], min_p=f[2], repetition_penalty=f[3], frequency_penalty=f[4],
            presence_penalty=f[5], top_k=ints[0], slots=ints[1], seeds=ints[2], counters=ints[3],
            bias_rows=None, bias_cols=None, bias_vals=None, all_greedy=False, any_penalty=repetition,
            any_top_k=True, any_top_p=True, any_min_p=True, any_greedy=True, any_repetition=repetition,
            any_frequency=False, any_presence=False)
        self.host = np.zeros(self.buf.numel(), dtype=np.uint8)

    def pack(self, floats: np.ndarray, top_k: np.ndarray, slots: np.ndarray, seeds: np.ndarray,
             counters: np.ndarray) -> np.ndarray:
        """The host bytes of n <= b rows (the rest padding)."""
        n, b = len(slots), self.b
        ints = self.host[: self.n_int].view(np.int64).reshape(4, b)
        f = self.host[self.n_int :].view(np.float32).reshape(NUM_FLOAT_PARAMS, b)
        ints[0, :n], ints[1, :n], ints[2, :n], ints[3, :n] = top_k, slots, seeds, counters
        ints[:, n:] = 0
        ints[1, n:] = -1
        f[:, :n] = floats.T
        f[:, n:] = _PAD_FLOATS[:, None]
        return self.host


class FrameGraphs:
    def __init__(self, runner, max_bs: int):
        """runner: the FrameRunner whose model, KV cache, slot state and sampler the graphs use."""
        self.runner = runner
        self.model = runner.model
        self.device = runner.device
        self.k = runner.num_codebooks
        self.w = runner.row_width  # K codes (+ a text id where the layout has a text column)
        self.buckets = graph_buckets(max_bs)
        nb, bs = runner.num_blocks, runner.block_size
        self.scratch_slot = nb * bs
        self.max_blocks = runner.max_blocks_per_seq
        dev, i64 = self.device, dict(dtype=torch.int64, device=self.device)
        self.staged = torch.zeros(staged_capacity(max_bs, self.max_blocks), dtype=torch.int32, device=dev)
        self.frames_in = torch.zeros(max_bs * (self.w + 1), **i64)  # [b, 1 + W]: source slot (-1: host), row
        self.input_ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.slot_mapping = torch.full((max_bs,), self.scratch_slot, **i64)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((max_bs, self.max_blocks), nb, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        penalty = runner.code0_history is not None  # code 0's penalty inside the graphs
        self.batches = {b: _GraphBatch(b, dev, repetition=penalty) for b in self.buckets}
        # the groups' own parameters (FrameRunner.group_table), filled beside the code-0 rows
        self.group_batches = {b: _GraphBatch(b, dev) for b in self.buckets} if runner.group_table is not None else None
        self.staging = staging_for(dev)
        from runner.kernels.graph_inputs import unpack_graph_inputs  # Triton: CUDA only (as DecodeGraphs)

        self._unpack = unpack_graph_inputs
        self.hidden_in = torch.zeros(max_bs, runner.cfg.model.hidden_size, dtype=runner.dtype, device=dev)
        # (bucket, whole step) -> graph and its frames [b, K]; whole step False: the depth half
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.out: dict[tuple[int, bool], torch.Tensor] = {}
        self.pool = None
        self.capture_stream: torch.cuda.Stream | None = None  # capture(): the graphs' own (capture_stream)

    def bucket_for(self, b: int) -> int | None:
        for s in self.buckets:
            if s >= b:
                return s
        return None

    def _forward(self, key: tuple[int, bool]) -> torch.Tensor:
        b, whole = key
        if not whole:
            return self._depth(b, self.hidden_in[:b])
        m, k = self.model, self.k
        self._unpack(self.staged, self.runner.slots.last_token, self.input_ids[:b], self.positions[:b],
                     self.slot_mapping[:b], self.seq_lens[:b], self.block_tables[:b], self.scratch_slot)
        w = self.w
        fin = self.frames_in[: b * (w + 1)].view(b, w + 1)
        src = fin[:, 0]
        # an in-flight row's codes from last_frame; a text column always from the host
        frames_in = torch.where(src[:, None] >= 0, self.runner.last_frame[src.clamp(min=0)], fin[:, 1 : k + 1])
        if w > k:
            frames_in = torch.cat([frames_in, fin[:, k + 1 :]], dim=1)
        meta = AttentionMetadata(query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[:b],
                                 block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b],
                                 max_query_len=1, max_seq_len=self.max_blocks * self.runner.block_size,
                                 num_decodes=b, pure_decode=True)
        h = m.backbone(m.embed_inputs(self.input_ids[:b], frames_in), self.positions[:b], self.runner.kv_caches, meta)
        return self._depth(b, h)

    def _depth(self, b: int, h: torch.Tensor) -> torch.Tensor:
        """[b, H] backbone outputs -> frames [b, K], drawn with bucket b's sampling rows."""
        m = self.model
        hidden, logits0 = m.head(h)
        batch = self.batches[b].batch
        groups = self.group_batches[b].batch if self.group_batches is not None else None
        sampler = self.runner.codebook_sampler(batch, groups)
        frames = m.depth_decode(hidden, sampler(logits0, 0), sampler)
        self.runner.record_frames(frames, batch)
        return frames

    @torch.inference_mode()
    def capture(self) -> None:
        with no_gc_while_capturing():
            stream = self.capture_stream = capture_stream(self.device)
            keys = [(b, whole) for b in self.buckets for whole in (True, False)]
            with torch.cuda.stream(stream):
                for key in keys:  # Triton compiles and workspaces grow outside any capture
                    self._forward(key)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize(self.device)
            for key in sorted(keys, reverse=True):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
                    self.out[key] = self._forward(key)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[key] = g
            torch.cuda.synchronize(self.device)
        log.info("captured frame-step CUDA graphs for batch sizes %s", self.buckets)

    def _pack_batches(self, b: int, tab_rows: tuple, group_rows: tuple | None) -> None:
        gb = self.batches[b]
        self.staging.copy_into(gb.buf, gb.pack(*tab_rows))
        if self.group_batches is not None:
            gg = self.group_batches[b]
            self.staging.copy_into(gg.buf, gg.pack(*group_rows))

    def run(self, b: int, inp: StepInputs, frames: np.ndarray, src: np.ndarray, tab_rows: tuple,
            group_rows: tuple | None = None) -> torch.Tensor:
        """Replay bucket b for a pure decode step of n <= b rows: inputs (pack_step_inputs),
        their input rows [n, W] and in-flight sources [2, D] (FrameRunner._pack_frames), the
        sampling rows (SamplingTable arrays; group_rows: the group table's, where the runner
        has one) -> the frames [n, K] (a view of the graph's output, valid until the next replay)."""
        n = inp.num_seqs
        ids, pos, slot_map, seq_lens, _ = inp.split(inp.pack)
        staged = pack_graph_inputs(ids, pos, slot_map, seq_lens, np.full(n, -1, dtype=np.int64), inp.tables)
        self.staging.copy_into(self.staged, staged)
        fin = np.empty((n, self.w + 1), dtype=np.int64)
        fin[:, 0] = -1
        fin[src[0], 0] = src[1]
        fin[:, 1:] = frames
        self.staging.copy_into(self.frames_in, fin.reshape(-1))
        self._pack_batches(b, tab_rows, group_rows)
        self.graphs[(b, True)].replay()
        return self.out[(b, True)][:n]

    def run_depth(self, b: int, hidden: torch.Tensor, tab_rows: tuple, group_rows: tuple | None = None) -> torch.Tensor:
        """Replay bucket b's depth graph for n <= b sampling rows: their backbone outputs
        [n, H] (an eager step's) and sampling rows -> frames [n, K] (valid until the next replay)."""
        n = hidden.shape[0]
        self.hidden_in[:n].copy_(hidden)
        self._pack_batches(b, tab_rows, group_rows)
        self.graphs[(b, False)].replay()
        return self.out[(b, False)][:n]
