"""Host -> device copies of the small arrays every step sends (ids, positions, block tables,
sampling parameters), through one pinned ring buffer.

Why: `torch.from_numpy(a).pin_memory().to(dev, non_blocking=True)` allocates a pinned block
per call (the caching host allocator's bookkeeping plus an event per block), a host cost paid
~10 times per step. Here a copy is a memcpy into the ring, one non-blocking cudaMemcpyAsync and
one event.

Invariant: a region of the ring is rewritten only after the copy that read it last has
completed. Regions are handed out in address order and wrap to the start; each copy records
an event, and a new region first waits for the events of the previous lap's copies it
overlaps (in practice long complete: a lap is hundreds of steps).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

_ALIGN = 64  # bytes: Triton specialises pointers on 16-byte alignment, keep every copy aligned
_NUMPY_DTYPE = {torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32), torch.float32: np.dtype(np.float32),
                torch.bool: np.dtype(np.bool_), torch.uint8: np.dtype(np.uint8), torch.int16: np.dtype(np.int16),
                torch.float64: np.dtype(np.float64), torch.float16: np.dtype(np.float16)}
_TORCH_DTYPE = {v: k for k, v in _NUMPY_DTYPE.items()}


class PinnedStaging:
    def __init__(self, device: torch.device, capacity_bytes: int = 16 << 20):
        if device.type != "cuda":
            raise ValueError("PinnedStaging is for CUDA devices")
        self.device = device
        self.capacity = capacity_bytes
        self._buf = torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=True)
        self._np = self._buf.numpy()
        self._head = 0
        self._lap = 0
        self._fences: deque[tuple[int, int, torch.cuda.Event]] = deque()  # (lap, start, event), in order

    def to_device(self, arr: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A device tensor with arr's contents (shape kept; converted to dtype first if given).
        Asynchronous: the copy is queued on the current stream."""
        if dtype is not None and _TORCH_DTYPE.get(arr.dtype) != dtype:
            arr = arr.astype(_NUMPY_DTYPE[dtype])
        start, src = self._source(np.ascontiguousarray(arr))
        out = src.to(self.device, non_blocking=True)
        self._fence(start)
        return out

    def copy_into(self, dst: torch.Tensor, arr: np.ndarray) -> None:
        """dst[:arr.size] = arr (dst 1-D, contiguous, of arr's dtype), queued on the current
        stream: into a buffer whose address must not change (a CUDA graph's input)."""
        arr = np.ascontiguousarray(arr).reshape(-1)
        assert dst.dim() == 1 and dst.is_contiguous() and dst.dtype == _TORCH_DTYPE[arr.dtype], (dst.dtype, arr.dtype)
        assert arr.size <= dst.numel(), (arr.size, dst.numel())
        start, src = self._source(arr)
        dst[: arr.size].copy_(src, non_blocking=True)
        self._fence(start)

    def _source(self, arr: np.ndarray) -> tuple[int | None, torch.Tensor]:
        """(start, src): a pinned tensor holding arr (contiguous) for one copy, in the ring (its
        region's start), or for a rare large array a pinned block of its own (start None: the
        caching host allocator keeps it alive until its copy has run)."""
        if arr.nbytes > self.capacity // 4:
            return None, torch.from_numpy(arr).pin_memory()
        return self._stage(arr)

    def _stage(self, arr: np.ndarray) -> tuple[int, torch.Tensor]:
        """arr copied into the ring: (its region's start, a pinned view of it typed and shaped
        like arr). The caller queues one copy from the view, then `_fence(start)`."""
        n = arr.nbytes
        start = -(-self._head // _ALIGN) * _ALIGN
        if start + n > self.capacity:
            start, self._lap = 0, self._lap + 1
        end = start + n
        # the previous lap's copies out of [start, end) must be done before it is overwritten
        # (fences are in allocation order: two laps old ones first, then the previous lap's by address)
        while self._fences and (self._fences[0][0] < self._lap - 1 or (self._fences[0][0] < self._lap and self._fences[0][1] < end)):
            self._fences.popleft()[2].synchronize()
        self._np[start:end] = arr.reshape(-1).view(np.uint8)
        self._head = end
        return start, self._buf[start:end].view(_TORCH_DTYPE[arr.dtype]).view(arr.shape)

    def _fence(self, start: int | None) -> None:
        """The region at `start` is free again once the copy just queued from it has run (None:
        not in the ring)."""
        if start is None:
            return
        ev = torch.cuda.Event()
        ev.record()
        self._fences.append((self._lap, start, ev))


_STAGING: dict[torch.device, PinnedStaging] = {}


def staging_for(device: torch.device) -> PinnedStaging:
    """The engine's ring for `device` (the engine runs its steps on one thread). A codec decoder
    holds a ring of its own: its copies queue behind its stream's backlog (hundreds of ms at
    ~1000 streams), and sharing this ring would make the engine's next copy wait for them."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    st = _STAGING.get(device)
    if st is None:
        st = _STAGING[device] = PinnedStaging(device)
    return st
