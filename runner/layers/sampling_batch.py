"""A step's sampling inputs: `SamplingBatch` (the rows' parameters on the device) and
`SamplingTable` (the same per slot on the host, so a step gathers its rows with one numpy index
per field)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from runner.utils.host_staging import staging_for
from streaming.sampling_params import SamplingParams


def to_device(data: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> Tensor:
    """One host array -> `device`; on CUDA a non-blocking copy through the pinned staging ring
    (runner/utils/host_staging.py), so the host never waits."""
    if device.type == "cuda":
        return staging_for(device).to_device(np.asarray(data), dtype)
    if isinstance(data, np.ndarray):
        return torch.from_numpy(data).to(dtype)
    return torch.tensor(data, dtype=dtype, device=device)


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
    ) -> SamplingBatch:
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
    ) -> SamplingBatch:
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
        dev = to_device(host, torch.uint8, device)
        dev_i = dev[:n_int].view(torch.int64).view(4, bp)[:, :b]
        dev_f = dev[n_int:].view(torch.float32).view(NUM_FLOAT_PARAMS, bp)[:, :b]
        temp, top_p, min_p, rep, freq, pres = host_f[:, :b]

        bias_rows = bias_cols = bias_vals = None
        if bias:
            rows, cols, vals = zip(*bias)
            idx = to_device(np.array([rows, cols], dtype=np.int64), torch.int64, device)
            bias_rows, bias_cols = idx[0], idx[1]
            bias_vals = to_device(np.array(vals, dtype=np.float32), torch.float32, device)

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


# A top_p far below 1 keeps the top token alone: top-p keeps the smallest set of mass >= p * Z,
# and the top token's mass is e = exp(0) = 1 > p * Z for any p < 1e-12 (Z <= V << 1e12). Below
# that floor p's value cannot matter, but it broke the filters: 1e-300 is 0 in the float32 rows
# (no token kept: code 0 every time), and a bound under the rounding of Z vanished in the radix
# select's fp64 suffix test (the same). A repetition penalty that validates (> 0) is kept
# in float32's range (0 would divide by zero).
_TOP_P_FLOOR = 1e-12
_F32_TINY = float(np.finfo(np.float32).tiny)


def float_params(p: SamplingParams) -> tuple[float, float, float, float, float, float]:
    """A request's row of SamplingBatch.from_host's floats: temperature, top_p, min_p,
    repetition, frequency and presence penalty (top_p and the repetition penalty floored, above)."""
    return (p.temperature, max(p.top_p, _TOP_P_FLOOR), p.min_p, max(p.repetition_penalty, _F32_TINY),
            p.frequency_penalty, p.presence_penalty)


class SamplingTable:
    """Host-side sampling inputs per slot, written when a request takes its slot, so a step
    gathers its rows with one numpy index per field instead of a Python pass over every
    request (a pass that grows with the batch, on the step's critical path): float_params
    rows, top_k, min_tokens, whether logit_bias is set, and the race-noise seed."""

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
              device: torch.device | str) -> SamplingBatch:
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
