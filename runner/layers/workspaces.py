"""Named reusable [rows, cols] device buffers for the sampler's per-step tensors."""

from __future__ import annotations

import torch
from torch import Tensor


class Workspaces:
    """Buffers by name, grown to the largest batch seen (`persistent`), or a fresh allocation
    per call. Why both: on the CPU a fresh [B, V] tensor (160 MB at 256 x 156940) costs more in
    page faults than the op that fills it; on CUDA the caching allocator hands them out cheaply
    and they are then not pinned while the model runs."""

    def __init__(self, device: torch.device, persistent: bool) -> None:
        self.device = device
        self.persistent = persistent
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
        """A [rows, cols] row-contiguous tensor, contents undefined."""
        if not self.persistent:
            return torch.empty(rows, cols, dtype=dtype, device=self.device)
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols or buf.dtype != dtype:
            buf = torch.empty(max(rows, 1), cols, dtype=dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:rows]
