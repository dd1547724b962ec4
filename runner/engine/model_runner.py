"""The model runner: turns a SchedulerOutput into a forward pass and sampled tokens.

Two phases, as in the engine step's description:
  execute_model(sched)  pack the host inputs (step_inputs.py), run the forward pass to the final
                        norm as a graph replay or eagerly, keep the hidden rows requests asked
                        for; leaves an ExecuteState.
  sample_tokens()       lm_head over the columns each row can sample, sample, record the ids in
                        device-side slot state, start the device->host copies (sampled ids, and
                        hidden rows only for requests that asked) and return an AsyncOutput
                        without waiting for them (output_copier.py).

Sampled ids never need the host to feed the next step: a decode position whose token is still in
flight reads it from `SlotState.last_token[slot]` on the device.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from runner.config import EngineConfig
from runner.engine.cuda_graphs import DecodeGraphs
from runner.engine.output_copier import AsyncOutput, HiddenSpan, output_copier_for
from runner.engine.request import Request
from runner.engine.scheduler import SchedulerOutput
from runner.engine.step_inputs import SampleRows, StepInputs, pack_step_inputs
from runner.families.base import LogitsConstraint
from runner.layers.attention import AttentionMetadata, allocate_kv_cache
from runner.layers.sampler import Sampler
from runner.layers.sampling_batch import SamplingBatch, SamplingTable
from runner.layers.slot_state import SlotState
from runner.utils.graph_inputs import pack_graph_inputs
from runner.utils.host_staging import staging_for
from streaming.sampling_params import SamplingParams

# Longest query chunk run as per-token decode rows: each row re-reads its context, so the KV
# traffic grows with q_len * context; TTS prompts (~30-60 tokens) and prefix-cache tails sit
# far below, long prompts take the padded torch path.
MAX_TOKEN_ROW_QUERY = 128


@dataclass
class ExecuteState:
    """What execute_model leaves for sample_tokens."""

    sample: SampleRows
    final_hidden: torch.Tensor | None  # [S, H] last hidden state (after the final norm) per sampling row
    hidden: torch.Tensor | None  # [R, n_capture, H] rows of requests that want hidden states
    hidden_spans: list[HiddenSpan]


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model: torch.nn.Module, num_blocks: int,
                 constraint: LogitsConstraint | None = None,
                 wants_constraint: Callable[[Request], bool] | None = None):
        self.cfg = cfg
        self.model = model
        self.device = cfg.runner.torch_device
        self.dtype = cfg.runner.torch_dtype
        self.block_size = cfg.cache.block_size
        self.max_blocks_per_seq = -(-cfg.scheduler.max_model_len // self.block_size)
        self.num_blocks = num_blocks
        # one extra block at index num_blocks: the scratch block padded graph rows write into
        self.kv_caches = allocate_kv_cache(cfg.model, num_blocks + 1, self.block_size, self.device, self.dtype)
        S = cfg.scheduler.max_num_seqs
        self.sampler = Sampler(self.device, backend=cfg.runner.sampler_backend, tuning=cfg.runner.tuning)
        self.slots = SlotState(S, cfg.model.vocab_size, cfg.scheduler.max_model_len, self.device,
                               backend=self.sampler.backend, tuning=cfg.runner.tuning)
        self.slot_owner: list[Request | None] = [None] * S
        self.sampling_table = SamplingTable(S, self._stop_ids())
        self._seed_rng = random.Random()
        self.copier = output_copier_for(self.device, S, self._frame_width())
        if constraint is not None and not (0 <= constraint.vocab_span[0] < constraint.vocab_span[1] <= cfg.model.vocab_size):
            raise ValueError(f"the model's logits constraint spans ids {constraint.vocab_span}, outside the "
                             f"vocabulary of {cfg.model.vocab_size} (codec audio_token_offset / codebook_size?)")
        self.constraint = constraint
        # which requests sample under the constraint (None: no constraint, no request does)
        self.wants_constraint = (wants_constraint or (lambda r: False)) if constraint is not None else None
        self.eos = cfg.model.eos_token_ids
        self._state: ExecuteState | None = None
        self.staging = staging_for(self.device) if self.device.type == "cuda" else None
        # host mirror of every slot's block table (pack_step_inputs keeps it up to date)
        self.block_table = np.zeros((S, self.max_blocks_per_seq), dtype=np.int32)
        self.blocks_written = [0] * S
        # short prefill chunks through the decode kernel, one row per token (AttentionMetadata)
        self.token_rows = bool(model.attn.supports_token_rows)
        self.graphs: DecodeGraphs | None = None
        self._build_graphs()
        # GPU timeline (bench): (start, end) CUDA events per step when enabled
        self.record_timeline = False
        self.timeline: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._t0: torch.cuda.Event | None = None

    def _stop_ids(self) -> tuple[int, ...]:
        """Ids the sampling table masks while a request is short of its min_tokens: the EOS ids."""
        return self.cfg.model.eos_token_ids

    def _frame_width(self) -> int:
        """Codes a sampling row yields beside its id, for the output copier (0: tokens only)."""
        return 0

    def _build_graphs(self) -> None:
        cfg, model, S, num_blocks = self.cfg, self.model, self.cfg.scheduler.max_num_seqs, self.num_blocks
        if self.device.type == "cuda" and cfg.runner.cuda_graphs:
            # rows: with token rows, every step whose chunks are short enough (up to the token
            # budget: a burst of arrivals fills it with prompts), as an eager step of that size
            # is host-bound and a replay is not. Without token rows, a full decode batch.
            rows = max(S, cfg.scheduler.max_num_batched_tokens) if self.token_rows else S
            self.graphs = DecodeGraphs(model, self.kv_caches, min(cfg.runner.max_graph_batch_size, rows),
                                       self.max_blocks_per_seq, num_blocks, self.block_size, self.device,
                                       self.slots.last_token, max_decode_rows=S,
                                       hidden_rows=S if cfg.runner.hidden_state_graphs else 0)
            self.graphs.capture()

    def _to_dev(self, arr: np.ndarray) -> torch.Tensor:
        if self.staging is not None:
            return self.staging.to_device(arr)
        return torch.from_numpy(arr)

    # ---- phase 1 ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> None:
        """Pack the host inputs, run the forward pass (a graph replay or eager) to the final
        norm, keep the hidden rows requests asked for; sample_tokens() goes on from there."""
        assert self._state is None, "sample_tokens() must follow execute_model()"
        inp = pack_step_inputs(sched, self.block_table, self.blocks_written, self.block_size,
                               self.cfg.model.num_layers, self.wants_constraint)
        self._admit(inp.admitted)
        if self.record_timeline:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        q_lens = np.diff(inp.split(inp.pack)[4])
        # every query chunk short enough to run as per-token decode rows (MAX_TOKEN_ROW_QUERY)
        token_rows = self.token_rows and int(q_lens.max()) <= MAX_TOKEN_ROW_QUERY
        bucket = self._graph_bucket(inp, token_rows)
        if bucket is not None:
            final_h, captured = self._forward_graph(bucket, inp, q_lens)
        else:
            final_h, captured = self._forward_eager(inp, q_lens, token_rows)
        if len(inp.logits_rows) != inp.num_tokens:  # [T, H] -> the sampling rows
            final_h = final_h[self._to_dev(np.asarray(inp.logits_rows, dtype=np.int64))] if inp.logits_rows else None
        self._state = ExecuteState(inp.sample, final_h, self._gather_hidden(inp, captured), inp.hidden_spans)

    def _admit(self, admitted: list[Request]) -> None:
        """Reset device slot state of the requests (re)starting in their slot this step, before
        the sampler reads the rows. A request re-admitted after preemption keeps its noise seed;
        its noise is keyed on the output index, so sampling continues exactly as if it had not
        been preempted."""
        if not admitted:
            return
        for req in admitted:
            if self.slot_owner[req.slot] is not req:
                self.slot_owner[req.slot] = req
                p = req.sampling
                self.sampling_table.set(req.slot, p, p.seed if p.seed is not None else self._seed_rng.getrandbits(63))
        self.slots.admit_many([(r.slot, r.prompt_token_ids, r.output_token_ids, r.sampling.uses_penalties) for r in admitted])

    def _graph_bucket(self, inp: StepInputs, token_rows: bool) -> int | None:
        """The captured graph bucket that serves this step, None: run it eagerly."""
        if self.graphs is None:
            return None
        if inp.hidden_spans:  # the all-layers graphs (if captured) serve pure decode only
            return self.graphs.bucket_for(inp.num_seqs, all_layers=True) if inp.pure_decode else None
        if inp.pure_decode:
            return self.graphs.bucket_for(inp.num_seqs)
        if token_rows:
            # Short prefill chunks as decode rows (one per token, causal by its own sequence
            # length: the eager token-row path's computation) fit the decode graphs too, so a
            # step that admits requests replays a graph instead of hundreds of eager launches.
            return self.graphs.bucket_for(inp.num_tokens)
        return None

    def _forward_graph(self, bucket: int, inp: StepInputs, q_lens: np.ndarray) -> tuple[torch.Tensor, dict]:
        """Replay: one array, one copy; the graph unpacks it (runner/utils/graph_inputs.py)."""
        ids, pos, slot_map, seq_lens, _ = inp.split(inp.pack)
        dev_slot = np.full(inp.num_tokens, -1, dtype=np.int64)
        dev_slot[inp.dev_rows] = inp.dev_slots
        if inp.pure_decode:
            staged = pack_graph_inputs(ids, pos, slot_map, seq_lens, dev_slot, inp.tables)
        else:  # token rows: each sees its own sequence up to itself
            staged = pack_graph_inputs(ids, pos, slot_map, pos + 1, dev_slot, np.repeat(inp.tables, q_lens, axis=0))
        final_h, layers = self.graphs.run(bucket, staged, inp.pure_decode, all_layers=bool(inp.hidden_spans))
        return final_h, {layer: layers[layer] for layer in inp.capture}

    def _forward_eager(self, inp: StepInputs, q_lens: np.ndarray, token_rows: bool) -> tuple[torch.Tensor, dict]:
        input_ids, pos_d, meta = self._eager_inputs(inp, q_lens, token_rows)
        if inp.dev_rows:
            rs = self._to_dev(np.asarray([inp.dev_rows, inp.dev_slots], dtype=np.int64))
            input_ids[rs[0]] = self.slots.last_token[rs[1]]
        return self.model(input_ids, pos_d, self.kv_caches, meta, inp.capture)

    def _eager_inputs(self, inp: StepInputs, q_lens: np.ndarray, token_rows: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's ids [T] and positions [T] on the device (ids of in-flight rows not filled
        in) and its attention metadata, for an eager forward."""
        T, B = inp.num_tokens, inp.num_seqs
        seq_lens = inp.split(inp.pack)[3]
        input_ids, pos_d, slot_d, seq_d, qsl_d = inp.split(self._to_dev(inp.pack))
        nd = inp.num_decodes if T > B else 0  # the scheduler puts one-token rows first
        tok_lens = tok_tables = None
        if token_rows:
            tok_lens = (pos_d + 1).to(torch.int32)
            tok_tables = self._to_dev(np.repeat(inp.tables, q_lens, axis=0))
        meta = AttentionMetadata(
            query_start_loc=qsl_d.to(torch.int32),
            seq_lens=seq_d.to(torch.int32),
            block_tables=self._to_dev(inp.tables),
            slot_mapping=slot_d,
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            num_decodes=nd,
            prefill_max_seq_len=int(seq_lens[nd:].max()) if nd else 0,
            token_seq_lens=tok_lens,
            token_block_tables=tok_tables,
            pure_decode=T == B,
        )
        return input_ids, pos_d, meta

    def _gather_hidden(self, inp: StepInputs, captured: dict) -> torch.Tensor | None:
        """[R, n_capture, H]: the captured layers' rows of the requests that want hidden states."""
        if not inp.hidden_spans:
            return None
        stacked = torch.stack([captured[l] for l in inp.capture], dim=1)  # [T, n_capture, H]
        return stacked[self._to_dev(inp.hidden_rows)]

    # ---- phase 2 ---------------------------------------------------------------------------

    def _sampling_batch(self, st: ExecuteState, rows: list[int] | None = None) -> SamplingBatch:
        """The sampling inputs of the step's sampling rows (`rows` of them; None: all)."""
        s = st.sample
        if rows is None:
            return self.sampling_table.batch(s.slots, s.out_index, s.params, self.device)
        return self.sampling_table.batch([s.slots[i] for i in rows], [s.out_index[i] for i in rows],
                                         [s.params[i] for i in rows], self.device)

    def _sample_constrained(self, final_h: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Rows under the model's constraint: logits of the constraint's vocabulary span only,
        penalties and bias on those, then the sampler's filters and race over each row's
        window of allowed ids (the same distribution as the masked full row)."""
        lo, hi = self.constraint.vocab_span
        logits = self.model.compute_logits(final_h, (lo, hi))  # [R, hi - lo]
        self.sampler.penalize(logits, batch, self.slots, col0=lo)
        window = self.constraint.gather_window(logits, batch.counters, base=lo)
        return self.constraint.window_ids(self.sampler.sample(window, batch), batch.counters)

    def _sample_free(self, final_h: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.all_greedy and not batch.any_penalty and batch.bias_vals is None:
            # nothing changes the logits: argmax over the model-dtype ones (the same ids) saves
            # writing and reading the [N, V] fp32 copy
            return self.model.greedy_ids(final_h)
        return self.sampler(self.model.compute_logits(final_h), batch, self.slots)

    @torch.inference_mode()
    def warm_attention(self) -> None:
        """Start-up: the attention backend's launches for every batch size an eager step can
        bring (AttentionBackend.warm_up), on the model's cache shape (every layer's is alike)."""
        self.model.attn.warm_up(self.kv_caches[0], self.cfg.model.num_heads)

    @torch.inference_mode()
    def warm_sampling(self) -> None:
        """Start-up: the lm_head at every row count a step can sample (1..max_num_seqs, over the
        constraint's span and the full vocabulary, and as greedy_ids), then the sampler and the token record once
        at max_num_seqs padding rows (the scratch slot; every filter and penalty on).

        Why: the first lm_head GEMM at a row count never seen before blocks the host until the
        device is idle (most likely cuBLAS loading the kernel it picks for that shape: torch runs
        CUDA with lazy module loading), so the next step cannot be prepared while the forward
        runs, and a burst of arrivals meets many new row counts at once. Warming the sampler
        alone (caching-allocator blocks for the largest step) does not remove it: the cost is
        per GEMM shape."""
        S = self.cfg.scheduler.max_num_seqs
        h = torch.zeros(S, self.cfg.model.hidden_size, device=self.device, dtype=self.dtype)
        spans = [None] + ([self.constraint.vocab_span] if self.constraint is not None else [])
        for m in range(1, S + 1):
            for span in spans:
                self.model.compute_logits(h[:m], span)
            self.model.greedy_ids(h[:m])  # greedy steps: the head's fused argmax (ops.greedy_head)
        # The penalty buffers are allocated here, not at the first request with a penalty: that
        # request would otherwise compile the penalty and counting record kernels mid-serving,
        # and their memory is better taken before serving.
        self.slots.allocate_penalty_buffers()
        sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
                            frequency_penalty=0.1, presence_penalty=0.1)
        batch = SamplingBatch.build([sp] * S, [-1] * S, [0] * S, [0] * S, [], self.device)  # slot -1: scratch row
        self.slots.record(batch.slots, self._sample_free(h, batch), batch.counters)  # padding rows: writes nothing
        if self.constraint is not None:
            self._sample_constrained(h, batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def sample_tokens(self) -> AsyncOutput:
        """Phase 2: lm_head (over the columns each row can sample) and sampling; the sampled
        ids are copied to the host asynchronously."""
        st, self._state = self._state, None
        assert st is not None, "execute_model() must come first"
        n = len(st.sample.reqs)
        if not n:
            return self.copier.copy(torch.empty(0, dtype=torch.int64, device=self.device), st.hidden, st.hidden_spans)
        c_rows = st.sample.constrained
        final_h = st.final_hidden
        if not c_rows or len(c_rows) == n:
            batch = self._sampling_batch(st)
            sampled = (self._sample_constrained if c_rows else self._sample_free)(final_h, batch)
            self.slots.record(batch.slots, sampled, batch.counters)
        else:
            # Constrained and free rows sample separately, each as it would alone: a request's
            # tokens must not depend on what else shares its batch.
            sampled = torch.empty(n, dtype=torch.int64, device=self.device)
            constrained = set(c_rows)
            free = [i for i in range(n) if i not in constrained]
            for rows, sample in ((c_rows, self._sample_constrained), (free, self._sample_free)):
                rows_t = self._to_dev(np.asarray(rows, dtype=np.int64))
                batch = self._sampling_batch(st, rows)
                ids = sample(final_h[rows_t], batch)
                sampled[rows_t] = ids
                self.slots.record(batch.slots, ids, batch.counters)
        if self.record_timeline and self._t0 is not None:
            t1 = torch.cuda.Event(enable_timing=True)
            t1.record()
            self.timeline.append((self._t0, t1))
            self._t0 = None
        return self.copier.copy(sampled, st.hidden, st.hidden_spans)
