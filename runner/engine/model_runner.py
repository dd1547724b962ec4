"""The model runner: turns a SchedulerOutput into a forward pass and sampled tokens.

Two phases, as in the engine step's description:
  execute_model(sched)  prepare inputs, run the forward pass to the final norm; keeps ExecuteState.
  sample_tokens()       lm_head over the columns each row can sample, sample, record the ids in device-side slot state, start the device->host
                        copies (sampled ids, and hidden rows only for requests that asked) and
                        return an AsyncOutput without waiting for them.

Sampled ids never need the host to feed the next step: a decode position whose token is still in
flight reads it from `SlotState.last_token[slot]` on the device.

CPU and CUDA differ only in `OutputCopier`, picked once at construction.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from runner.config import EngineConfig
from runner.engine.cuda_graphs import DecodeGraphs
from runner.engine.graph_inputs import pack_graph_inputs
from runner.engine.host_staging import staging_for
from runner.engine.request import Request
from runner.engine.scheduler import ScheduledRequest, SchedulerOutput
from runner.layers.attention import AttentionMetadata, allocate_kv_cache
from runner.layers.sampler import Sampler, SamplingBatch, SamplingTable, SlotState
from streaming.sampling_params import SamplingParams

# Longest query chunk run as per-token decode rows: each row re-reads its context, so the KV
# traffic grows with q_len * context; TTS prompts (~30-60 tokens) and prefix-cache tails sit
# far below, long prompts take the padded torch path.
MAX_TOKEN_ROW_QUERY = 128


class LogitsConstraint(Protocol):
    """A model-declared rule on which ids may come next, as a per-row window of allowed ids.

    vocab_span: [lo, hi), contiguous ids holding every window; the runner computes only those
    logits for constrained rows. out_index: index among the request's outputs of the token
    being sampled ([R] int64, on the device), true even in async mode. gather_window gives the
    window's logits ([R, W], -inf on ids not allowed) from logits of ids [base, base + N);
    window_ids maps sampled window columns back to token ids. The sampler's filters and race
    then run over W columns instead of the vocabulary."""

    @property
    def vocab_span(self) -> tuple[int, int]: ...

    def gather_window(self, logits: torch.Tensor, out_index: torch.Tensor, base: int = 0) -> torch.Tensor: ...

    def window_ids(self, cols: torch.Tensor, out_index: torch.Tensor) -> torch.Tensor: ...


@dataclass
class ExecuteState:
    sched: SchedulerOutput
    # the rows that sample, in order, gathered by execute_model's pass over the entries so that
    # sample_tokens needs no pass of its own: request, slot, sampling params, index among the
    # request's outputs of the token sampled now, and which rows are under the constraint
    sample_reqs: list[Request]
    sample_slots: list[int]
    sample_params: list[SamplingParams]
    out_index: list[int]
    constrained_rows: list[int]
    final_hidden: torch.Tensor | None  # [S, H] last hidden state (after the final norm) per sampling entry
    hidden: torch.Tensor | None  # [R, n_capture, H] rows of requests that want hidden states
    hidden_spans: list[tuple[Request, int, int, int, tuple[int, ...]]]  # (req, row0, nrows, first_pos, layer idx)


@dataclass
class StepResult:
    sampled: list[int]  # one per sampling entry, in order
    hidden: dict[int, tuple[int, np.ndarray]]  # id(req) -> (first position, [n, n_layers, H])


class AsyncOutput:
    """Handle to a step's outputs being copied to the host; `get()` waits only for this copy."""

    def __init__(self, sampled: torch.Tensor, hidden: torch.Tensor | None, spans, event: torch.cuda.Event | None,
                 ring_row: tuple[list, int] | None = None):
        self._sampled, self._hidden, self._spans, self._event = sampled, hidden, spans, event
        self._ring_row = ring_row  # (owners, index): the copier's pinned row holding the ids

    def get(self) -> StepResult:
        if self._event is not None:
            self._event.synchronize()
        if self._ring_row is not None:
            owners, i = self._ring_row
            assert owners[i] is self, "step output read after its pinned row was reused (read within 3 steps)"
        sampled = self._sampled.tolist()
        hidden: dict[int, tuple[int, np.ndarray]] = {}
        if self._hidden is not None:
            h = self._hidden
            if h.dtype == torch.bfloat16:
                h = h.view(torch.uint16)  # numpy has no bf16: ship the raw bits
            arr = h.numpy()
            for req, row0, n, first_pos, layer_idx in self._spans:
                hidden[id(req)] = (first_pos, arr[row0 : row0 + n][:, layer_idx, :])
        return StepResult(sampled, hidden)


