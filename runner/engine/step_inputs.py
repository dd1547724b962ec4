"""Host input packing for one step: a SchedulerOutput -> StepInputs (numpy, no device work).

The flat token rows of a step: entry b's chunk of `num_tokens` tokens starting at position
`start` occupies rows qsl[b] .. qsl[b + 1] - 1; the scheduler puts one-token (decode) entries
first. T = tokens, B = entries (sequences).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from runner.engine.output_copier import HiddenSpan
from runner.engine.request import Request
from runner.engine.scheduler import SchedulerOutput
from streaming.sampling_params import SamplingParams


@dataclass
class SampleRows:
    """The rows that sample, in order (one per entry whose chunk ends at its next token)."""

    reqs: list[Request] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    out_index: list[int] = field(default_factory=list)  # index among the request's outputs of the token sampled now
    constrained: list[int] = field(default_factory=list)  # indices (into the lists above) under the model's constraint


@dataclass
class StepInputs:
    num_tokens: int  # T
    num_seqs: int  # B
    num_decodes: int  # one-token entries, first in the batch
    # [ids T | positions T | slot_mapping T | seq_lens B | query_start_loc B+1], int64, so one
    # pinned copy moves them all; `split` views the segments of this array or of its device copy
    pack: np.ndarray
    tables: np.ndarray  # [B, max_blocks] int32 block table rows of the entries
    dev_rows: list[int]  # flat rows whose token is in flight on the device ...
    dev_slots: list[int]  # ... and the slot whose `last_token` holds it
    logits_rows: list[int]  # flat rows that sample (SampleRows order)
    sample: SampleRows
    admitted: list[Request]  # entries (re)starting in their slot this step
    capture: tuple[int, ...] = ()  # sorted layers whose outputs some request wants (0 = embeddings)
    hidden_rows: np.ndarray | None = None  # [R] flat rows to copy out for the requests wanting hidden states
    hidden_spans: list[HiddenSpan] = field(default_factory=list)  # where each one's rows sit among them

    def split(self, packed):
        """The segments of `pack` or of its device copy (see `split_pack`)."""
        return split_pack(packed, self.num_tokens, self.num_seqs)

    @property
    def pure_decode(self) -> bool:
        return self.num_tokens == self.num_seqs


def pack_size(T: int, B: int) -> int:
    return 3 * (T + T % 2) + 2 * (B + B % 2) + 2


def split_pack(packed, T: int, B: int) -> tuple:
    """(ids [T], positions [T], slot_mapping [T], seq_lens [B], query_start_loc [B+1]) views of a
    packed array (host or device). Segments start at even offsets (16 bytes): Triton specialises
    pointer arguments on 16-byte alignment, and an odd T would compile a second variant of the
    RoPE/KV-write kernel mid-serving."""
    Ta, Ba = T + T % 2, B + B % 2
    return (packed[:T], packed[Ta : Ta + T], packed[2 * Ta : 2 * Ta + T],
            packed[3 * Ta : 3 * Ta + B], packed[3 * Ta + Ba : 3 * Ta + Ba + B + 1])


def pack_step_inputs(sched: SchedulerOutput, table: np.ndarray, written: list[int], block_size: int,
                     num_layers: int, wants_constraint: Callable[[Request], bool] | None) -> StepInputs:
    """Pack a step's host inputs. Also brings the host block-table mirror up to date: `table`
    [max_num_seqs, max_blocks] holds every slot's block ids, `written[slot]` how many are set
    (rows are rewritten at admission and only grow while running, so a step copies only the
    rows it needs)."""
    entries = sched.scheduled
    B, T = len(entries), sched.num_batched_tokens
    pack = np.zeros(pack_size(T, B), dtype=np.int64)
    ids, pos, slot_map, seq_lens, qsl = split_pack(pack, T, B)
    # One pass over the entries collects per-row Python ints (a numpy scalar write costs more
    # than a list append, and there are hundreds of rows); the arrays are then filled with
    # vector ops.
    row_slots: list[int] = []
    starts: list[int] = []
    counts: list[int] = []
    host_rows: list[int] = []  # one-token rows whose token is on the host (sync mode, recompute)
    host_ids: list[int] = []
    dev_rows: list[int] = []
    dev_slots: list[int] = []
    logits_rows: list[int] = []
    sample = SampleRows()
    admitted: list[Request] = []
    wanted: list[tuple[Request, int, int, tuple[int, ...]]] = []  # (req, first position, rows, layers)
    hidden_rows: list[np.ndarray] = []
    capture: set[int] = set()
    t = 0
    for e in entries:
        req = e.req
        slot = req.slot
        blocks = req.block_ids
        if e.new_admission:
            admitted.append(req)
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
                layers = tuple(l if l >= 0 else num_layers + 1 + l for l in req.hidden_state_layers)
                capture.update(layers)
                wanted.append((req, first, s + n - first, layers))
                hidden_rows.append(np.arange(t + first - s, t + n, dtype=np.int64))
                req.num_hidden_emitted = s + n
        if e.sample:
            logits_rows.append(t + n - 1)
            if wants_constraint is not None and wants_constraint(req):
                sample.constrained.append(len(sample.reqs))
            sample.reqs.append(req)
            sample.slots.append(slot)
            sample.params.append(req.sampling)
            sample.out_index.append(len(outs) + req.num_inflight - 1)  # the in-flight count includes it
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
    bs = block_size
    slot_map[:] = table[tok_slots, pos // bs].astype(np.int64) * bs + pos % bs
    tables = table[slots, : -(-int(seq_lens.max()) // bs)]
    inp = StepInputs(T, B, sched.num_decodes, pack, tables, dev_rows, dev_slots, logits_rows, sample, admitted)
    if wanted:
        inp.capture = tuple(sorted(capture))
        inp.hidden_rows = np.concatenate(hidden_rows)
        inp.hidden_spans = _copy_spans(wanted, inp.capture)
    return inp


def _copy_spans(wanted: list[tuple[Request, int, int, tuple[int, ...]]], capture: tuple[int, ...]) -> list[HiddenSpan]:
    """(req, first row in the copied block, rows, first position, columns of its layers among
    `capture`) per request, in the order of `hidden_rows`."""
    spans: list[HiddenSpan] = []
    r0 = 0
    for req, first, n, layers in wanted:
        spans.append((req, r0, n, first, [capture.index(l) for l in layers]))
        r0 += n
    return spans
