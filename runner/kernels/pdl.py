"""Programmatic dependent launch (PDL, Hopper and newer) for the decode path's Triton kernels.

Why: a decode step is ~300 kernels in a row (B=64: ~290, each 1-30 µs). Without PDL each one
starts only after its predecessor has fully drained, and the GPU sits ~1.5-2 µs between them
(about a sixth of a batch-64 step). With PDL a kernel is launched
while its predecessor is still running; its programs reach `griddepcontrol.wait` early, and
the wait returns as soon as the predecessor's memory is visible.

The rule that keeps this correct: a kernel launched with `launch_pdl=True` calls `pdl_enter`
(i.e. waits) before it touches any memory an earlier kernel may write, and every program of
it does so unconditionally. Then a kernel's completion implies its predecessor's, and so on
down the chain, so reading a tensor written two or more kernels back is safe too. Weights are
never written by a kernel, so a GEMM may load them before the wait (runner/kernels/linear.py).

`pdl_enter` is the usual form (wait, then trigger the next launch at once); a kernel may call
`pdl_wait` and `pdl_trigger` apart to let the next kernel launch later (runner/kernels/linear.py
`LinearTile.late_trigger`): where the trigger sits only moves when the next kernel's programs
start, never what they may read.

Chosen once, at construction (`pdl_available`): CUDA capability >= 9 and not the Triton
interpreter (which has no `griddepcontrol`). Launches carry the flag as `launch_pdl=...` and
the kernels as a `USE_GDC` constexpr, always the same value.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def pdl_available(device: torch.device | str) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def pdl_wait(USE_GDC: tl.constexpr):
    """Wait for the previous kernel's memory (no-op off PDL)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_trigger(USE_GDC: tl.constexpr):
    """Let the next kernel launch once every program of this one has called it or exited (no-op
    off PDL). Its placement only moves when the next kernel's programs start; they still wait
    for this kernel's completion before reading what it writes."""
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_enter(USE_GDC: tl.constexpr):
    """Wait for the previous kernel's memory, then let the next kernel launch (no-op off PDL)."""
    pdl_wait(USE_GDC)
    pdl_trigger(USE_GDC)
