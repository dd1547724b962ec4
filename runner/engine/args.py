"""What the front end hands the engine process: the model folder, its profile (read once by the
front end), the engine's config parts and the process options. It travels as JSON on the
command line (`python -m runner.engine.process ARGS_JSON`); every default is the config
dataclasses' own (runner/config.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from runner.config import (
    ENGINE_PARTS,
    CacheConfig,
    ProcessConfig,
    RunnerConfig,
    SchedulerConfig,
    split_knobs,
)
from runner.vllm_engine.config import VllmConfig
from streaming.profile import ModelProfile, read_profile

PROCESS_PARTS = {**ENGINE_PARTS, "process": ProcessConfig, "vllm": VllmConfig}


class EngineProcArgs(msgspec.Struct, forbid_unknown_fields=True):
    model_path: str
    profile: ModelProfile
    input_addr: str = ""  # the front end binds PUSH here; the engine connects PULL
    output_addr: str = ""  # the front end binds PULL here; the engine connects PUSH
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    runner: RunnerConfig = msgspec.field(default_factory=RunnerConfig)
    process: ProcessConfig = msgspec.field(default_factory=ProcessConfig)
    vllm: VllmConfig = msgspec.field(default_factory=VllmConfig)  # read by runner.vllm_engine.process only
    log_level: str = "INFO"


def engine_args(model_path: str | Path, *, profile: ModelProfile | None = None, codec_path: str | None = None,
                **knobs) -> EngineProcArgs:
    """Arguments for the model at model_path; knobs are fields of the config parts by name
    (CacheConfig, SchedulerConfig, RunnerConfig, ProcessConfig), and input_addr / output_addr /
    log_level. The profile is read from the folder unless given."""
    direct = {k: knobs.pop(k) for k in ("input_addr", "output_addr", "log_level") if k in knobs}
    parts = split_knobs(knobs, PROCESS_PARTS)
    return EngineProcArgs(
        model_path=str(model_path),
        profile=profile if profile is not None else read_profile(model_path, codec_path),
        cache=CacheConfig(**parts["cache"]),
        scheduler=SchedulerConfig(**parts["scheduler"]),
        runner=RunnerConfig(**parts["runner"]),
        process=ProcessConfig(**parts["process"]),
        vllm=VllmConfig(**parts["vllm"]),
        **direct,
    )
