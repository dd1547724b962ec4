"""Each default lives in one config dataclass; the CLI, the engine process's arguments and
in-process construction derive from it."""

from __future__ import annotations

import argparse
import dataclasses

import msgspec
import pytest

from runner.config import (
    ENGINE_PARTS,
    CacheConfig,
    ConfigError,
    ProcessConfig,
    RunnerConfig,
    SchedulerConfig,
    split_knobs,
)
from runner.engine.args import EngineProcArgs, engine_args
from server.cli import _serve_parser
from server.settings import ModelSource, ServerSettings
from streaming.profile import ModelProfile

CONFIGS = (ModelSource, ServerSettings, SchedulerConfig, CacheConfig, RunnerConfig, ProcessConfig)


def _serve(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    _serve_parser(ap.add_subparsers(dest="cmd"))
    return ap.parse_args(["serve", *argv])


def test_serve_defaults_are_the_dataclass_defaults():
    ns = _serve([])
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            if "help" in f.metadata:
                assert getattr(ns, f.name) == f.default, f"{cls.__name__}.{f.name}"


def test_every_engine_knob_has_an_option():
    ns = vars(_serve([]))
    for cls in (*ENGINE_PARTS.values(), ProcessConfig):
        for f in dataclasses.fields(cls):
            assert f.name in ns, f"{cls.__name__}.{f.name} has no serve option"


def test_options_reach_the_engine_args():
    from server.main import engine_args_from

    ns = _serve(["--max-num-seqs", "7", "--no-async-scheduling", "--no-prefix-caching", "--admission-wait-ms", "0",
                 "--device", "cpu", "--cpu-threads", "1", "--no-pdl"])
    args = engine_args_from(ns, "/m", ModelProfile(), "INFO")
    assert args.scheduler == SchedulerConfig(max_num_seqs=7, async_scheduling=False, admission_wait_ms=0.0)
    assert args.cache == CacheConfig(enable_prefix_caching=False)
    assert args.runner == RunnerConfig(device="cpu", pdl=False)
    assert args.process == ProcessConfig(cpu_threads=1)
    # the arguments travel as JSON to the engine process and come back equal
    back = msgspec.json.decode(msgspec.json.encode(args), type=EngineProcArgs)
    assert back == args


def test_in_process_and_served_defaults_agree(tmp_path):
    from runner.config import EngineConfig
    from tests.support.tiny_models import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "m")
    served = engine_args(path)
    cfg = EngineConfig.build(path)
    assert (served.cache, served.runner) == (cfg.cache, cfg.runner)
    assert dataclasses.replace(served.scheduler, max_model_len=cfg.scheduler.max_model_len) == cfg.scheduler


def test_unknown_knob_names_itself():
    with pytest.raises(ConfigError, match="max_num_seq"):
        split_knobs({"max_num_seq": 4})
    assert split_knobs({"max_num_seqs": 4, "pdl": False}) == {"cache": {}, "scheduler": {"max_num_seqs": 4},
                                                             "runner": {"pdl": False}}
