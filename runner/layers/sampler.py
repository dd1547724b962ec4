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
     (drop probs < min_p * max prob), filtered logits set to -inf;
  5. draw with the exponential race: token = argmax(probs / q), q ~ Exponential(1) iid.
     This is an exact sample from `probs` (Gumbel-max in disguise) and needs no cumsum or
     host sync. q is counter-based (`race_noise`): q[b, v] = -log(u), u a hash of (the row's
     noise seed, the index of the token being sampled among the request's outputs, v). A
     seeded request uses its seed, every other request a random seed drawn once at
     admission, so a seeded request yields the same tokens alone, anywhere in any batch and
     after a preemption, and no per-row generator call is needed (one launch fills the
     batch's noise). The race runs on e = exp(y - max y) (y = scaled logits) instead of the
     normalised probs: it is invariant to a per-row scale, so there is no softmax pass.
     (Batch independence is bit-exact on the CPU and with the triton backend, see
     runner/kernels/sampling.py for its one caveat; the torch backend on CUDA histograms with
     atomics, so there a seeded row can differ only if a cumulative mass lands within fp32
     rounding of its bound.)
  Mixed batches: greedy rows take the greedy ids.

How top-k / top-p avoid sorting [B, V] (the old path sorted every row of 156940 logits, the
bulk of the sampler's time at large batch). Both filters keep an upper set of the row:
with key(y) an order-preserving int32 image of the float y, a row keeps {key(y) >= t} for a
threshold t, the smallest key such that the statistic of the strictly larger tokens is below
a bound:
    top-k: count(key > t) < k          (so every token tied with the k-th value survives);
    top-p: mass(key > t)  < p * Z      (Z = mass of the tokens top-k left, mass = exp(y - max)).
The statistic is monotone in t, so t is found by search instead of by sorting:
  * torch backend (CPU, and CUDA without Triton): MSB-first radix select on the key. A level
    histograms the tokens still in play (count or mass per digit: one index_add_ over
    [B, V]) and picks the digit where the suffix sum crosses the bound; two levels of 16
    bits (four of 8 bits for a vocabulary under 65536) give the exact threshold, in ~15
    elementwise passes and no sort.
  * triton backend (CUDA): runner/kernels/sampling.py, one program per row: a few pivot passes
    narrow the threshold to a bucket of <= 8192 tokens, which is compacted and finished in
    registers; the same kernel applies min-p and runs the race (or writes the filtered
    logits), and a second one applies the penalties in one pass over the state rows.
Tie handling: tokens tied with the threshold value are all kept. transformers' top-p sorts
and cuts inside a run of equal values at whatever position the sort left them (the order of
equal keys is unspecified), i.e. it may keep only some of the tied tokens; here the kept set
is that one plus the rest of the tie, which is order-independent. Apart from ties, the kept
set differs from the sort-based one only where the cumulative mass equals the bound to within
fp32 rounding (both compute the mass in a different summation order). Min-p compares
exp(y - max y) >= min_p, i.e. p / p_max >= min_p without the normalisation rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from runner.engine.host_staging import staging_for
from runner.layers.hashing import M32, hash32, uniform24
from streaming.sampling_params import SamplingParams

_NEG_INF = float("-inf")

# Salts of the race-noise key (runner/kernels/sampling.py loads the same values).
NOISE_SALTS = (0x5851F42D, 0x68E31DA4, 0x1B873593)


def race_noise(seeds: Tensor, counters: Tensor, vocab: int, out: Tensor | None = None) -> Tensor:
    """q [B, V] float32 ~ Exponential(1), a pure function of (seed, counter, token id).

    seeds [B] int64 in [0, 2^63): the row's noise seed; counters [B] int64 >= 0: the index,
    among its request's outputs, of the token being sampled. Each (seed, counter) key gets a
    fresh iid row: u = uniform24(hash of key and v) in (0, 1), q = -log(u) in (0, 17.4].
    """
    s0, s1, s2 = NOISE_SALTS
    lo, hi = seeds & M32, (seeds >> 32) & M32
    key = hash32(hash32(lo ^ s0) ^ hi)
    key = hash32(key ^ hash32((counters & M32) ^ s1))  # [B]
    key2 = hash32(key ^ s2)
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    u = uniform24(hash32(hash32(v[None, :] ^ key[:, None]) ^ key2[:, None]))
    if out is None:
        return u.log_().neg_()
    return torch.log(u, out=out).neg_()


def _to_device(data: "list | np.ndarray", dtype: torch.dtype, device: torch.device) -> Tensor:
    """One host array -> `device`; on CUDA a non-blocking copy through the pinned staging ring
    (runner/engine/host_staging.py), so the host never waits."""
    if device.type == "cuda":
        return staging_for(device).to_device(np.asarray(data), dtype)
    if isinstance(data, np.ndarray):
        return torch.from_numpy(data).to(dtype)
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

    def __init__(self, num_slots: int, vocab_size: int, max_model_len: int, device: torch.device | str,
                 backend: str = "torch"):
        """backend: 'torch', or 'triton' to record with one kernel launch (see Sampler.backend)."""
        if backend not in ("torch", "triton"):
            raise ValueError(f"SlotState backend must be 'torch' or 'triton', got {backend!r}")
        self._kernels = None
        if backend == "triton":
            from runner.kernels import sampling as sampling_kernels

            self._kernels = sampling_kernels
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
        launches however many requests a step admits (a burst of 400 arrivals used to cost
        ~10 launches each).

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
        pack = _to_device([*slots, *lasts, *p_rows, *p_ids, *o_rows, *o_pos, *o_ids, *o_track], torch.int64, self.device)
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
        if self._kernels is not None:
            self._kernels.record_tokens(self._last_token, self._history, self._output_counts, slots, tokens, out_index)
            return
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


@dataclass
class SamplingBatch:
    """Per-step sampling inputs for B rows, built on the host by the runner, tensors on the logits' device.

    The float fields are views of one [6, B'] tensor and the int fields of one [4, B'] tensor
    (B' = B rounded up to 4, so every row starts 16-byte aligned),
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
    seeds: Tensor  # [B] int64 race-noise seed of each row (see race_noise)
    counters: Tensor  # [B] int64 index among its request's outputs of the token sampled now
    bias_rows: Tensor | None  # [N] int64 batch row of each bias entry
    bias_cols: Tensor | None  # [N] int64 token id
    bias_vals: Tensor | None  # [N] f32 additive value (may be -inf); duplicates add up
    all_greedy: bool
    any_penalty: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # Finer flags (defaults keep the work on when a caller builds the batch by hand).
    any_greedy: bool = True  # some row has temperature == 0
    any_repetition: bool = True  # some row has repetition_penalty != 1
    any_frequency: bool = True  # some row has frequency_penalty != 0
    any_presence: bool = True  # some row has presence_penalty != 0

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @staticmethod
    def build(
        params: list[SamplingParams],
        slots: list[int],
        seeds: list[int],
        counters: list[int],
        extra_bias: list[tuple[int, int, float]],
        device: torch.device | str,
    ) -> "SamplingBatch":
        """Host-side construction. `extra_bias` holds (batch row, token id, value) entries."""
        b = len(params)
        if not len(slots) == len(seeds) == len(counters) == b:
            raise ValueError(f"params ({b}), slots ({len(slots)}), seeds ({len(seeds)}) and counters ({len(counters)}) differ in length")
        floats = np.zeros((b, NUM_FLOAT_PARAMS), dtype=np.float32)
        if b:
            floats[:] = [float_params(p) for p in params]
        bias = [(i, int(tok), val) for i, p in enumerate(params) if p.logit_bias for tok, val in p.logit_bias.items()]
        return SamplingBatch.from_host(floats, np.array([p.top_k for p in params], dtype=np.int64),
                                       np.asarray(slots, dtype=np.int64), np.asarray(seeds, dtype=np.int64),
                                       np.asarray(counters, dtype=np.int64), bias + list(extra_bias), device)

    @staticmethod
    def from_host(
        floats: np.ndarray,
        top_k: np.ndarray,
        slots: np.ndarray,
        seeds: np.ndarray,
        counters: np.ndarray,
        bias: list[tuple[int, int, float]],
        device: torch.device | str,
    ) -> "SamplingBatch":
        """From host arrays: floats [B, 6] f32 (`float_params` rows), top_k / slots / seeds /
        counters [B] int64, bias (batch row, token id, value) entries. The runner keeps these
        per slot and gathers a step's rows with one numpy index each (no per-row Python)."""
        device = torch.device(device)
        b = floats.shape[0]
        # Rows padded to 4 columns (16 bytes): every row view starts 16-byte aligned whatever B
        # is. Triton specialises pointer arguments on that alignment, so unpadded rows made
        # the sampling kernels compile a new variant (~1 s) whenever B % 4 changed.
        bp = max(4, b + (-b % 4))  # >= 4: torch cannot reinterpret an empty byte tensor
        # One copy for both: the int64 rows, then the float32 rows, in one byte array (on CUDA
        # every host -> device copy is a copy-engine operation with microseconds of latency on
        # the step's critical path). The ints' 32 * bp bytes keep the floats 16-byte aligned.
        n_int = 4 * 8 * bp
        host = np.zeros(n_int + NUM_FLOAT_PARAMS * 4 * bp, dtype=np.uint8)
        host_i = host[:n_int].view(np.int64).reshape(4, bp)
        host_f = host[n_int:].view(np.float32).reshape(NUM_FLOAT_PARAMS, bp)
        host_f[:, :b] = floats.T
        host_i[0, :b], host_i[1, :b], host_i[2, :b], host_i[3, :b] = top_k, slots, seeds, counters
        dev = _to_device(host, torch.uint8, device)
        dev_i = dev[:n_int].view(torch.int64).view(4, bp)[:, :b]
        dev_f = dev[n_int:].view(torch.float32).view(NUM_FLOAT_PARAMS, bp)[:, :b]
        temp, top_p, min_p, rep, freq, pres = host_f[:, :b]

        bias_rows = bias_cols = bias_vals = None
        if bias:
            rows, cols, vals = zip(*bias)
            idx = _to_device(np.array([rows, cols], dtype=np.int64), torch.int64, device)
            bias_rows, bias_cols = idx[0], idx[1]
            bias_vals = _to_device(np.array(vals, dtype=np.float32), torch.float32, device)

        return SamplingBatch(
            temperature=dev_f[0],
            top_p=dev_f[1],
            min_p=dev_f[2],
            repetition_penalty=dev_f[3],
            frequency_penalty=dev_f[4],
            presence_penalty=dev_f[5],
            top_k=dev_i[0],
            slots=dev_i[1],
            seeds=dev_i[2],
            counters=dev_i[3],
            bias_rows=bias_rows,
            bias_cols=bias_cols,
            bias_vals=bias_vals,
            all_greedy=bool((temp == 0.0).all()),
            any_penalty=bool((rep != 1.0).any() or (freq != 0.0).any() or (pres != 0.0).any()),
            any_top_k=bool((top_k > 0).any()),
            any_top_p=bool((top_p < 1.0).any()),
            any_min_p=bool((min_p > 0.0).any()),
            any_greedy=bool((temp == 0.0).any()),
            any_repetition=bool((rep != 1.0).any()),
            any_frequency=bool((freq != 0.0).any()),
            any_presence=bool((pres != 0.0).any()),
        )


NUM_FLOAT_PARAMS = 6


def float_params(p: SamplingParams) -> tuple[float, float, float, float, float, float]:
    """A request's row of SamplingBatch.from_host's floats: temperature, top_p, min_p,
    repetition, frequency and presence penalty."""
    return (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty)


class SamplingTable:
    """Host-side sampling inputs per slot, written when a request takes its slot, so a step
    gathers its rows with one numpy index per field instead of a Python pass over every
    request (~1 ms per step at 400 rows on the H200 host): float_params rows, top_k,
    min_tokens, whether logit_bias is set, and the race-noise seed."""

    def __init__(self, num_slots: int, eos_token_ids: tuple[int, ...] | list[int]):
        self.floats = np.zeros((num_slots, NUM_FLOAT_PARAMS), dtype=np.float32)
        self.top_k = np.zeros(num_slots, dtype=np.int64)
        self.min_tokens = np.zeros(num_slots, dtype=np.int64)
        self.has_bias = np.zeros(num_slots, dtype=bool)
        self.seeds = np.zeros(num_slots, dtype=np.int64)
        self.eos = tuple(eos_token_ids)

    def set(self, slot: int, p: SamplingParams, noise_seed: int) -> None:
        self.floats[slot] = float_params(p)
        self.top_k[slot] = p.top_k
        self.min_tokens[slot] = p.min_tokens
        self.has_bias[slot] = bool(p.logit_bias)
        self.seeds[slot] = noise_seed

    def batch(self, slots: list[int], counters: list[int], params: list[SamplingParams],
              device: torch.device | str) -> "SamplingBatch":
        """The batch of rows `slots` (set() before), sampling output index `counters`;
        params[i] is row i's SamplingParams, read only for the rare rows with per-row work."""
        sl = np.asarray(slots, dtype=np.int64)
        ctr = np.asarray(counters, dtype=np.int64)
        bias: list[tuple[int, int, float]] = []
        # logit_bias, and min_tokens not reached yet (stop ids may not be sampled yet)
        for row in np.flatnonzero(self.has_bias[sl] | (ctr < self.min_tokens[sl])).tolist():
            p = params[row]
            if p.logit_bias:
                bias.extend((row, int(tok), val) for tok, val in p.logit_bias.items())
            if counters[row] < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos))
                bias.extend((row, tok, float("-inf")) for tok in banned)
        return SamplingBatch.from_host(self.floats[sl], self.top_k[sl], sl, self.seeds[sl], ctr, bias, device)


# Radix select (torch backend): 16-bit digits (two levels cover the 32-bit key) once the
# vocabulary is at least as large as the [B, 65536] histogram, 8-bit digits below that.
_DIGIT_BITS = 16
_NUM_DIGITS = 1 << _DIGIT_BITS
_BACKENDS = ("auto", "torch", "triton")


def order_key(y: Tensor, out: Tensor | None = None, tmp: Tensor | None = None) -> Tensor:
    """Order-preserving int32 image of float32 `y` (any shape): y1 < y2 <=> key1 < key2.

    Sign-magnitude bits -> two's complement: key = bits for y >= 0, -(bits & 0x7FFFFFFF) for
    y < 0, so -0.0 and +0.0 both map to 0 (they are equal floats, hence ties), -inf to
    -0x7F800000 and +inf to 0x7F800000. NaN keys lie beyond +-inf (NaN logits are not
    supported). `out`/`tmp` are optional int32 workspaces shaped like y.
    """
    bits = y.view(torch.int32)
    sign = torch.bitwise_right_shift(bits, 31, out=tmp)  # 0 or -1 (arithmetic shift)
    key = torch.bitwise_and(bits, 0x7FFFFFFF, out=out)  # magnitude
    key ^= sign
    key -= sign  # (mag ^ s) - s: negates where s == -1
    return key


def pick_backend(device: torch.device, backend: str) -> str:
    """'torch' or 'triton'. auto = torch off CUDA, triton on CUDA when it imports. (The engine
    passes RunnerConfig.sampler_backend, which OMNISTREAM_SAMPLER_BACKEND sets for A/B runs.)"""
    if backend not in _BACKENDS:
        raise ValueError(f"sampler backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        try:
            import runner.kernels.sampling  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    return backend


class Sampler:
    """Stateless apart from reusable buffers (randomness comes from the batch's noise keys);
    see the module docstring.

    backend: 'torch' (radix select in torch ops), 'triton' (runner/kernels/sampling.py) or
    'auto' (triton on CUDA). Both give the same kept sets up to fp32 summation order.
    """

    def __init__(self, device: torch.device | str, backend: str = "auto"):
        self.device = torch.device(device)
        self.backend = pick_backend(self.device, backend)
        self._kernels = None
        if self.backend == "triton":
            from runner.kernels import sampling as sampling_kernels

            self._kernels = sampling_kernels
        # Reusable [rows, V] buffers by name, grown to the largest batch seen: the race noise
        # everywhere, and on the CPU also the torch backend's workspaces (a fresh 160 MB tensor
        # there costs more in page faults than the op itself). On CUDA the workspaces come from
        # the caching allocator instead, so they are not pinned while the model runs.
        self._buffers: dict[str, Tensor] = {}
        self._persistent_workspaces = self.device.type == "cpu"

    # ---- public entry points ---------------------------------------------------------------

    def __call__(self, logits: Tensor, batch: SamplingBatch, state: SlotState) -> Tensor:
        """logits [B, V] float32 (modified in place) -> sampled ids [B] int64 on the logits' device."""
        self._check(logits, batch)
        self._penalize_and_bias(logits, batch, state)
        return self.sample(logits, batch)

    def penalize(self, logits: Tensor, batch: SamplingBatch, state: SlotState, col0: int = 0) -> None:
        """Stages 1-2 alone (in place); `sample` does the rest. logits [B, N] hold the ids
        [col0, col0 + N) of the vocabulary (the runner: a constraint's span); bias entries for
        ids outside them are dropped (those ids cannot be sampled from these logits anyway)."""
        self._check(logits, batch)
        if col0 < 0 or col0 + logits.shape[1] > state.vocab_size:
            raise ValueError(f"logits columns [{col0}, {col0 + logits.shape[1]}) exceed the vocabulary of {state.vocab_size}")
        self._penalize_and_bias(logits, batch, state, col0)

    def sample(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """Stages 3-5 on logits [B, N] that already carry penalties and bias: ids in [0, N).

        N may be a per-row sub-vocabulary (runner: a constraint's window of allowed ids);
        the race noise is then keyed on the column, which is what batch independence needs."""
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match a batch of {batch.num_rows} rows")
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        q = self._draw_noise(batch, logits.shape[1])  # [B, V] Exp(1) from the rows' noise keys
        if self._kernels is not None:
            return self._kernels.filter_and_sample(logits, batch, q)  # greedy rows handled in-kernel
        greedy_ids = logits.argmax(dim=-1) if batch.any_greedy else None  # [B], before scaling
        sampled = self._filter_torch(logits, batch, q)
        return sampled if greedy_ids is None else torch.where(batch.temperature == 0, greedy_ids, sampled)

    def process(self, logits: Tensor, batch: SamplingBatch, state: SlotState) -> Tensor:
        """Stages 1, 2 and 4 only: the logits the sampling rows draw from ([B, V], -inf = filtered).

        Greedy rows come back penalized and biased, then filtered like a temperature-1 row.
        Used by tests and by model-specific samplers that want the standard filters.
        """
        self._check(logits, batch)
        self._penalize_and_bias(logits, batch, state)
        if batch.all_greedy:
            return logits
        if self._kernels is not None:
            self._kernels.filter_logits(logits, batch)
        else:
            self._filter_torch(logits, batch, None)
        return logits

    # ---- stages ------------------------------------------------------------------------------

    @staticmethod
    def _check(logits: Tensor, batch: SamplingBatch) -> None:
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise TypeError(f"logits must be [B, V] float32, got {tuple(logits.shape)} {logits.dtype}")
        if logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows, batch has {batch.num_rows}")

    def _buffer(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
        """A [rows, cols] row-contiguous tensor (contents undefined): a view of the reusable
        buffer `name` for the noise and CPU workspaces, a fresh allocation otherwise."""
        if name != "noise" and not self._persistent_workspaces:
            return torch.empty(rows, cols, dtype=dtype, device=self.device)
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols or buf.dtype != dtype:
            buf = torch.empty(max(rows, 1), cols, dtype=dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:rows]

    def _penalize_and_bias(self, logits: Tensor, batch: SamplingBatch, state: SlotState, col0: int = 0) -> None:
        """Stages 1-2, in place on logits [B, N] of ids [col0, col0 + N)."""
        if batch.any_penalty:
            if self._kernels is not None:
                # One fused pass that reads the state rows directly (no [B, V] gathers).
                self._kernels.apply_penalties(logits, batch, state, col0)
            else:
                self._penalize_torch(logits, batch, state, col0)
        if batch.bias_vals is not None:
            assert batch.bias_rows is not None and batch.bias_cols is not None
            if col0 == 0 and logits.shape[1] == state.vocab_size:
                logits.index_put_((batch.bias_rows, batch.bias_cols), batch.bias_vals, accumulate=True)
            else:  # entries outside the columns add 0 to column 0 (no host sync to drop them)
                cols = batch.bias_cols - col0
                inside = (cols >= 0) & (cols < logits.shape[1])
                logits.index_put_((batch.bias_rows, torch.where(inside, cols, 0)),
                                  torch.where(inside, batch.bias_vals, 0.0), accumulate=True)

    @staticmethod
    def _penalize_torch(logits: Tensor, batch: SamplingBatch, state: SlotState, col0: int = 0) -> None:
        """Penalties with the reference roundings (x*p, x/p, x - f*c, x - p*1), each term only
        when some row uses it (the neutral values 1 / 0 are exact identities)."""
        prompt_mask, counts = state.gather_penalty_rows(batch.slots)  # [B, V] bool, [B, V] int32
        n = logits.shape[1]
        prompt_mask, counts = prompt_mask[:, col0 : col0 + n], counts[:, col0 : col0 + n]
        if batch.any_repetition:
            seen = counts > 0
            seen |= prompt_mask
            rep = batch.repetition_penalty.unsqueeze(1)  # [B, 1]
            penalized = torch.where(logits < 0, logits * rep, logits / rep)
            logits.copy_(torch.where(seen, penalized, logits))
        if batch.any_frequency:
            logits -= batch.frequency_penalty.unsqueeze(1) * counts.to(logits.dtype)
        if batch.any_presence:
            logits -= batch.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)

    def _draw_noise(self, batch: SamplingBatch, vocab: int) -> Tensor:
        """q [B, V] ~ Exp(1) for the race (`race_noise` of the rows' keys), in a buffer reused
        across steps; one launch however many rows are seeded."""
        q = self._buffer("noise", batch.num_rows, vocab, torch.float32)
        if self._kernels is not None:
            self._kernels.race_noise(batch.seeds, batch.counters, q)
        else:
            race_noise(batch.seeds, batch.counters, vocab, out=q)
        return q

    # ---- torch backend: temperature, top-k / top-p by radix select, min-p, race -------------

    def _filter_torch(self, logits: Tensor, batch: SamplingBatch, q: Tensor | None) -> Tensor:
        """Stage 4 (+ 5 when q is given), in place on logits [B, V].

        q None: writes the filtered logits (scaled, -inf where dropped) and returns them.
        q given: returns the race winners [B] (logits are left scaled, not masked).
        """
        b, v = logits.shape
        temp = torch.where(batch.temperature == 0, 1.0, batch.temperature)  # greedy rows: keep scale
        logits.div_(temp.unsqueeze(1))  # y: the same division as transformers' warper
        filt = batch.any_top_k or batch.any_top_p
        need_e = q is not None or batch.any_top_p or batch.any_min_p
        e = None
        if need_e:
            # e = exp(y - max y) in [0, 1]: the row's unnormalised probabilities.
            e = self._buffer("e", b, v, torch.float32)
            torch.sub(logits, logits.amax(dim=-1, keepdim=True), out=e).exp_()
        keep = None  # [B, V] bool, True = survives
        if filt:
            key_buf, tmp_buf = self._buffer("key", b, v, torch.int32), self._buffer("tmp", b, v, torch.int32)
            key = order_key(logits, out=key_buf, tmp=tmp_buf)
            t = self._thresholds(key, e, batch)  # [B, 1] int32: keep key >= t
            keep = torch.ge(key, t, out=self._buffer("keep", b, v, torch.bool))
        if batch.any_min_p:
            assert e is not None
            # p_i < min_p * p_max  <=>  e_i < min_p (p_max = 1/Z: the top token always survives).
            mp = e >= batch.min_p.unsqueeze(1)
            keep = mp if keep is None else keep.logical_and_(mp)
        if q is None:
            if keep is not None:
                logits.masked_fill_(keep.logical_not_(), _NEG_INF)
            return logits
        assert e is not None
        if keep is not None:
            e.masked_fill_(keep.logical_not_(), 0.0)
        q.clamp_(min=torch.finfo(q.dtype).tiny)  # race_noise is > 0; guards hand-made q (0/0 = NaN)
        return e.div_(q).argmax(dim=-1)

    def _thresholds(self, key: Tensor, e: Tensor | None, batch: SamplingBatch) -> Tensor:
        """Per-row key threshold t [B, 1] int32 of top-k then top-p (keep key >= t)."""
        inf = float("inf")
        v = key.shape[1]
        t = None
        if batch.any_top_k:
            k = batch.top_k
            bound = torch.where((k <= 0) | (k >= v), inf, k.to(torch.float64))  # off rows keep all
            t = self._radix_select(key, None, bound, None)
        if batch.any_top_p:
            assert e is not None
            frac = torch.where(batch.top_p < 1, batch.top_p.to(torch.float64), inf)  # p = 1: off
            tp = self._radix_select(key, e, frac, t)
            t = tp if t is None else torch.maximum(t, tp)
        assert t is not None
        return t

    def _radix_select(self, key: Tensor, weight: Tensor | None, bound: Tensor, floor: Tensor | None) -> Tensor:
        """Smallest key t per row with stat({key > t}) < bound, over the tokens with key >= floor.

        key [B, V] int32; weight [B, V] f32 (stat = mass) or None (stat = count); bound [B] f64:
        the count bound, or with a weight the fraction p of the total mass (inf = keep all);
        floor [B, 1] int32 or None. Returns t [B, 1] int32; keep key >= t.

        MSB-first radix select: level l histograms digit l of the tokens whose higher digits
        equal the prefix chosen so far, then picks the first digit (from the bottom) whose
        suffix stat (everything strictly above it, plus what lies above the prefix) is below
        the bound. Digits are 16 bits (2 levels) for a large vocabulary, 8 bits (4 levels)
        otherwise, so the [B, 2^bits] histogram never outgrows [B, V]. One flattened histogram
        (+1 trash bin for tokens out of play), so a level is one index_add_ over [B, V].
        """
        b, v = key.shape
        bits = _DIGIT_BITS if v >= _NUM_DIGITS else 8
        nb = 1 << bits
        trash = b * nb  # int32 bin indices: fine up to B = 32767 rows
        if trash >= 2**31:
            raise ValueError(f"batch of {b} rows too large for the int32 histogram index")
        base = torch.arange(b, device=key.device, dtype=torch.int32).unsqueeze(1) * nb  # [B, 1] bin offset per row
        idx = self._buffer("idx", b, v, torch.int32)
        out_of_play = self._buffer("oop", b, v, torch.bool)
        hi_bits = self._buffer("tmp", b, v, torch.int32)  # free once order_key is done
        floor_mask = None
        if floor is not None:
            floor_mask = torch.lt(key, floor, out=self._buffer("floor", b, v, torch.bool))
        lim = None
        above = None
        prefix = None  # [B] int64: the key's bits above the current digit (signed)
        for level in range(32 // bits):
            shift = 32 - bits * (level + 1)
            torch.bitwise_right_shift(key, shift, out=idx)
            if level == 0:
                idx += base + nb // 2  # signed top digit -> [0, nb)
                dead = floor_mask  # True = out of play
            else:
                assert prefix is not None
                # In play: higher bits == prefix; tell them apart before masking the digit out.
                # (key >> shift) >> bits == key >> (shift + bits) for arithmetic shifts.
                torch.bitwise_right_shift(idx, bits, out=hi_bits)
                dead = torch.ne(hi_bits, prefix.unsqueeze(1).to(torch.int32), out=out_of_play)
                if floor_mask is not None:
                    dead |= floor_mask
                idx &= nb - 1
                idx += base
            if dead is not None:
                idx.masked_fill_(dead, trash)
            cum = self._histogram(idx, weight, b, nb)  # [B, nb] f64 inclusive prefix sums
            if lim is None:
                # Level 0 sees every token in play: its total is Z for the mass bound.
                lim = bound if weight is None else bound * cum[:, -1]  # inf * Z = inf: row off
                above = torch.zeros_like(lim)
            digit, above = self._pick_digit(cum, above, lim)
            prefix = digit - nb // 2 if level == 0 else prefix * nb + digit
        assert prefix is not None
        return prefix.to(torch.int32).unsqueeze(1)

    @staticmethod
    def _histogram(idx: Tensor, weight: Tensor | None, b: int, nb: int) -> Tensor:
        """Per-row inclusive prefix sums [B, nb] float64 of the per-bin count (weight None) or
        weight sum; flat bin b*nb is the trash bin and is dropped. One index_add_, no host sync."""
        n = b * nb + 1
        hist = torch.zeros(n, dtype=torch.float32, device=idx.device)
        if weight is None:
            # Counts as fp32 sums of ones: exact below 2^24. (Not bincount: on CUDA it reads
            # idx.max() back to the host to size its output.)
            weight = torch.ones((), dtype=torch.float32, device=idx.device).expand(idx.shape)
        hist.index_add_(0, idx.view(-1), weight.reshape(-1))
        return torch.cumsum(hist[:-1].view(b, nb), dim=-1, dtype=torch.float64)

    @staticmethod
    def _pick_digit(cum: Tensor, above: Tensor, lim: Tensor) -> tuple[Tensor, Tensor]:
        """cum [B, D] f64 prefix sums of this level's histogram, above [B] (stat above this
        level's prefix), lim [B] -> (digit [B] int64, stat strictly above that digit [B]).

        suffix[d] = above + total - cum[d] (everything strictly above digit d) is non-increasing
        in d, also in floating point (cum only grows and subtraction is monotone), so the first
        digit with suffix < lim is the number of digits with suffix >= lim, i.e. with
        cum[d] <= above + total - lim. suffix[D-1] = above < lim holds by the caller's invariant
        (the prefix bucket was chosen with its suffix below the bound; at level 0 above = 0).
        float64 keeps the subtraction's error far below the fp32 error of the sums themselves.
        """
        d = cum.shape[1]
        total = cum[:, -1]
        digit = (cum <= (above + total - lim).unsqueeze(1)).sum(dim=-1).clamp_(max=d - 1)  # [B]
        above_digit = above + total - cum.gather(1, digit.unsqueeze(1)).squeeze(1)
        return digit, above_digit
