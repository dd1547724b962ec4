"""The one request-state object the engine keeps per request.

Token accounting (async scheduling schedules step N+1 before step N's token reaches the host):

    all_token_ids   = prompt + confirmed outputs            (known on the host)
    num_inflight    = tokens sampled on the device, not yet on the host (at most 2: step N's
                      token is resolved after step N+1 was scheduled)
    num_tokens      = len(all_token_ids) + num_inflight     (length including placeholders)
    num_computed_tokens = positions whose KV is written or scheduled to be written

A request is finished exactly once (`finish()`); outputs that arrive later for a finished
request are dropped by identity (`Request` objects, never ids, travel with scheduled work),
so a client may reuse an id while a late output of the old request is still in flight.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from runner.families.base import PromptVectors, StepText
from streaming.sampling_params import SamplingParams

_seq_counter = itertools.count()


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # client cancelled / disconnected
    ERROR = "error"  # e.g. invalid audio codes


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class FrameLog:
    """The input row of every position of a multi-codebook request: the prompt's first, then
    one per accepted output frame. A row is the frame's K codes, then, for a family whose
    generated positions also carry a text id (`step_text`), that id: width K or K + 1. The
    model embeds a position from its row (rows of text-only positions are the family's
    business: CSM leaves zeros, Qwen3-TTS -1 codes); the prefix cache hashes the whole rows
    with the ids (two voice prompts differ only in their frames, two trailing texts only in
    the text column)."""

    def __init__(self, prompt_rows: np.ndarray, num_codes: int | None = None, step_text: StepText | None = None):
        n, w = prompt_rows.shape
        self.num_codes = w if num_codes is None else num_codes
        if w != self.num_codes + (step_text is not None):
            raise ValueError(f"FrameLog: rows of width {w} for {self.num_codes} codes "
                             f"{'with' if step_text is not None else 'without'} a text column")
        self.step_text = step_text
        self.num_prompt = n
        self._rows = np.empty((max(2 * n, 64), w), dtype=np.int64)
        self._rows[:n] = prompt_rows
        self.num_rows = n

    @property
    def width(self) -> int:
        return self._rows.shape[1]

    def text_at(self, position: int) -> int:
        """The text id of a generated position (known or still in flight)."""
        assert self.step_text is not None and position >= self.num_prompt, position
        return self.step_text.at(position - self.num_prompt)

    def append(self, frame: np.ndarray) -> None:
        """frame (K,): the codes of the next position (its text id, if any, is filled in here)."""
        # once per request per step: locals over repeated attribute reads
        n, rows, k = self.num_rows, self._rows, self.num_codes
        if n == len(rows):
            rows = np.empty((2 * n, self.width), dtype=np.int64)
            rows[:n] = self._rows[:n]
            self._rows = rows
        rows[n, :k] = frame
        if self.step_text is not None:
            rows[n, k] = self.step_text.at(n - self.num_prompt)
        self.num_rows = n + 1

    def refresh_text(self) -> None:
        """Fill the text column of generated rows appended before their text arrived (an open
        StepText that grew or closed since)."""
        st, k = self.step_text, self.num_codes
        n = self.num_rows - 1  # pending rows are the tail: text arrives in order
        while n >= self.num_prompt and self._rows[n, k] == StepText.PENDING:
            n -= 1
        for n in range(n + 1, self.num_rows):
            if not st.ready(n - self.num_prompt):
                break
            self._rows[n, k] = st.at(n - self.num_prompt)

    def last(self) -> np.ndarray:
        """(K,) view of the latest position's codes (the frame just accepted)."""
        return self._rows[self.num_rows - 1, : self.num_codes]

    def rows(self, start: int, end: int) -> np.ndarray:
        """[end - start, width] view of positions start .. end - 1 (all known)."""
        assert end <= self.num_rows, (start, end, self.num_rows)
        return self._rows[start:end]

    def codes(self, start: int, end: int) -> np.ndarray:
        """[end - start, K] view of the codes of positions start .. end - 1 (all known)."""
        return self.rows(start, end)[:, : self.num_codes]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Hidden states of every computed position, at these layer indices (HF convention:
    # 0 = embeddings, i = input of layer i, num_layers = final output after the norm).
    hidden_state_layers: tuple[int, ...] = ()
    audio: bool = False  # sampled tokens go through the codec stage
    # Multi-codebook families: the codes of every position (the token ids then only say which
    # positions are frames); None for one-token-per-step families.
    frames: FrameLog | None = None
    # Families that sample groups 1..K-1 with their own parameters (Qwen3-TTS's subtalker_*):
    # this request's, or None for the family's defaults.
    group_sampling: SamplingParams | None = None
    # Vectors added over prompt positions' embeddings (Qwen3-TTS Base's x-vector); their key
    # seeds the prefix-cache chain (runner/engine/kv_cache.py)
    vectors: PromptVectors | None = None
    # The request's StepText while its text is still arriving (Engine.append_text), else None:
    # the scheduler holds the row when its next input's text id has not come
    open_text: StepText | None = None
    arrival: int = field(default_factory=lambda: next(_seq_counter))
    arrival_time: float = field(default_factory=time.monotonic)  # seconds, for the admission hold

    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_inflight: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    num_hidden_emitted: int = 0  # positions whose hidden rows were already returned
    num_output_tokens_sent: int = 0  # audio requests: outputs already sent with earlier chunks
    slot: int = -1  # persistent batch row holding device-side sampling state; -1 = none
    block_ids: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks whose chain hashes are published (BlockManager)
    finish_reason: FinishReason | None = None
    finish_message: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def num_outputs_with_inflight(self) -> int:
        return len(self.output_token_ids) + self.num_inflight

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_hidden_states(self) -> bool:
        return bool(self.hidden_state_layers)

    @property
    def is_prefill(self) -> bool:
        """True while part of the known prompt (+ recomputed outputs) is not yet computed."""
        return self.num_computed_tokens < len(self.prompt_token_ids) + len(self.output_token_ids)

    def finish(self, reason: FinishReason, message: str = "") -> None:
        assert self.status is not Status.FINISHED, f"request {self.request_id} finished twice"
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.finish_message = message
