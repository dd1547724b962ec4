"""A step's outputs on their way to the host: sampled ids (one per sampling row), with a
multi-codebook model their frames (K codes per sampling row), and the hidden rows of requests
that asked for them.

`OutputCopier.copy` starts the device -> host copies and returns an `AsyncOutput` at once;
`AsyncOutput.get()` waits for that copy only. CPU and CUDA differ only in the copier, picked
once at construction (`output_copier_for`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# (request, first row in the copied hidden block, rows, first position, layer columns)
HiddenSpan = tuple[object, int, int, int, list[int]]


@dataclass
class StepResult:
    sampled: list[int]  # one per sampling entry, in order
    frames: np.ndarray | None  # [n, K] int64 codes per sampling entry (multi-codebook models), else None
    hidden: dict[int, tuple[int, np.ndarray]]  # id(req) -> (first position, [n, n_layers, H])


class AsyncOutput:
    """Handle to a step's outputs being copied to the host; `get()` waits only for this copy."""

    def __init__(self, sampled: torch.Tensor, hidden: torch.Tensor | None, spans: list[HiddenSpan],
                 event: torch.cuda.Event | None, ring_row: tuple[list, int] | None = None,
                 frames: torch.Tensor | None = None):
        self._sampled, self._hidden, self._spans, self._event = sampled, hidden, spans, event
        self._frames = frames
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
        frames = self._frames.numpy().copy() if self._frames is not None else None  # the ring row is reused
        return StepResult(sampled, frames, hidden)


class OutputCopier:
    """CPU: results are already on the host."""

    def copy(self, sampled: torch.Tensor, hidden: torch.Tensor | None, spans: list[HiddenSpan],
             frames: torch.Tensor | None = None) -> AsyncOutput:
        return AsyncOutput(sampled, hidden, spans, None, frames=frames)


class CudaOutputCopier(OutputCopier):
    """Copies on a side stream into pinned buffers and records an event, so the compute stream
    moves on to the next step while the copy runs.

    The sampled ids land in a ring of RING preallocated pinned rows (no pinned allocation per
    step). Row i is rewritten RING steps later; the engine reads a step's output within the
    next step (async scheduling keeps one step pending), and AsyncOutput checks that its row
    was not rewritten before it was read."""

    RING = 4

    def __init__(self, device: torch.device, max_rows: int, frame_width: int = 0):
        self.stream = torch.cuda.Stream(device)
        self._ring = torch.empty(self.RING, max(max_rows, 1), dtype=torch.int64, pin_memory=True)
        # frames of a multi-codebook model (frame_width = K codes), same ring discipline
        self._frame_ring = (torch.empty(self.RING, max(max_rows, 1), frame_width, dtype=torch.int64, pin_memory=True)
                            if frame_width else None)
        self._owner: list[object] = [None] * self.RING  # the AsyncOutput each row belongs to
        self._next = 0

    def copy(self, sampled: torch.Tensor, hidden: torch.Tensor | None, spans: list[HiddenSpan],
             frames: torch.Tensor | None = None) -> AsyncOutput:
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        i, self._next = self._next, (self._next + 1) % self.RING
        with torch.cuda.stream(self.stream):
            s_host = self._ring[i, : sampled.shape[0]]
            s_host.copy_(sampled, non_blocking=True)
            sampled.record_stream(self.stream)
            f_host = None
            if frames is not None:
                f_host = self._frame_ring[i, : frames.shape[0]]
                f_host.copy_(frames, non_blocking=True)
                frames.record_stream(self.stream)
            h_host = None
            if hidden is not None:
                h_host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
                h_host.copy_(hidden, non_blocking=True)
                hidden.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        out = AsyncOutput(s_host, h_host, spans, event, (self._owner, i), frames=f_host)
        self._owner[i] = out
        return out


def output_copier_for(device: torch.device, max_rows: int, frame_width: int = 0) -> OutputCopier:
    """frame_width: codes per frame of a multi-codebook model (0: tokens only)."""
    return CudaOutputCopier(device, max_rows, frame_width) if device.type == "cuda" else OutputCopier()
