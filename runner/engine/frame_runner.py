"""The model runner of a multi-codebook talker (runner/families/csm.py): a step yields, per
sampling row, a frame of K codes.

The same two phases as ModelRunner (whose host packing, slot bookkeeping, KV cache and output
copier it reuses):
  execute_model(sched)  pack the host inputs; each position's input is its text id or its
                        frame (FrameLog rows on the host; the frame of a row still in flight is
                        `last_frame[slot]` on the device); embed and run the backbone. With CUDA
                        graphs a pure decode step replays the whole frame step instead
                        (runner/engine/frame_graphs.py: backbone, codebook-0 head, depth decoder
                        and every codebook's sampling in one graph); a step with prompt
                        chunks replays only the depth half's graph after its eager backbone.
                        A request's prompt vectors (Qwen3-TTS Base's x-vector) are added
                        over their positions' embeddings there: prompts never run in a graph.
  sample_tokens()       codebook-0 logits, the depth decoder's K - 1 batched sub-steps, each
                        codebook drawn on the device by the project's sampler (race noise keyed
                        on frame * K + codebook, so a seeded request's frames do not depend on
                        its batch); records the frames in `last_frame` and copies frames and
                        their position ids to the host asynchronously.

The id reported per row is the layout's `frame_id`, or `end_id` for the frame that ends the
audio: the scheduler's stop rule and the prefix cache's ids then work unchanged (the cache
hashes the rows too, runner/engine/kv_cache.py).

What the family declares (runner/families/base.py FrameLayout), chosen once here: a text column
in the rows (Qwen3-TTS: a generated position's input is its frame plus a text id the host
packs, FrameLog.step_text), a code-0 rule (csm_sampling.Code0Window), code 0's repetition
penalty (csm_sampling.Code0Penalty over `code0_history`, a SlotState of code 0's vocabulary:
reset when a request takes its slot, refilled from its FrameLog after a preemption, recorded
with every drawn frame) and separate parameters for groups 1..K-1 (a second SamplingTable,
same seeds and counters).

The model (CsmModel, Qwen3TtsModel) provides: `num_codebooks`, `attn`, `backbone` (a
DecoderStack), `embed_inputs(ids [T], rows [T, W])`, `head`, `depth_decode`, `frame_is_eos`,
`allocate_depth_kv`.
"""

from __future__ import annotations

import numpy as np
import torch

from runner.config import EngineConfig
from runner.engine.frame_graphs import FrameGraphs
from runner.engine.model_runner import MAX_TOKEN_ROW_QUERY, ExecuteState, ModelRunner
from runner.engine.output_copier import AsyncOutput
from runner.engine.request import Request
from runner.engine.scheduler import SchedulerOutput
from runner.engine.step_inputs import StepInputs, pack_step_inputs
from runner.families.base import FrameLayout
from runner.layers.sampling_batch import SamplingBatch, SamplingTable
from runner.layers.slot_state import SlotState
from runner.models.csm_sampling import (CodebookSampler, Code0Penalty, Code0Window, CodecRange, FusedCodebooks,
                                        GreedyCodebooks, RaceCodebooks, SplitCodebooks)


