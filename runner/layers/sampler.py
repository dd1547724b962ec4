"""The token sampler: the stages in order, over a backend chosen once at construction.

The per-slot device state it reads is runner/layers/slot_state.py, the step's inputs
runner/layers/sampling_batch.py; the backends (runner/layers/base.py `SamplingBackend`) are
runner/layers/sampling_torch.py and runner/layers/sampling_triton.py.

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

import torch
from torch import Tensor

from runner.kernels.tuning import Tables
from runner.layers import make_sampling, pick_sampling_backend
from runner.layers.sampling_batch import SamplingBatch
from runner.layers.slot_state import SlotState
from runner.layers.workspaces import Workspaces


class Sampler:
    """Stateless apart from reusable buffers (randomness comes from the batch's noise keys);
    see the module docstring.

    backend: 'torch' (radix select in torch ops), 'triton' (runner/kernels/sampling.py) or
    'auto' (triton on CUDA), resolved and built once here. Both give the same kept sets up to
    fp32 summation order. tuning: RunnerConfig.tuning, the triton kernels' launch configuration
    ("auto": the device's table, "none": the untuned one); `tables` replaces that lookup (tests
    and sweeps forcing other launch parameters).
    """

    def __init__(self, device: torch.device | str, backend: str = "auto", tuning: str = "auto",
                 tables: Tables | None = None):
        self.device = torch.device(device)
        self.backend = pick_sampling_backend(self.device, backend)
        self._backend = make_sampling(self.backend, self.device, tuning, tables)
        # the race noise [rows, V], reused across steps whatever the device
        self._noise = Workspaces(self.device, persistent=True)

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
        return self._backend.filter_and_sample(logits, batch, q)

    def process(self, logits: Tensor, batch: SamplingBatch, state: SlotState) -> Tensor:
        """Stages 1, 2 and 4 only: the logits the sampling rows draw from ([B, V], -inf = filtered).

        Greedy rows come back penalized and biased, then filtered like a temperature-1 row.
        Used by tests and by model-specific samplers that want the standard filters.
        """
        self._check(logits, batch)
        self._penalize_and_bias(logits, batch, state)
        if batch.all_greedy:
            return logits
        self._backend.filter_logits(logits, batch)
        return logits

    # ---- stages ------------------------------------------------------------------------------

    @staticmethod
    def _check(logits: Tensor, batch: SamplingBatch) -> None:
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise TypeError(f"logits must be [B, V] float32, got {tuple(logits.shape)} {logits.dtype}")
        if logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows, batch has {batch.num_rows}")

    def _penalize_and_bias(self, logits: Tensor, batch: SamplingBatch, state: SlotState, col0: int = 0) -> None:
        """Stages 1-2, in place on logits [B, N] of ids [col0, col0 + N)."""
        if batch.any_penalty:
            self._backend.apply_penalties(logits, batch, state, col0)
        if batch.bias_vals is not None:
            assert batch.bias_rows is not None and batch.bias_cols is not None
            if col0 == 0 and logits.shape[1] == state.vocab_size:
                logits.index_put_((batch.bias_rows, batch.bias_cols), batch.bias_vals, accumulate=True)
            else:  # entries outside the columns add 0 to column 0 (no host sync to drop them)
                cols = batch.bias_cols - col0
                inside = (cols >= 0) & (cols < logits.shape[1])
                logits.index_put_((batch.bias_rows, torch.where(inside, cols, 0)),
                                  torch.where(inside, batch.bias_vals, 0.0), accumulate=True)

    def _draw_noise(self, batch: SamplingBatch, vocab: int) -> Tensor:
        """q [B, V] ~ Exp(1) for the race (`race_noise` of the rows' keys), in a buffer reused
        across steps; one launch however many rows are seeded."""
        q = self._noise.get("noise", batch.num_rows, vocab, torch.float32)
        return self._backend.race_noise(batch.seeds, batch.counters, q)
