"""Token sampler and the device-resident per-slot state it reads.

Why per-slot device state: with async scheduling, step N+1 is scheduled (and its sampling
runs) before step N's sampled ids reach the host, so host-side output lists still hold
placeholders. Penalties and model-specific samplers therefore read `SlotState`, which the
runner updates on the device with the ids the sampler just produced (`SlotState.record`).
A slot is a persistent row 0..S-1 owned by one running request; padding rows use slot -1.

Order of operations in `Sampler.__call__` (each stage is skipped when its `any_*` flag is
False, so a plain greedy batch is one argmax):

  1. penalties, read from the state rows `batch.slots`:
       repetition (HF: over prompt + output tokens, logit<0 ? logit*p : logit/p),
       then frequency (logit -= f * count) and presence (logit -= p * (count > 0)),
       both OpenAI-style over output tokens only;
  2. sparse additive logit bias (request `logit_bias` plus the runner's extra entries, e.g.
     -inf on EOS/stop ids while min_tokens is not reached);
  3. greedy rows (temperature == 0): argmax of the logits after 1-2;
  4. sampling rows: divide by temperature, top-k (ties with the k-th value survive, as in
     HF), top-p (smallest set whose mass reaches p; always keeps the top token), min-p
     (drop probs < min_p * max prob), filtered logits set to -inf, softmax;
  5. draw with the exponential race: token = argmax(probs / q), q ~ Exponential(1) iid.
     This is an exact sample from `probs` (Gumbel-max in disguise) and needs no cumsum or
     host sync. q for a seeded row comes from that row's own generator, always [V] values
     per step, so a seeded request yields the same tokens alone or anywhere in any batch;
     q for the other rows comes from the shared generator in one call.
  Mixed batches: the final ids are torch.where(temperature == 0, greedy ids, sampled ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runner.sampling_params import SamplingParams

_NEG_INF = float("-inf")


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A per-request generator on `device`, seeded with `seed`."""
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed)
    return g


