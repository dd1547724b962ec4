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
  sample_tokens()       codebook-0 logits, the depth decoder's K - 1 batched sub-steps, each
                        codebook drawn on the device by the project's sampler (race noise keyed
                        on frame * K + codebook, so a seeded request's frames do not depend on
                        its batch); records the frames in `last_frame` and copies frames and
                        their position ids to the host asynchronously.

The id reported per row is `audio_token_id`, or `audio_eos_token_id` for the frame that ends
the audio: the scheduler's stop rule and the prefix cache's ids then work unchanged (the cache
hashes the frames too, runner/engine/kv_cache.py).
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
from runner.layers.sampling_batch import SamplingBatch
from runner.models.csm import CsmModel
from runner.models.csm_sampling import CodebookSampler, CodecRange, FusedCodebooks, GreedyCodebooks, RaceCodebooks


class FrameRunner(ModelRunner):
    def __init__(self, cfg: EngineConfig, model: CsmModel, num_blocks: int, code_limit: int | None = None):
        """code_limit: codes at or above it are never drawn (the codec's codebook size)."""
        super().__init__(cfg, model, num_blocks)
        self.code_limit = code_limit
        S, k = cfg.scheduler.max_num_seqs, model.num_codebooks
        self.num_codebooks = k
        self.audio_token_id = model.cfg.audio_token_id
        self.audio_eos_token_id = model.cfg.audio_eos_token_id
        # every slot's latest frame (row S: the scratch row padding rows write)
        self.last_frame = torch.zeros(S + 1, k, dtype=torch.int64, device=self.device)
        # whether each slot's request feeds the codec (its codes are kept below code_limit); row S: padding
        self.slot_audio = torch.zeros(S + 1, dtype=torch.bool, device=self.device)
        # one launch per codebook (csm_sampling.FusedCodebooks) where it applies, else the sampler's path
        self._fused_codebooks = (self.device.type == "cuda" and self.sampler.backend == "triton"
                                 and model.cfg.codebook_size <= FusedCodebooks.max_vocab())
        model.allocate_depth_kv(S)
        self._frames_in: torch.Tensor | None = None  # the frame step's output when a graph ran it
        self.frame_graphs: FrameGraphs | None = None
        if self.device.type == "cuda" and cfg.runner.cuda_graphs:
            self.frame_graphs = FrameGraphs(self, min(cfg.runner.max_graph_batch_size, S))
            self.frame_graphs.capture()

    def _stop_ids(self) -> tuple[int, ...]:
        return ()  # codebook draws mask no stop ids (the end is a frame rule, not an id)

    def _frame_width(self) -> int:
        return self.model.num_codebooks

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
        frames, src = self._pack_frames(sched, inp)
        if self.record_timeline:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        st = ExecuteState(inp.sample, None, None, [])
        g = self.frame_graphs
        # every row one position and sampling (a one-token chunk inside a prompt samples nothing)
        graphable = g is not None and inp.pure_decode and len(inp.sample.reqs) == inp.num_seqs and not inp.hidden_spans
        bucket = g.bucket_for(inp.num_seqs) if graphable else None
        if bucket is not None:
            self._frames_in = g.run(bucket, inp, frames, src, self._table_rows(st))
        else:
            q_lens = np.diff(inp.split(inp.pack)[4])
            token_rows = self.token_rows and int(q_lens.max()) <= MAX_TOKEN_ROW_QUERY
            input_ids, pos_d, meta = self._eager_inputs(inp, q_lens, token_rows)
            frames_d = self._to_dev(frames)
            if len(src):
                rows = self._to_dev(src)
                frames_d[rows[0]] = self.last_frame[rows[1]]
            h, captured = self.model.backbone.forward_capture(self.model.embed_inputs(input_ids, frames_d), pos_d,
                                                              self.kv_caches, meta, inp.capture)
            st.hidden, st.hidden_spans = self._gather_hidden(inp, captured), inp.hidden_spans
            if inp.logits_rows:
                st.final_hidden = h.index_select(0, self._to_dev(np.asarray(inp.logits_rows, dtype=np.int64)))
        self._state = st

    def _pack_frames(self, sched: SchedulerOutput, inp: StepInputs) -> tuple[np.ndarray, np.ndarray]:
        """frames [T, K] int64 of the step's rows from the requests' FrameLogs, and [2, D] (flat
        row, slot) of the rows whose frame is still in flight (read from last_frame on the
        device). Their ids are `audio_token_id`: a generated position is always a frame."""
        frames = np.zeros((inp.num_tokens, self.num_codebooks), dtype=np.int64)
        t = 0
        for e in sched.scheduled:
            req = e.req
            known = min(e.start + e.num_tokens, req.frames.num_rows)
            if known > e.start:
                frames[t : t + known - e.start] = req.frames.rows(e.start, known)
            t += e.num_tokens
        if inp.dev_rows:
            inp.split(inp.pack)[0][inp.dev_rows] = self.audio_token_id
        return frames, np.asarray([inp.dev_rows, inp.dev_slots], dtype=np.int64).reshape(2, -1)

    def _admit(self, admitted: list[Request]) -> None:
        """Sampling parameters and seeds of the requests starting in their slot (codes have no
        penalties, so no token history is kept)."""
        fresh = []
        for req in admitted:
            if self.slot_owner[req.slot] is not req:
                self.slot_owner[req.slot] = req
                p = req.sampling
                self.sampling_table.set(req.slot, p, p.seed if p.seed is not None else self._seed_rng.getrandbits(63))
                fresh.append(req)
        if fresh and self.code_limit is not None:
            rows = self._to_dev(np.asarray([[r.slot for r in fresh], [r.audio for r in fresh]], dtype=np.int64))
            self.slot_audio[rows[0]] = rows[1].bool()

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
            frames = g.run_depth(bucket, st.final_hidden, self._table_rows(st))
        else:
            batch = self._sampling_batch(st)
            sampler = self.codebook_sampler(batch)
            hidden, logits0 = self.model.head(st.final_hidden)
            frames = self.model.depth_decode(hidden, sampler(logits0, 0), sampler)
            self.record_frames(frames, batch.slots)
        ids = self.frame_ids(frames)
        if self.record_timeline and self._t0 is not None:
            t1 = torch.cuda.Event(enable_timing=True)
            t1.record()
            self.timeline.append((self._t0, t1))
            self._t0 = None
        return self.copier.copy(ids, st.hidden, st.hidden_spans, frames=frames)

    def _table_rows(self, st: ExecuteState) -> tuple[np.ndarray, ...]:
        """The sampling rows of the step as SamplingTable arrays (a graph's batch is filled from them)."""
        tab, sl = self.sampling_table, np.asarray(st.sample.slots, dtype=np.int64)
        return tab.floats[sl], tab.top_k[sl], sl, tab.seeds[sl], np.asarray(st.sample.out_index, dtype=np.int64)

    def codebook_sampler(self, batch: SamplingBatch) -> CodebookSampler:
        rows = None  # the rows feeding the codec (their codes stay below code_limit)
        if self.code_limit is not None:
            rows = self.slot_audio[torch.where(batch.slots >= 0, batch.slots, self.slot_audio.shape[0] - 1)]
        if self._fused_codebooks:
            return FusedCodebooks(batch, self.num_codebooks, self.code_limit, rows)
        race = RaceCodebooks(self.sampler, batch, self.num_codebooks)
        if rows is None:
            return race
        return CodecRange(race, self.code_limit, rows, self.model.cfg.codebook_size)

    def frame_ids(self, frames: torch.Tensor) -> torch.Tensor:
        """[B, K] -> [B] the position id the scheduler sees: the end id for the ending frame."""
        return torch.where(self.model.frame_is_eos(frames), self.audio_eos_token_id, self.audio_token_id)

    def record_frames(self, frames: torch.Tensor, slots: torch.Tensor) -> None:
        """last_frame[slot] = frame (padding rows, slot -1, write the scratch row)."""
        rows = torch.where(slots >= 0, slots, self.last_frame.shape[0] - 1)
        self.last_frame.index_copy_(0, rows, frames)

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