class FrameRunner(ModelRunner):
    def __init__(self, cfg: EngineConfig, model: torch.nn.Module, num_blocks: int, layout: FrameLayout,
                 code_limit: int | None = None):
        """layout: the family's rows and draws; code_limit: codes at or above it are never
        drawn (the codec's codebook size)."""
        self.layout = layout
        super().__init__(cfg, model, num_blocks)
        self.code_limit = code_limit
        S, k = cfg.scheduler.max_num_seqs, layout.num_codebooks
        if model.num_codebooks != k:
            raise ValueError(f"FrameRunner: the model yields {model.num_codebooks} codes a frame, the layout {k}")
        self.num_codebooks = k
        self.row_width = layout.row_width
        self.audio_token_id = layout.frame_id
        self.audio_eos_token_id = layout.end_id
        # groups 1..K-1 under their own parameters: per slot, as the code-0 table (same seeds)
        self.group_table = SamplingTable(S, ()) if layout.group_sampling is not None else None
        # every slot's latest frame (row S: the scratch row padding rows write)
        self.last_frame = torch.zeros(S + 1, k, dtype=torch.int64, device=self.device)
        # whether each slot's request feeds the codec (its codes are kept below code_limit); row S: padding
        self.slot_audio = torch.zeros(S + 1, dtype=torch.bool, device=self.device)
        # code 0's generated ids per slot ([S + 1, V0] counts, row S the padding rows' scratch):
        # the repetition penalty's history, kept for every request (a graph records whatever
        # the rows' penalties), allocated here so graphs capture the buffers they will read
        self.code0_history: SlotState | None = None
        if layout.code0_penalty:
            self.code0_history = SlotState(S, layout.code0.vocab, cfg.scheduler.max_model_len, self.device,
                                           backend=self.sampler.backend, tuning=cfg.runner.tuning)
            self.code0_history.allocate_penalty_buffers()
        # one launch per codebook (csm_sampling.FusedCodebooks) where it applies, else the sampler's
        # path: every codebook (CSM), or groups 1..K-1 only where code 0 has a rule of its own or
        # the groups their own parameters (Qwen3-TTS: code 0's window and penalty run the
        # sampler's path; the kernel takes one vocabulary and batch)
        fusable = (self.device.type == "cuda" and self.sampler.backend == "triton"
                   and layout.codebook_size <= FusedCodebooks.max_vocab())
        self._fused_codebooks = fusable and layout.code0 is None and self.group_table is None
        self.fused_groups = fusable and self.group_table is not None
        model.allocate_depth_kv(S)
        self._frames_in: torch.Tensor | None = None  # the frame step's output when a graph ran it
        self.frame_graphs: FrameGraphs | None = None
        if self.device.type == "cuda" and cfg.runner.cuda_graphs:
            self.frame_graphs = FrameGraphs(self, min(cfg.runner.max_graph_batch_size, S))
            self.frame_graphs.capture()

    def _stop_ids(self) -> tuple[int, ...]:
        return ()  # codebook draws mask no stop ids (the end is a frame rule, not an id)

    def _frame_width(self) -> int:
        return self.layout.num_codebooks

    def _build_graphs(self) -> None:
        """The token decode graphs do not apply: FrameGraphs captures the frame step."""

    # ---- phase 1 ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> None:
        assert self._state is None, "sample_tokens() must follow execute_model()"
        inp = pack_step_inputs(sched, self.block_table, self.blocks_written, self.block_size,
                               self.cfg.model.num_layers, None)
        # hidden states come from the eager backbone (the graphs capture no inner layers)
        self._admit(inp.admitted)
        frames, src, vectors = self._pack_frames(sched, inp)
        if self.record_timeline:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        st = ExecuteState(inp.sample, None, None, [])
        g = self.frame_graphs
        # every row one position and sampling (a one-token chunk inside a prompt samples nothing)
        graphable = (g is not None and inp.pure_decode and len(inp.sample.reqs) == inp.num_seqs and not inp.hidden_spans
                     and vectors is None)
        bucket = g.bucket_for(inp.num_seqs) if graphable else None
        if bucket is not None:
            self._frames_in = g.run(bucket, inp, frames, src, self._table_rows(st), self._group_rows(st))
        else:
            q_lens = np.diff(inp.split(inp.pack)[4])
            token_rows = self.token_rows and int(q_lens.max()) <= MAX_TOKEN_ROW_QUERY
            input_ids, pos_d, meta = self._eager_inputs(inp, q_lens, token_rows)
            frames_d = self._to_dev(frames)
            if len(src):  # in-flight frames: their codes from the device (a text column stays the host's)
                rows = self._to_dev(src)
                frames_d[rows[0], : self.num_codebooks] = self.last_frame[rows[1]]
            x = self.model.embed_inputs(input_ids, frames_d)
            if vectors is not None:  # prompt positions whose input adds a vector (an x-vector)
                x.index_add_(0, self._to_dev(vectors[0]), torch.from_numpy(vectors[1]).to(self.device, x.dtype))
            h, captured = self.model.backbone.forward_capture(x, pos_d, self.kv_caches, meta, inp.capture)
            st.hidden, st.hidden_spans = self._gather_hidden(inp, captured), inp.hidden_spans
            if inp.logits_rows:
                st.final_hidden = h.index_select(0, self._to_dev(np.asarray(inp.logits_rows, dtype=np.int64)))
        self._state = st

    def _pack_frames(self, sched: SchedulerOutput,
                     inp: StepInputs) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """frames [T, W] int64 of the step's rows from the requests' FrameLogs; [2, D] (flat
        row, slot) of the rows whose frame is still in flight (its codes read from last_frame on
        the device; its text id, with a text column, packed here: the host knows its frame
        index; their ids are `frame_id`: a generated position is always a frame); and the
        prompt vectors the step's rows add ((flat rows [n], values [n, H]), None when none)."""
        frames = np.zeros((inp.num_tokens, self.row_width), dtype=np.int64)
        text = self.layout.text_column
        vec_rows: list[np.ndarray] = []
        vec_values: list[np.ndarray] = []
        t = 0
        for e in sched.scheduled:
            req = e.req
            end = e.start + e.num_tokens
            known = min(end, req.frames.num_rows)
            if known > e.start:
                frames[t : t + known - e.start] = req.frames.rows(e.start, known)
            if text and known < end:  # the last position's frame is in flight
                frames[t + e.num_tokens - 1, -1] = req.frames.text_at(end - 1)
            if req.vectors is not None:
                pos = req.vectors.positions
                hit = (pos >= e.start) & (pos < end)
                if hit.any():
                    vec_rows.append(pos[hit] - e.start + t)
                    vec_values.append(req.vectors.values[hit])
            t += e.num_tokens
        if inp.dev_rows:
            inp.split(inp.pack)[0][inp.dev_rows] = self.audio_token_id
        vectors = (np.concatenate(vec_rows), np.concatenate(vec_values)) if vec_rows else None
        return frames, np.asarray([inp.dev_rows, inp.dev_slots], dtype=np.int64).reshape(2, -1), vectors

    def _admit(self, admitted: list[Request]) -> None:
        """Sampling parameters and seeds of the requests starting in their slot, and (with a
        code-0 penalty) their code-0 history: empty for a new request, its generated frames'
        code 0 for one recomputing after a preemption (FrameLog rows after the prompt)."""
        fresh = []
        for req in admitted:
            if self.slot_owner[req.slot] is not req:
                self.slot_owner[req.slot] = req
                p = req.sampling
                seed = p.seed if p.seed is not None else self._seed_rng.getrandbits(63)
                self.sampling_table.set(req.slot, p, seed)
                if self.group_table is not None:
                    self.group_table.set(req.slot, req.group_sampling or self.layout.group_sampling, seed)
                fresh.append(req)
        if fresh and self.code_limit is not None:
            rows = self._to_dev(np.asarray([[r.slot for r in fresh], [r.audio for r in fresh]], dtype=np.int64))
            self.slot_audio[rows[0]] = rows[1].bool()
        if admitted and self.code0_history is not None:
            self.code0_history.admit_many([(r.slot, [], self._generated_code0(r), True) for r in admitted])

    @staticmethod
    def _generated_code0(req: Request) -> list[int]:
        """Code 0 of the request's confirmed output frames (none for a new request)."""
        f, n = req.frames, len(req.output_token_ids)
        return f.codes(f.num_prompt, f.num_prompt + n)[:, 0].tolist() if n else []

    # ---- phase 2 ---------------------------------------------------------------------------

    @torch.inference_mode()
    def sample_tokens(self) -> AsyncOutput:
        st, self._state = self._state, None
        assert st is not None, "execute_model() must come first"
        n = len(st.sample.reqs)
        if not n:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return self.copier.copy(empty, st.hidden, st.hidden_spans, frames=empty.view(0, self.num_codebooks))
        g = self.frame_graphs
        bucket = g.bucket_for(n) if g is not None else None
        if self._frames_in is not None:  # the graph ran the whole frame step
            frames, self._frames_in = self._frames_in, None
        elif bucket is not None:  # an eager backbone (prompt chunks in the step): the depth graph
            frames = g.run_depth(bucket, st.final_hidden, self._table_rows(st), self._group_rows(st))
        else:
            batch = self._sampling_batch(st)
            sampler = self.codebook_sampler(batch, self._group_batch(st))
            hidden, logits0 = self.model.head(st.final_hidden)
            frames = self.model.depth_decode(hidden, sampler(logits0, 0), sampler)
            self.record_frames(frames, batch)
        ids = self.frame_ids(frames)
        if self.record_timeline and self._t0 is not None:
            t1 = torch.cuda.Event(enable_timing=True)
            t1.record()
            self.timeline.append((self._t0, t1))
            self._t0 = None
        return self.copier.copy(ids, st.hidden, st.hidden_spans, frames=frames)

    def _group_batch(self, st: ExecuteState) -> SamplingBatch | None:
        """The step's sampling rows under the groups' parameters (None: groups use the code-0 batch)."""
        if self.group_table is None:
            return None
        s = st.sample
        params = [r.group_sampling or self.layout.group_sampling for r in s.reqs]
        return self.group_table.batch(s.slots, s.out_index, params, self.device)

    def _table_rows(self, st: ExecuteState, table: SamplingTable | None = None) -> tuple[np.ndarray, ...]:
        """The sampling rows of the step as SamplingTable arrays (a graph's batch is filled from
        them), from `table` (default: the code-0 one)."""
        tab, sl = self.sampling_table if table is None else table, np.asarray(st.sample.slots, dtype=np.int64)
        return tab.floats[sl], tab.top_k[sl], sl, tab.seeds[sl], np.asarray(st.sample.out_index, dtype=np.int64)

    def _group_rows(self, st: ExecuteState) -> tuple[np.ndarray, ...] | None:
        return self._table_rows(st, self.group_table) if self.group_table is not None else None

    def codebook_sampler(self, batch: SamplingBatch, group_batch: SamplingBatch | None = None) -> CodebookSampler:
        """The frame's per-codebook draws: `batch` for code 0 (and every group unless
        `group_batch` is given: the layout's group parameters), under the layout's code-0 rule
        and the codec's range."""
        rows = None  # the rows feeding the codec (their codes stay below code_limit)
        if self.code_limit is not None:
            rows = self.slot_audio[torch.where(batch.slots >= 0, batch.slots, self.slot_audio.shape[0] - 1)]
        k = self.num_codebooks
        if self._fused_codebooks:
            return FusedCodebooks(batch, k, self.code_limit, rows)

        def general(b: SamplingBatch) -> CodebookSampler:  # the sampler's path, in the codec's range
            s = RaceCodebooks(self.sampler, b, k)
            return s if rows is None else CodecRange(s, self.code_limit, rows, self.layout.codebook_size)

        sampler = general(batch)
        if group_batch is not None:
            groups = FusedCodebooks(group_batch, k, self.code_limit, rows) if self.fused_groups else general(group_batch)
            sampler = SplitCodebooks(sampler, groups)
        if self.layout.code0 is not None:
            sampler = Code0Window(self.layout.code0, batch.counters, sampler)
        if self.code0_history is not None:  # the penalty before the window (transformers' order is moot: -inf stays -inf)
            sampler = Code0Penalty(self.sampler, batch, self.code0_history, sampler)
        return sampler

    def frame_ids(self, frames: torch.Tensor) -> torch.Tensor:
        """[B, K] -> [B] the position id the scheduler sees: the end id for the ending frame."""
        return torch.where(self.model.frame_is_eos(frames), self.audio_eos_token_id, self.audio_token_id)

    def record_frames(self, frames: torch.Tensor, batch: SamplingBatch) -> None:
        """last_frame[slot] = frame, and code 0 into the slot's code-0 history (padding rows,
        slot -1, write the scratch row / nothing). frames [B, K]; batch: the step's code-0 rows
        (slots, and counters = each row's frame index)."""
        slots = batch.slots
        rows = torch.where(slots >= 0, slots, self.last_frame.shape[0] - 1)
        self.last_frame.index_copy_(0, rows, frames)
        if self.code0_history is not None:
            self.code0_history.record(slots, frames[:, 0], batch.counters)

    @torch.inference_mode()
    def warm_sampling(self) -> None:
        """Start-up on CUDA: with graphs, every sampling row count up to the largest bucket
        replays a captured graph (its GEMM shapes loaded at capture); without, the heads and
        the depth decoder run once at every row count (cuBLAS loads a kernel per new GEMM shape,
        blocking the host mid-serving otherwise)."""
        if self.frame_graphs is not None:
            return
        S = self.cfg.scheduler.max_num_seqs
        h = torch.zeros(S, self.cfg.model.hidden_size, device=self.device, dtype=self.dtype)
        for m in range(1, S + 1):
            hidden, logits0 = self.model.head(h[:m])
            self.model.depth_decode(hidden, logits0.argmax(-1), GreedyCodebooks())
        torch.cuda.synchronize(self.device)
