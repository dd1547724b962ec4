"""Where each engine process of `serve` runs: one placement per engine, from --device,
--data-parallel-size and --devices.

A CUDA engine of a data-parallel group sees only its own GPU (CUDA_VISIBLE_DEVICES) and runs on
`cuda`: code that uses the current device (Triton launches, streams made without a device)
then cannot land on GPU 0 by accident. A single engine keeps --device as given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.config import ConfigError


@dataclass(frozen=True)
class Placement:
    device: str  # the engine process's RunnerConfig.device
    label: str  # what /health and /metrics show: the device as the operator named it
    env: dict[str, str] = field(default_factory=dict)  # added to the engine process's environment


def _gpu(index: int, cuda_count: int, visible: str | None, named: str) -> Placement:
    if not 0 <= index < cuda_count:
        raise ConfigError(f"devices: {named} does not exist ({cuda_count} CUDA devices visible)")
    # cuda:K counts the GPUs this process sees; a child's CUDA_VISIBLE_DEVICES names physical ones
    physical = visible.split(",")[index].strip() if visible else str(index)
    return Placement("cuda", named, {"CUDA_VISIBLE_DEVICES": physical})


def placements(device: str, data_parallel_size: int, devices: list[str], *, cuda_count: int,
               visible: str | None = None) -> list[Placement]:
    """One Placement per engine. `devices` (--devices) wins over `device` (--device) and sets the
    count; `cuda_count` is torch.cuda.device_count() and `visible` the front end's own
    CUDA_VISIBLE_DEVICES."""
    if devices:
        out = []
        for d in devices:
            if d.startswith("cuda:") and d[5:].isdigit():
                out.append(_gpu(int(d[5:]), cuda_count, visible, d))
            elif d in ("cuda", "auto"):
                raise ConfigError(f"devices: {d!r} is ambiguous in a list; name the GPU (cuda:0, cuda:1, ...)")
            else:
                out.append(Placement(d, d))
        return out
    if data_parallel_size == 1:
        return [Placement(device, device)]
    resolved = ("cuda" if cuda_count else "cpu") if device == "auto" else device
    if resolved == "cuda":
        if cuda_count < data_parallel_size:
            raise ConfigError(f"data_parallel_size: {data_parallel_size} engines need as many GPUs, "
                              f"{cuda_count} visible")
        return [_gpu(i, cuda_count, visible, f"cuda:{i}") for i in range(data_parallel_size)]
    if resolved.startswith("cuda:"):
        raise ConfigError(f"data_parallel_size: --device {device} is one GPU; list one per engine with --devices")
    return [Placement(resolved, resolved) for _ in range(data_parallel_size)]
