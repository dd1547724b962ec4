"""Continuous-batching scheduler: FCFS, a token budget per step, chunked prefill, preemption by
recompute when KV blocks run out.

`schedule()` decides what runs in the next step; `update_from_output()` applies a step's sampled
tokens once they reach the host. In async mode the engine calls schedule() for step N+1 before
step N's tokens are known: a request that sampled in step N carries one in-flight token
(`num_inflight`), whose id the runner takes from the device. Consequences designed in:
- max_tokens counts in-flight tokens, so no step is scheduled past the limit;
- a step scheduled after a stop token was sampled still runs, but its token is dropped at
  update time (the request is already finished): never emitted, never counted;
- blocks are freed exactly once, at finish/abort/preempt; late outputs only look at
  `req.is_finished`;
- scheduled work holds Request objects, so a reused request id never receives a late output
  of the earlier request.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from runner.config import ADMISSION_HOLD_MIN_RUNNING, SchedulerConfig
from runner.engine.kv_cache import BlockManager
from runner.engine.request import FinishReason, Request, Status


@dataclass(slots=True)
class ScheduledRequest:
    req: Request
    start: int  # first position computed this step
    num_tokens: int  # positions [start, start + num_tokens)
    sample: bool  # the chunk reaches the end of the known tokens: a token is sampled
    new_admission: bool  # (re)starts from position `num_cached` with fresh device slot state


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_decodes: int = 0  # entries [0, num_decodes) compute one token each; the rest more

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def describe(self) -> str:
        """One line for logs: "12 sequences (10 decodes, prompt chunks of 3 / 120 tokens), 133 tokens"."""
        chunks = [str(e.num_tokens) for e in self.scheduled[self.num_decodes :]]
        more = " ..." if len(chunks) > 4 else ""
        prompts = f", prompt chunks of {' / '.join(chunks[:4])}{more} tokens" if chunks else ""
        return f"{len(self.scheduled)} sequences ({self.num_decodes} decodes{prompts}), {self.num_batched_tokens} tokens"


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager, eos_token_ids: frozenset[int] = frozenset(),
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock  # Request.arrival_time's clock (tests inject one)
        self._hold_s = cfg.admission_wait_ms / 1e3
        self.eos_token_ids = eos_token_ids
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(cfg.max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.failed: list[Request] = []  # finished by the scheduler itself; the engine reports them

    # ---- membership --------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, req: Request, reason: FinishReason, message: str = "") -> None:
        """Finish a request exactly once and release its blocks and slot."""
        req.finish(reason, message)
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.blocks.free_request(req)
        if req.slot >= 0:
            self.free_slots.append(req.slot)
            req.slot = -1

    # ---- scheduling ------------------------------------------------------------------------

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.blocks.free_request(victim)
        victim.status = Status.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        bs = self.blocks

        # 1) running requests, oldest first; preempt the newest when blocks run out. This loop
        # visits every running request each step (hundreds when serving), so it reads the
        # request's counters once instead of through its properties (Request.num_tokens,
        # num_outputs_with_inflight) and skips the block manager when the request's blocks
        # already suffice.
        block_size, max_len = bs.block_size, self.cfg.max_model_len
        running = self.running
        scheduled = out.scheduled
        num_decodes = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n_prompt = len(req.prompt_token_ids)
            known = n_prompt + len(req.output_token_ids)  # tokens on the host
            total = known + req.num_inflight  # = req.num_tokens
            start = req.num_computed_tokens
            n = self._text_end(req, n_prompt, total) - start
            if n <= 0 or total - n_prompt >= req.sampling.max_tokens or total >= max_len:
                # n <= 0: chunk ended the prompt, token still in flight; or the row waits for
                # its text (_text_end). At max_tokens (in-flight tokens counted) or
                # max_model_len: the in-flight token is the last one; scheduling more would
                # compute a token that must be dropped.
                i += 1
                continue
            if n > budget:
                n = budget
            if start + n > len(req.block_ids) * block_size:  # needs blocks
                while not bs.allocate(req, n):
                    victim = running[-1]
                    if victim is req and len(running) == 1 and not scheduled:
                        # alone and still no room: the cache cannot hold this sequence
                        self.finish(req, FinishReason.ERROR, "KV cache too small for this sequence")
                        self.failed.append(req)
                        break
                    self._preempt(victim)
                    if victim is req:
                        break
                if req.status is not Status.RUNNING:
                    continue  # finished or preempted itself; the list shrank, do not advance i
            scheduled.append(self._entry(req, n, False, known, total))
            num_decodes += n == 1
            budget -= n
            i += 1

        # 2) waiting requests in arrival order (preempted ones first), while budget, slots and
        # blocks allow. A preempted request whose last token is still in flight waits for it.
        # Under load, new arrivals are admitted in groups (SchedulerConfig.admission_wait_ms).
        hold = (self._hold_s > 0 and self.waiting and len(self.running) >= ADMISSION_HOLD_MIN_RUNNING
                and self.clock() - self.waiting[0].arrival_time < self._hold_s)
        while not hold and self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if req.num_inflight:
                break
            if req.slot < 0 and not self.free_slots:
                break
            if not req.block_ids:
                req.num_computed_tokens = bs.match_prefix(req)
                if req.status is Status.WAITING and not req.num_preemptions:
                    req.num_cached_tokens = req.num_computed_tokens
            # recomputed after a preemption: a row whose text is arriving, up to its text
            total = self._text_end(req, len(req.prompt_token_ids), req.num_tokens)
            n = min(total - req.num_computed_tokens, budget)
            if n <= 0 or not bs.allocate(req, n):
                bs.free_request(req)  # give back prefix-cache hits; retried next step
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.slot < 0:
                req.slot = self.free_slots.pop()
            req.status = Status.RUNNING
            self.running.append(req)
            known = len(req.prompt_token_ids) + len(req.output_token_ids)
            out.scheduled.append(self._entry(req, n, True, known, known))  # nothing in flight here
            num_decodes += n == 1
            budget -= n

        out.num_batched_tokens = self.cfg.max_num_batched_tokens - budget
        # One-token entries first (stable): attention runs them with the decode kernel and
        # only the rest through the prefill path (AttentionMetadata.num_decodes).
        if num_decodes != len(out.scheduled) and num_decodes:
            out.scheduled.sort(key=lambda e: e.num_tokens != 1)
        out.num_decodes = num_decodes
        return out

    @staticmethod
    def _text_end(req: Request, n_prompt: int, total: int) -> int:
        """The positions a request may compute: all `total`, or, while its text is still
        arriving, all but the last while that position's input (generated frame total - 1 -
        n_prompt) has no text id yet. The row then waits there, its KV and slot kept, and
        samples nothing until the id comes (Engine.append_text)."""
        if req.open_text is not None and total > n_prompt and not req.open_text.ready(total - 1 - n_prompt):
            return total - 1
        return total

    def _entry(self, req: Request, n: int, new: bool, known: int, total: int) -> ScheduledRequest:
        """Schedule positions [num_computed_tokens, + n) of `req`, which has `known` tokens on
        the host and `total` counting those in flight (= req.num_tokens, passed in because the
        caller has it: this runs for every row of every step)."""
        start = req.num_computed_tokens
        end = req.num_computed_tokens = start + n
        sample = end == total
        if sample:
            req.num_inflight += 1
        # Publish completed blocks now: a request admitted later in this same step may share
        # them, which is safe because every layer writes the step's KV before it attends.
        self.blocks.register_full_blocks(req, known)
        return ScheduledRequest(req, start, n, sample, new)

    # ---- outputs ---------------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, sampled: list[int],
                           frames: np.ndarray | None = None) -> list[tuple[Request, int]]:
        """Apply sampled ids (one per sampling entry of `sched`, in order; with a multi-codebook
        model also `frames` [n, K], each row appended to its request's FrameLog). Returns (request,
        accepted token) for every request whose token was accepted, including those that
        finished with it. Runs over every row of every step, so the request's counters are
        read directly instead of through its properties."""
        results: list[tuple[Request, int]] = []
        eos, max_len, finished = self.eos_token_ids, self.cfg.max_model_len, Status.FINISHED
        k = 0
        for entry in sched.scheduled:
            if not entry.sample:
                continue
            tok = sampled[k]
            k += 1
            req = entry.req
            if req.status is finished:
                continue  # late output of a request that stopped/aborted meanwhile: dropped
            req.num_inflight -= 1
            outs = req.output_token_ids
            outs.append(tok)
            if frames is not None:
                req.frames.append(frames[k - 1])
            p = req.sampling
            n_out = len(outs)
            # The sampler masks stop/EOS ids while n_out <= min_tokens; the check here is the rule.
            is_stop = tok in p.stop_token_ids or (not p.ignore_eos and tok in eos)
            if is_stop and n_out > p.min_tokens:
                self.finish(req, FinishReason.STOP)
            elif n_out >= p.max_tokens or len(req.prompt_token_ids) + n_out + req.num_inflight >= max_len:
                self.finish(req, FinishReason.LENGTH)
            results.append((req, tok))
        return results
