"""One REAL server process (`python -m server.cli serve` on the embedded tiny default model)
serves every end-to-end module (session scope); test_e2e_engine_death.py starts its own
because it kills the engine."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.e2e.helpers import WAIT_S
from tests.support.server_proc import ServerProc, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> ServerProc:
    srv = start_server(tmp_path_factory.mktemp("e2e"), "--max-num-seqs", "48")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def model_dir(server: ServerProc) -> Path:
    from runner.models.default_model import ensure_default_model

    return ensure_default_model(server.cache_dir)  # already built by the server: just its path


@pytest.fixture
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=WAIT_S, max_retries=0)