class OutputCopier:
    """CPU: results are already on the host."""

    def copy(self, sampled: torch.Tensor, hidden: torch.Tensor | None, spans) -> AsyncOutput:
        return AsyncOutput(sampled, hidden, spans, None)


class CudaOutputCopier(OutputCopier):
    """Copies on a side stream into pinned buffers and records an event, so the compute stream
    moves on to the next step while the copy runs.

    The sampled ids land in a ring of RING preallocated pinned rows (a fresh pinned tensor per
    step cost the H200 host ~0.1 ms). Row i is rewritten RING steps later; the engine reads a
    step's output within the next step (async scheduling keeps one step pending), and
    AsyncOutput checks that its row was not rewritten before it was read."""

    RING = 4

    def __init__(self, device: torch.device, max_rows: int):
        self.stream = torch.cuda.Stream(device)
        self._ring = torch.empty(self.RING, max(max_rows, 1), dtype=torch.int64, pin_memory=True)
        self._owner: list[object] = [None] * self.RING  # the AsyncOutput each row belongs to
        self._next = 0

    def copy(self, sampled: torch.Tensor, hidden: torch.Tensor | None, spans) -> AsyncOutput:
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        i, self._next = self._next, (self._next + 1) % self.RING
        with torch.cuda.stream(self.stream):
            s_host = self._ring[i, : sampled.shape[0]]
            s_host.copy_(sampled, non_blocking=True)
            sampled.record_stream(self.stream)
            h_host = None
            if hidden is not None:
                h_host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
                h_host.copy_(hidden, non_blocking=True)
                hidden.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        out = AsyncOutput(s_host, h_host, spans, event, (self._owner, i))
        self._owner[i] = out
        return out


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
        # one extra block at index num_blocks: the scratch block padded graph rows write into
        self.kv_caches = allocate_kv_cache(cfg.model, num_blocks + 1, self.block_size, self.device, self.dtype)
        S = cfg.scheduler.max_num_seqs
        self.sampler = Sampler(self.device, backend=cfg.runner.sampler_backend)
        self.slots = SlotState(S, cfg.model.vocab_size, cfg.scheduler.max_model_len, self.device, backend=self.sampler.backend)
        self.slot_owner: list[Request | None] = [None] * S
        self.sampling_table = SamplingTable(S, cfg.model.eos_token_ids)
        self._seed_rng = random.Random()
        self.copier = CudaOutputCopier(self.device, S) if self.device.type == "cuda" else OutputCopier()
        if constraint is not None and not (0 <= constraint.vocab_span[0] < constraint.vocab_span[1] <= cfg.model.vocab_size):
            raise ValueError(f"the model's logits constraint spans ids {constraint.vocab_span}, outside the "
                             f"vocabulary of {cfg.model.vocab_size} (codec audio_token_offset / codebook_size?)")
        self.constraint = constraint
        # which requests sample under the constraint (None: no constraint, no request does)
        self.wants_constraint = (wants_constraint or (lambda r: False)) if constraint is not None else None
        self.eos = cfg.model.eos_token_ids
        self._state: ExecuteState | None = None
        self.staging = staging_for(self.device) if self.device.type == "cuda" else None
        # host mirror of every slot's block table; rows are rewritten at admission and
        # extended as requests grow, so a step copies only the rows it needs
        self.block_table = np.zeros((S, self.max_blocks_per_seq), dtype=np.int32)
        self.blocks_written = [0] * S
        # short prefill chunks through the decode kernel, one row per token (AttentionMetadata)
        self.token_rows = bool(getattr(getattr(model, "attn", None), "supports_token_rows", False))
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and cfg.runner.cuda_graphs:
            # rows: with token rows, every step whose chunks are short enough (up to the token
            # budget: a burst of arrivals fills it with prompts). An eager step costs the host
            # ~40 ms at that size (H200, 400 streams arriving together: 52 ms steps for ~20 ms
            # of GPU work), a replay ~1 ms. Without token rows, a full decode batch.
            rows = max(S, cfg.scheduler.max_num_batched_tokens) if self.token_rows else S
            self.graphs = DecodeGraphs(model, self.kv_caches, min(cfg.runner.max_graph_batch_size, rows),
                                       self.max_blocks_per_seq, num_blocks, self.block_size, self.device,
                                       self.slots.last_token, max_decode_rows=S,
                                       hidden_rows=S if cfg.runner.hidden_state_graphs else 0)
            self.graphs.capture()
        # GPU timeline (bench): (start, end) CUDA events per step when enabled
        self.record_timeline = False
        self.timeline: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._t0: torch.cuda.Event | None = None

    def _to_dev(self, arr: np.ndarray) -> torch.Tensor:
        if self.staging is not None:
            return self.staging.to_device(arr)
        return torch.from_numpy(arr)

    # ---- phase 1 ---------------------------------------------------------------------------

    def _admit(self, e: ScheduledRequest, admitted: list) -> None:
        """Reset device slot state when a request (re)starts (queued into `admitted` for one
        SlotState.admit_many per step). A request re-admitted after preemption keeps its noise
        seed; its noise is keyed on the output index, so sampling continues exactly as if it
        had not been preempted."""
        req = e.req
        if self.slot_owner[req.slot] is not req:
            self.slot_owner[req.slot] = req
            p = req.sampling
            self.sampling_table.set(req.slot, p, p.seed if p.seed is not None else self._seed_rng.getrandbits(63))
        admitted.append((req.slot, req.prompt_token_ids, req.output_token_ids, req.sampling.uses_penalties))

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> None:
        assert self._state is None, "sample_tokens() must follow execute_model()"
        entries = sched.scheduled
        B = len(entries)
        bs = self.block_size
        T = sched.num_batched_tokens
        # Host inputs, packed so one pinned copy moves them all:
        # [ids T | positions T | slot_mapping T | seq_lens B | query_start_loc B+1]. Segments
        # start at even offsets (16 bytes): Triton specialises pointer arguments on 16-byte
        # alignment, and an odd T gave the RoPE/KV-write kernel's positions and slot mapping a
        # second compiled variant (a 0.2 s stall the first time it happened).
        Ta, Ba = T + T % 2, B + B % 2
        pack = np.zeros(3 * Ta + 2 * Ba + 2, dtype=np.int64)
        ids, pos, slot_map = pack[:T], pack[Ta : Ta + T], pack[2 * Ta : 2 * Ta + T]
        seq_lens, qsl = pack[3 * Ta : 3 * Ta + B], pack[3 * Ta + Ba : 3 * Ta + Ba + B + 1]
        # One pass over the entries collects per-row Python ints (numpy scalar writes cost ~0.1 us
        # each, and there are hundreds of rows); the arrays are then filled with vector ops.
        row_slots: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        host_rows: list[int] = []  # one-token rows whose token is on the host (sync mode, recompute)
        host_ids: list[int] = []
        dev_rows: list[int] = []  # flat rows whose token is still on the device
        dev_slots: list[int] = []
        logits_rows: list[int] = []
        sample_reqs: list[Request] = []
        sample_slots: list[int] = []
        sample_params: list[SamplingParams] = []
        out_index: list[int] = []
        constrained_rows: list[int] = []
        wants_constraint = self.wants_constraint
        hidden_spans = []
        hidden_rows: list[np.ndarray] = []
        capture: set[int] = set()
        admitted: list = []
        table, written = self.block_table, self.blocks_written
        t = 0
        for e in entries:
            req = e.req
            slot = req.slot
            blocks = req.block_ids
            if e.new_admission:
                self._admit(e, admitted)
                table[slot, : len(blocks)] = blocks
                written[slot] = len(blocks)
            elif len(blocks) > written[slot]:  # block tables only grow while running
                w = written[slot]
                table[slot, w : len(blocks)] = blocks[w:]
                written[slot] = len(blocks)
            n, s = e.num_tokens, e.start
            row_slots.append(slot)
            starts.append(s)
            counts.append(n)
            prompt, outs = req.prompt_token_ids, req.output_token_ids
            known = len(prompt) + len(outs)
            k_end = s + n
            if k_end > known:  # the chunk's last token is in flight: take it on the device
                assert k_end == known + 1
                k_end = known
                dev_rows.append(t + n - 1)
                dev_slots.append(slot)
            if k_end > s:
                if n == 1:
                    host_rows.append(t)
                    host_ids.append(prompt[s] if s < len(prompt) else outs[s - len(prompt)])
                else:
                    ids[t : t + k_end - s] = prompt[s:k_end] if k_end <= len(prompt) else (prompt + outs)[s:k_end]
            if req.hidden_state_layers:
                first = max(s, req.num_hidden_emitted)
                if first < s + n:
                    layers = tuple(l if l >= 0 else self.cfg.model.num_layers + 1 + l for l in req.hidden_state_layers)
                    capture.update(layers)
                    hidden_spans.append((req, first, s + n - first, layers))
                    hidden_rows.append(np.arange(t + first - s, t + n, dtype=np.int64))
                    req.num_hidden_emitted = s + n
            if e.sample:
                logits_rows.append(t + n - 1)
                if wants_constraint is not None and wants_constraint(req):
                    constrained_rows.append(len(sample_reqs))
                sample_reqs.append(req)
                sample_slots.append(slot)
                sample_params.append(req.sampling)
                out_index.append(len(outs) + req.num_inflight - 1)  # the in-flight count includes it
            t += n
        slots = np.array(row_slots, dtype=np.int64)
        start = np.array(starts, dtype=np.int64)
        count = np.array(counts, dtype=np.int64)
        seq_lens[:] = start + count
        np.cumsum(count, out=qsl[1:])
        if T == B:  # one token per row
            pos[:] = start
            tok_slots = slots
        else:  # row b's tokens sit at flat rows qsl[b] .. qsl[b + 1] - 1
            pos[:] = np.repeat(start - qsl[:-1], count) + np.arange(T)
            tok_slots = np.repeat(slots, count)
        if host_rows:
            ids[host_rows] = host_ids
        slot_map[:] = table[tok_slots, pos // bs].astype(np.int64) * bs + pos % bs
        max_blocks = -(-int(seq_lens.max()) // bs)
        tables = table[slots, :max_blocks]
        self.slots.admit_many(admitted)  # before the sampler reads the rows, after this loop

        if self.record_timeline:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        q_lens = np.diff(qsl)
        # every query chunk short enough to run as per-token decode rows (MAX_TOKEN_ROW_QUERY)
        token_rows = self.token_rows and int(q_lens.max()) <= MAX_TOKEN_ROW_QUERY
        cap = tuple(sorted(capture))
        bucket = None
        if self.graphs is not None:
            if hidden_spans:  # the all-layers graphs (if captured) serve pure decode only
                bucket = self.graphs.bucket_for(B, all_layers=True) if T == B else None
            elif T == B:
                bucket = self.graphs.bucket_for(B)
            elif token_rows:
                # Short prefill chunks as decode rows (one per token, causal by its own sequence
                # length: the eager token-row path's computation) fit the decode graphs too, so
                # a step that admits requests replays a graph instead of ~300 eager launches
                # (H200: ~17 ms of host time per eager forward).
                bucket = self.graphs.bucket_for(T)
        if bucket is not None:
            # one array, one copy; the graph unpacks it (runner/engine/graph_inputs.py)
            dev_slot = np.full(T, -1, dtype=np.int64)
            dev_slot[dev_rows] = dev_slots
            if T == B:  # pure decode
                staged = pack_graph_inputs(ids, pos, slot_map, seq_lens, dev_slot, tables)
            else:  # token rows: each sees its own sequence up to itself
                staged = pack_graph_inputs(ids, pos, slot_map, pos + 1, dev_slot, np.repeat(tables, q_lens, axis=0))
            final_h, layers = self.graphs.run(bucket, staged, T == B, all_layers=bool(hidden_spans))
            captured = {layer: layers[layer] for layer in cap}
        else:
            pk = self._to_dev(pack)
            input_ids, pos_d, slot_d = pk[:T], pk[Ta : Ta + T], pk[2 * Ta : 2 * Ta + T]
            seq_d, qsl_d = pk[3 * Ta : 3 * Ta + B], pk[3 * Ta + Ba : 3 * Ta + Ba + B + 1]
            if dev_rows:
                rs = self._to_dev(np.asarray([dev_rows, dev_slots], dtype=np.int64))
                input_ids[rs[0]] = self.slots.last_token[rs[1]]
            nd = sched.num_decodes if T > B else 0  # the scheduler puts one-token rows first
            tok_lens = tok_tables = None
            if token_rows:
                tok_lens = (pos_d + 1).to(torch.int32)
                tok_tables = self._to_dev(np.repeat(tables, q_lens, axis=0))
            meta = AttentionMetadata(
                query_start_loc=qsl_d.to(torch.int32),
                seq_lens=seq_d.to(torch.int32),
                block_tables=self._to_dev(tables),
                slot_mapping=slot_d,
                max_query_len=int(q_lens.max()),
                max_seq_len=int(seq_lens.max()),
                num_decodes=nd,
                prefill_max_seq_len=int(seq_lens[nd:].max()) if nd else 0,
                token_seq_lens=tok_lens,
                token_block_tables=tok_tables,
                pure_decode=T == B,
            )
            final_h, captured = self.model(input_ids, pos_d, self.kv_caches, meta, cap)
        if len(logits_rows) != T:  # [T, H] -> the sampling rows
            final_h = final_h[self._to_dev(np.asarray(logits_rows, dtype=np.int64))] if logits_rows else None

        h_out = None
        spans = []
        if hidden_spans:
            stacked = torch.stack([captured[l] for l in cap], dim=1)  # [T, n_capture, H]
            rows = np.concatenate(hidden_rows)
            h_out = stacked[self._to_dev(rows)]
            r0 = 0
            for req, first, n, layers in hidden_spans:
                spans.append((req, r0, n, first, [cap.index(l) for l in layers]))
                r0 += n
        self._state = ExecuteState(sched, sample_reqs, sample_slots, sample_params, out_index, constrained_rows,
                                   final_h, h_out, spans)

    # ---- phase 2 ---------------------------------------------------------------------------

    def _sampling_batch(self, st: ExecuteState, rows: list[int] | None = None) -> SamplingBatch:
        """The sampling inputs of the step's sampling rows (`rows` of them; None: all)."""
        if rows is None:
            return self.sampling_table.batch(st.sample_slots, st.out_index, st.sample_params, self.device)
        return self.sampling_table.batch([st.sample_slots[i] for i in rows], [st.out_index[i] for i in rows],
                                         [st.sample_params[i] for i in rows], self.device)

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
            # writing and reading the [N, V] fp32 copy (H200, batch 64: ~50 us of a 3.2 ms step)
            return self.model.greedy_ids(final_h)
        return self.sampler(self.model.compute_logits(final_h), batch, self.slots)

    @torch.inference_mode()
    def warm_sampling(self) -> None:
        """Start-up: the lm_head at every row count a step can sample (1..max_num_seqs, over the
        constraint's span and the full vocabulary, and as greedy_ids), then the sampler and the token record once
        at max_num_seqs padding rows (the scratch slot; every filter and penalty on).

        Why: the first lm_head GEMM at a row count never seen before blocks the host until the
        device is idle. On the H200 a burst of 400 arrivals spent ~19 ms of host time per
        prefill step in compute_logits (rows 193 and 379), so the next step could not be
        prepared while the forward ran; with this pass it stayed under 0.5 ms. The sampler pass
        alone (caching-allocator blocks for the largest step) did not remove it, so the cost is
        per GEMM shape: most likely cuBLAS loading the kernel it picks for that shape, as torch
        runs CUDA with lazy module loading (deploy/RESULTS.md, s8)."""
        S = self.cfg.scheduler.max_num_seqs
        h = torch.zeros(S, self.cfg.model.hidden_size, device=self.device, dtype=self.dtype)
        spans = [None] + ([self.constraint.vocab_span] if self.constraint is not None else [])
        for m in range(1, S + 1):
            for span in spans:
                self.model.compute_logits(h[:m], span)
            self.model.greedy_ids(h[:m])  # greedy steps: the head's fused argmax (ops.greedy_head)
        # The penalty buffers are allocated here, not at the first request with a penalty: that
        # request would otherwise compile the penalty and counting record kernels mid-serving
        # (a text model on the H200, s10), and their memory is better taken before serving.
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
        n = len(st.sample_reqs)
        if not n:
            return self.copier.copy(torch.empty(0, dtype=torch.int64, device=self.device), st.hidden, st.hidden_spans)
        c_rows = st.constrained_rows
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
