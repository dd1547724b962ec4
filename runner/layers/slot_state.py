"""Device-resident per-slot sampling state (`SlotState`): last token, history and the penalty
rows of every running request.

Why on the device: with async scheduling, step N+1 is scheduled (and its sampling runs) before
step N's sampled ids reach the host, so host-side output lists still hold placeholders.
Penalties and model-specific samplers therefore read `SlotState`, which the runner updates on
the device with the ids the sampler just produced (`SlotState.record`). A slot is a persistent
row 0..S-1 owned by one running request; padding rows use slot -1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runner.layers import make_sampling
from runner.layers.sampling_batch import to_device


class SlotState:
    """Device-resident per-slot sampling state. S slots, vocab V.

    Buffers have S + 1 rows: row S is a scratch row that padding rows (slot < 0) read from and
    write to, so padding is handled by index remapping on the device, never in Python. The
    public attributes are views of the first S rows.

    Invariants:
      - `history[s, i]` is the i-th generated token of the request in slot s, -1 if unknown;
      - `output_counts[s]` == bincount(generated tokens of slot s), when the request was
        admitted with track_penalties (rows of other requests are not meaningful);
      - out_index < max_model_len for every recorded real row (outputs never exceed it).
    """

    def __init__(self, num_slots: int, vocab_size: int, max_model_len: int, device: torch.device | str,
                 backend: str = "torch", tuning: str = "auto"):
        """backend: 'torch', or 'triton' to record with one kernel launch (see Sampler.backend);
        tuning: RunnerConfig.tuning (the backend is built as the sampler's is)."""
        self.device = torch.device(device)
        self._sampling = make_sampling(backend, self.device, tuning)
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        rows = num_slots + 1  # + scratch row for padding
        self._last_token = torch.zeros(rows, dtype=torch.int64, device=self.device)  # [S+1]
        self._history = torch.full((rows, max_model_len), -1, dtype=torch.int64, device=self.device)  # [S+1, L]
        self._prompt_mask: Tensor | None = None  # [S+1, V] bool
        self._output_counts: Tensor | None = None  # [S+1, V] int32
        self.last_token: Tensor = self._last_token[:num_slots]  # [S] view
        self.history: Tensor = self._history[:num_slots]  # [S, L] view
        self.prompt_mask: Tensor | None = None  # [S, V] view once allocated
        self.output_counts: Tensor | None = None  # [S, V] view once allocated

    def allocate_penalty_buffers(self) -> None:
        """Allocate the [S+1, V] prompt-mask and count rows (idempotent). Admission does it for the
        first request that tracks penalties; the CUDA warm-up does it at start-up, so the memory is
        taken before serving and the penalty kernels compile then."""
        if self._output_counts is not None:
            return
        rows = self.num_slots + 1
        self._prompt_mask = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device)
        self._output_counts = torch.zeros(rows, self.vocab_size, dtype=torch.int32, device=self.device)
        self.prompt_mask = self._prompt_mask[: self.num_slots]
        self.output_counts = self._output_counts[: self.num_slots]

    def row_index(self, slots: Tensor) -> Tensor:
        """Map slot ids [B] to buffer rows [B]: padding (slot < 0) -> scratch row S."""
        return torch.where(slots < 0, self.num_slots, slots)

    def admit(self, slot: int, prompt_ids: list[int], output_ids: list[int], track_penalties: bool) -> None:
        """Reset row `slot` for a request (re)starting prefill (see admit_many)."""
        self.admit_many([(slot, prompt_ids, output_ids, track_penalties)])

    def admit_many(self, items: list[tuple[int, list[int], list[int], bool]]) -> None:
        """Reset the rows of requests (re)starting prefill: (slot, prompt ids, output ids,
        track penalties) each, slots distinct. One host->device copy and a fixed number of
        launches however many requests a step admits (a burst of arrivals would otherwise
        cost a few launches per request).

        Output ids are confirmed outputs (non-empty when recomputing after a preemption);
        they refill history and counts so penalties continue where they left off. Prompt
        ids outside [0, V) (e.g. multimodal placeholders beyond the lm_head) are ignored
        by the penalty mask, as HF does.
        """
        if not items:
            return
        slots, lasts, p_rows, p_ids, o_rows, o_pos, o_ids, o_track = [], [], [], [], [], [], [], []
        track_any = False
        for slot, prompt_ids, output_ids, track in items:
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} outside [0, {self.num_slots})")
            n_out = len(output_ids)
            if n_out > self.max_model_len:
                raise ValueError(f"{n_out} output ids exceed max_model_len={self.max_model_len}")
            slots.append(slot)
            lasts.append(output_ids[-1] if output_ids else (prompt_ids[-1] if prompt_ids else 0))
            if track:
                track_any = True
                p_rows += [slot] * len(prompt_ids)
                p_ids += prompt_ids
            o_rows += [slot] * n_out
            o_pos += range(n_out)
            o_ids += output_ids
            o_track += [int(track)] * n_out
        if track_any:
            self.allocate_penalty_buffers()
        n, np_, no = len(slots), len(p_ids), len(o_ids)
        pack = to_device([*slots, *lasts, *p_rows, *p_ids, *o_rows, *o_pos, *o_ids, *o_track], torch.int64, self.device)
        slots_t, lasts_t = pack[:n], pack[n : 2 * n]
        p_rows_t, p_ids_t = pack[2 * n : 2 * n + np_], pack[2 * n + np_ : 2 * n + 2 * np_]
        o = 2 * n + 2 * np_
        o_rows_t, o_pos_t, o_ids_t, o_track_t = (pack[o + i * no : o + (i + 1) * no] for i in range(4))

        self._last_token.index_put_((slots_t,), lasts_t)  # no sync
        self._history.index_fill_(0, slots_t, -1)
        if no:
            self._history.index_put_((o_rows_t, o_pos_t), o_ids_t)
        if self._output_counts is None:
            return
        assert self._prompt_mask is not None
        self._prompt_mask.index_fill_(0, slots_t, False)
        self._output_counts.index_fill_(0, slots_t, 0)
        v, scratch = self.vocab_size, self.num_slots
        if np_:
            # out-of-vocab prompt ids (and untracked rows) land in the scratch row, never read
            ok = (p_ids_t >= 0) & (p_ids_t < v)
            self._prompt_mask.index_put_((torch.where(ok, p_rows_t, scratch), torch.where(ok, p_ids_t, 0)),
                                         torch.ones_like(ok))
        if no:
            rows = torch.where(o_track_t > 0, o_rows_t, scratch)
            self._output_counts.index_put_((rows, o_ids_t), torch.ones_like(o_ids_t, dtype=torch.int32), accumulate=True)

    def record(self, slots: Tensor, tokens: Tensor, out_index: Tensor) -> None:
        """Record sampled tokens on the device; no host sync.

        slots [B] int64 (-1 = padding), tokens [B] int64, out_index [B] int64 (index of the
        token among its request's outputs). Padding rows are redirected to the scratch row
        with token 0 / index 0 so they can never touch a real slot or index out of range.
        Real slots must be distinct within one call (one token per request per step).
        """
        self._sampling.record_tokens(self._last_token, self._history, self._output_counts, slots, tokens, out_index)

    def penalty_buffers(self) -> tuple[Tensor, Tensor]:
        """(prompt_mask [S+1, V] bool, output_counts [S+1, V] int32), scratch row S included: for
        kernels that read the rows `row_index(slots)` in place instead of gathering them."""
        if self._output_counts is None or self._prompt_mask is None:
            raise RuntimeError("penalty buffers not allocated: admit the request with track_penalties=True")
        return self._prompt_mask, self._output_counts

    def gather_penalty_rows(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """(prompt_mask [B, V] bool, output_counts [B, V] int32) for batch rows `slots` [B]."""
        if self._output_counts is None or self._prompt_mask is None:
            raise RuntimeError("penalty buffers not allocated: admit the request with track_penalties=True")
        rows = self.row_index(slots)
        return self._prompt_mask[rows], self._output_counts[rows]
