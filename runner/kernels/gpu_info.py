"""What the kernels need to know about the GPU, read once per device."""

from __future__ import annotations

import functools

import torch

# SM count assumed where there is no CUDA device (Triton's interpreter in CPU tests): an H200's,
# so the tests exercise the grid shapes the target runs.
DEFAULT_NUM_SMS = 132


@functools.cache
def num_sms(device: torch.device | str) -> int:
    """Streaming multiprocessors of `device` (DEFAULT_NUM_SMS off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