def _to_device(data: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """One host tensor -> `device`; pinned + non_blocking on CUDA so the host never waits.

    The pinned block stays valid until the copy ends: PyTorch's caching host allocator
    records the copy's stream and does not reuse the block before it completes.
    """
    if device.type == "cuda":
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype, device=device)


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

    def __init__(self, num_slots: int, vocab_size: int, max_model_len: int, device: torch.device | str):
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        rows = num_slots + 1  # + scratch row for padding
        self._last_token = torch.zeros(rows, dtype=torch.int64, device=self.device)  # [S+1]
        self._history = torch.full((rows, max_model_len), -1, dtype=torch.int64, device=self.device)  # [S+1, L]
        self._prompt_mask: Tensor | None = None  # [S+1, V] bool
        self._output_counts: Tensor | None = None  # [S+1, V] int32
        self.last_token: Tensor = self._last_token[:num_slots]  # [S] view
        self.history: Tensor = self._history[:num_slots]  # [S, L] view
        self.prompt_mask: Tensor | None = None  # [S, V] view once allocated
        self.output_counts: Tensor | None = None  # [S, V] view once allocated

    @property
    def penalties_allocated(self) -> bool:
        return self._output_counts is not None

    def _allocate_penalty_buffers(self) -> None:
        rows = self.num_slots + 1
        self._prompt_mask = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device)
        self._output_counts = torch.zeros(rows, self.vocab_size, dtype=torch.int32, device=self.device)
        self.prompt_mask = self._prompt_mask[: self.num_slots]
        self.output_counts = self._output_counts[: self.num_slots]

    def row_index(self, slots: Tensor) -> Tensor:
        """Map slot ids [B] to buffer rows [B]: padding (slot < 0) -> scratch row S."""
        return torch.where(slots < 0, self.num_slots, slots)

    def admit(self, slot: int, prompt_ids: list[int], output_ids: list[int], track_penalties: bool) -> None:
        """Reset row `slot` for a request (re)starting prefill.

        `output_ids` are confirmed outputs (non-empty when recomputing after a preemption);
        they refill history and counts so penalties continue where they left off. Prompt
        ids outside [0, V) (e.g. multimodal placeholders beyond the lm_head) are ignored
        by the penalty mask, as HF does.
        """
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside [0, {self.num_slots})")
        n_out = len(output_ids)
        if n_out > self.max_model_len:
            raise ValueError(f"{n_out} output ids exceed max_model_len={self.max_model_len}")
        n_prompt = len(prompt_ids)
        ids = _to_device(list(prompt_ids) + list(output_ids), torch.int64, self.device)  # [P + O], one copy
        prompt_t, out_t = ids[:n_prompt], ids[n_prompt:]

        last = output_ids[-1] if output_ids else (prompt_ids[-1] if prompt_ids else 0)
        self._last_token[slot] = last  # scalar fill kernel, no sync
        hist = self._history[slot]
        hist.fill_(-1)
        hist[:n_out] = out_t

        if track_penalties and self._output_counts is None:
            self._allocate_penalty_buffers()
        if self._output_counts is None:
            return
        assert self._prompt_mask is not None
        mask_row, count_row = self._prompt_mask[slot], self._output_counts[slot]
        mask_row.zero_()
        count_row.zero_()
        if not track_penalties:
            return
        v = self.vocab_size
        # Out-of-vocab prompt ids go to index V of a [V+1] scratch, then get dropped.
        mask_ext = torch.zeros(v + 1, dtype=torch.bool, device=self.device)
        in_vocab = (prompt_t >= 0) & (prompt_t < v)
        mask_ext[torch.where(in_vocab, prompt_t, v)] = True
        mask_row.copy_(mask_ext[:v])
        if n_out:
            ones = torch.ones(n_out, dtype=torch.int32, device=self.device)
            count_row.index_put_((out_t,), ones, accumulate=True)

    def record(self, slots: Tensor, tokens: Tensor, out_index: Tensor) -> None:
        """Record sampled tokens on the device; no host sync.

        slots [B] int64 (-1 = padding), tokens [B] int64, out_index [B] int64 (index of the
        token among its request's outputs). Padding rows are redirected to the scratch row
        with token 0 / index 0 so they can never touch a real slot or index out of range.
        Real slots must be distinct within one call (one token per request per step).
        """
        valid = slots >= 0
        rows = torch.where(valid, slots, self.num_slots)
        toks = torch.where(valid, tokens, 0)
        idx = torch.where(valid, out_index, 0)
        # Duplicate indices only occur on the scratch row, where any winner is fine.
        self._last_token.index_put_((rows,), toks)
        self._history.index_put_((rows, idx), toks)
        if self._output_counts is not None:
            ones = torch.ones_like(toks, dtype=torch.int32)
            self._output_counts.index_put_((rows, toks), ones, accumulate=True)

    def gather_penalty_rows(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """(prompt_mask [B, V] bool, output_counts [B, V] int32) for batch rows `slots` [B]."""
        if self._output_counts is None or self._prompt_mask is None:
            raise RuntimeError("penalty buffers not allocated: admit the request with track_penalties=True")
        rows = self.row_index(slots)
        return self._prompt_mask[rows], self._output_counts[rows]


@dataclass
class SamplingBatch:
    """Per-step sampling inputs for B rows, built on the host by the runner, tensors on the logits' device.

    The float fields are views of one [6, B] tensor and the int fields of one [2, B] tensor,
    so a step costs at most three host->device copies (plus one for bias values).
    """

    temperature: Tensor  # [B] f32; 0 => greedy row
    top_k: Tensor  # [B] int64; 0 => off (>= V also off)
    top_p: Tensor  # [B] f32; 1 => off
    min_p: Tensor  # [B] f32; 0 => off
    repetition_penalty: Tensor  # [B] f32, HF semantics over prompt + output tokens
    frequency_penalty: Tensor  # [B] f32, OpenAI: logit -= f * count over outputs
    presence_penalty: Tensor  # [B] f32, OpenAI: logit -= p * (count > 0)
    slots: Tensor  # [B] int64 slot row of each sample row (-1 = padding)
    bias_rows: Tensor | None  # [N] int64 batch row of each bias entry
    bias_cols: Tensor | None  # [N] int64 token id
    bias_vals: Tensor | None  # [N] f32 additive value (may be -inf); duplicates add up
    generators: list[torch.Generator | None]  # per row; None => the shared sampler generator
    all_greedy: bool
    any_penalty: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_seeded: bool

    @property
    def num_rows(self) -> int:
        return len(self.generators)

    @staticmethod
    def build(
        params: list[SamplingParams],
        slots: list[int],
        generators: list[torch.Generator | None],
        extra_bias: list[tuple[int, int, float]],
        device: torch.device | str,
    ) -> "SamplingBatch":
        """Host-side construction. `extra_bias` holds (batch row, token id, value) entries."""
        device = torch.device(device)
        b = len(params)
        if len(slots) != b or len(generators) != b:
            raise ValueError(f"params ({b}), slots ({len(slots)}) and generators ({len(generators)}) differ in length")
        floats = _to_device(
            [
                [p.temperature for p in params],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [p.repetition_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
            ],
            torch.float32,
            device,
        ).reshape(6, b)  # reshape: an empty batch gives shape [6, 0] either way
        ints = _to_device([[p.top_k for p in params], list(slots)], torch.int64, device).reshape(2, b)

        b_rows: list[int] = []
        b_cols: list[int] = []
        b_vals: list[float] = []
        for i, p in enumerate(params):
            for tok, val in p.logit_bias.items():
                b_rows.append(i)
                b_cols.append(int(tok))
                b_vals.append(val)
        for row, tok, val in extra_bias:
            b_rows.append(row)
            b_cols.append(tok)
            b_vals.append(val)
        bias_rows = bias_cols = bias_vals = None
        if b_vals:
            idx = _to_device([b_rows, b_cols], torch.int64, device)
            bias_rows, bias_cols = idx[0], idx[1]
            bias_vals = _to_device(b_vals, torch.float32, device)

        return SamplingBatch(
            temperature=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            repetition_penalty=floats[3],
            frequency_penalty=floats[4],
            presence_penalty=floats[5],
            top_k=ints[0],
            slots=ints[1],
            bias_rows=bias_rows,
            bias_cols=bias_cols,
            bias_vals=bias_vals,
            generators=list(generators),
            all_greedy=all(p.greedy for p in params),
            any_penalty=any(p.uses_penalties for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
            any_seeded=any(g is not None for g in generators),
        )


class Sampler:
    """Stateless apart from the shared generator; see the module docstring for the pipeline."""

    def __init__(self, device: torch.device | str, seed: int | None = None):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()  # non-deterministic
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: Tensor, batch: SamplingBatch, state: SlotState) -> Tensor:
        """logits [B, V] float32 (modified in place) -> sampled ids [B] int64 on the logits' device."""
        self._check(logits, batch)
        self._penalize_and_bias(logits, batch, state)
        greedy_ids = logits.argmax(dim=-1)  # [B]
        if batch.all_greedy:
            return greedy_ids
        _, probs = self._warp(logits, batch)
        sampled = self._race(probs, batch)
        return torch.where(batch.temperature == 0, greedy_ids, sampled)

    def process(self, logits: Tensor, batch: SamplingBatch, state: SlotState) -> Tensor:
        """Stages 1, 2 and 4 only: the logits the sampling rows draw from ([B, V], -inf = filtered).

        Greedy rows come back penalized and biased but otherwise unscaled. Used by tests
        and by model-specific samplers that want the standard filters.
        """
        self._check(logits, batch)
        self._penalize_and_bias(logits, batch, state)
        if batch.all_greedy:
            return logits
        out, _ = self._warp(logits, batch)
        return out

    @staticmethod
    def _check(logits: Tensor, batch: SamplingBatch) -> None:
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise TypeError(f"logits must be [B, V] float32, got {tuple(logits.shape)} {logits.dtype}")
        if logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows, batch has {batch.num_rows}")

    @staticmethod
    def _penalize_and_bias(logits: Tensor, batch: SamplingBatch, state: SlotState) -> None:
        """Stages 1-2, in place on logits [B, V]."""
        if batch.any_penalty:
            prompt_mask, counts = state.gather_penalty_rows(batch.slots)  # [B, V] bool, [B, V] int32
            seen = prompt_mask | (counts > 0)
            rep = batch.repetition_penalty.unsqueeze(1)  # [B, 1]; 1.0 is exact identity
            penalized = torch.where(logits < 0, logits * rep, logits / rep)
            logits.copy_(torch.where(seen, penalized, logits))
            counts_f = counts.to(logits.dtype)
            logits -= batch.frequency_penalty.unsqueeze(1) * counts_f
            logits -= batch.presence_penalty.unsqueeze(1) * (counts_f > 0).to(logits.dtype)
        if batch.bias_vals is not None:
            assert batch.bias_rows is not None and batch.bias_cols is not None
            logits.index_put_((batch.bias_rows, batch.bias_cols), batch.bias_vals, accumulate=True)

    @staticmethod
    def _warp(logits: Tensor, batch: SamplingBatch) -> tuple[Tensor, Tensor]:
        """Stage 4, in place: returns (filtered logits [B, V], probs [B, V]).

        probs is proportional (not necessarily normalized, rows with min-p filtering) to
        softmax(filtered logits); the exponential race is invariant to that row scale.
        """
        v = logits.shape[1]
        temp = torch.where(batch.temperature == 0, 1.0, batch.temperature)  # greedy rows: keep scale
        logits.div_(temp.unsqueeze(1))

        if batch.any_top_k or batch.any_top_p:
            # Ascending sort, as HF does for top-p, so survivors match its numerics.
            sorted_vals, sorted_idx = logits.sort(dim=-1)  # [B, V]
            if batch.any_top_k:
                k = batch.top_k
                k = torch.where((k <= 0) | (k > v), v, k)  # off => keep all V
                kth = sorted_vals.gather(1, (v - k).unsqueeze(1))  # [B, 1] k-th largest value
                logits.masked_fill_(logits < kth, _NEG_INF)
                sorted_vals.masked_fill_(sorted_vals < kth, _NEG_INF)
            if batch.any_top_p:
                cum = sorted_vals.softmax(dim=-1).cumsum(dim=-1)  # [B, V] ascending mass
                top_p = batch.top_p.unsqueeze(1)
                drop_sorted = (cum <= 1 - top_p) & (top_p < 1)
                drop_sorted[:, -1] = False  # always keep the most likely token
                drop = torch.empty_like(drop_sorted).scatter_(1, sorted_idx, drop_sorted)
                logits.masked_fill_(drop, _NEG_INF)

        probs = logits.softmax(dim=-1)  # [B, V]
        if batch.any_min_p:
            thresh = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
            drop = probs < thresh  # the top token never satisfies this (min_p <= 1)
            logits.masked_fill_(drop, _NEG_INF)
            probs.masked_fill_(drop, 0.0)
        return logits, probs

    def _race(self, probs: Tensor, batch: SamplingBatch) -> Tensor:
        """Stage 5: argmax(probs / q) per row, q ~ Exp(1). probs [B, V] -> ids [B]."""
        q = torch.empty_like(probs)
        n_seeded = sum(g is not None for g in batch.generators) if batch.any_seeded else 0
        if n_seeded < probs.shape[0]:
            q.exponential_(generator=self.generator)
        if n_seeded:
            # Unavoidable per-row loop: each seeded row draws exactly V values from its own generator.
            for i, g in enumerate(batch.generators):
                if g is not None:
                    q[i].exponential_(generator=g)
        # Guard q == 0 (0/0 = NaN would win argmax); any q > 0 keeps the race exact.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return probs.div_(q).argmax(dim=-1)
