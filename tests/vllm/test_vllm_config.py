"""The vLLM backend's options and start-up checks. These run without vLLM too (the main CI
venv): the options and the missing-vLLM error are what every install sees."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import types

import msgspec
import pytest

from runner.vllm_engine.config import VLLM_VERSION, VllmConfig, VllmUnavailable, parse_layers, require_vllm
from tests.support.server_proc import REPO, free_port


def test_hidden_state_layers_spec():
    assert parse_layers("all", 2) == (0, 1, 2)
    assert parse_layers("-1, 0", 2) == (0, 2)
    assert parse_layers("none", 2) == ()
    for bad in ("3", "-4", "x"):
        with pytest.raises(ValueError, match="vllm_hidden_state_layers"):
            parse_layers(bad, 2)


def test_missing_or_other_vllm_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import fails
    with pytest.raises(VllmUnavailable) as e:
        require_vllm()
    assert "pip install 'omnistream[vllm]'" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.31.1"))
    with pytest.raises(VllmUnavailable, match=f"vLLM {VLLM_VERSION} exactly .* found 0.31.1"):
        require_vllm()
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=f"{VLLM_VERSION}+cpu"))
    assert require_vllm() == f"{VLLM_VERSION}+cpu"


def test_serve_options_reach_the_engine_process_args():
    from runner.engine.args import EngineProcArgs
    from server.cli import _serve_parser
    from server.main import engine_args_from
    from streaming.profile import ModelProfile

    ap = argparse.ArgumentParser()
    _serve_parser(ap.add_subparsers(dest="cmd"))
    ns = ap.parse_args(["serve", "--engine", "vllm", "--tensor-parallel-size", "2", "--enforce-eager",
                        "--gpu-memory-utilization", "0.5", "--vllm-hidden-state-layers", "0,-1"])
    args = engine_args_from(ns, "/m", ModelProfile(family="text", speech=None), "INFO")
    want = VllmConfig(tensor_parallel_size=2, enforce_eager=True, gpu_memory_utilization=0.5,
                      vllm_hidden_state_layers="0,-1")
    assert args.vllm == want
    # the engine process reads it back from its JSON argument
    assert msgspec.json.decode(msgspec.json.encode(args), type=EngineProcArgs).vllm == want


def test_options_and_args_do_not_import_vllm():
    code = ("import sys, runner.vllm_engine.config, runner.engine.args, server.cli, server.main; "
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_serve_engine_vllm_without_vllm_exits_with_the_one_line(tmp_path):
    cmd = [sys.executable, "-m", "server.cli", "serve", "--engine", "vllm", "--port", str(free_port()),
           "--zmq-endpoint", "none", "--cache-dir", str(tmp_path), "--device", "cpu"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"omnistream: --engine vllm needs vLLM {VLLM_VERSION}: pip install 'omnistream[vllm]'"), r.stderr
    assert "Traceback" not in r.stderr
