"""Fixtures shared by the test packages: the tiny models and codec folders tests build, once per
session. Helper modules (model builders, the fake engine, the server process, the Triton
interpreter fixes) live in tests/support/.

The folders these fixtures return are shared by every test of the session: read them, and copy
one before editing it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from runner.models.builders import make_tiny_snac
from runner.models.default_model import ensure_default_model
from tests.support.tiny_models import make_tiny_model
from tests.support.triton_interpreter import interpret_without_cuda

# tests/reference/build_qwen3_tts_golden.sh writes each tests/reference/qwen3_tts*_golden.py's
# output here, in a folder named after the script
QWEN3_TTS_GOLDEN = Path(__file__).resolve().parent.parent / ".cache" / "qwen3tts-golden"

# Before any runner module with @triton.jit kernels is imported (runner/codecs/decoder.py imports
# the SNAC kernels at its top; the modules imported above import none): without CUDA those
# kernels then run under Triton's interpreter in every test file, whichever imports them first.
interpret_without_cuda()


@pytest.fixture(scope="session")
def tiny_snac_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runner.models.builders.make_tiny_snac(seed=0): the 24 kHz topology with tiny widths
    (codebook 64), saved with legacy weight-norm keys."""
    return make_tiny_snac(tmp_path_factory.mktemp("snac") / "tiny", seed=0)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model (tiny random Orpheus-shaped Llama, tokenizer, tiny SNAC)."""
    return ensure_default_model(tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model_dir(family, **kw) -> tests.support.tiny_models.make_tiny_model(family, path, **kw),
    built once per distinct (family, kw) in the session."""
    built: dict[tuple, Path] = {}

    def get(family: str, **kw) -> Path:
        key = (family, tuple(sorted(kw.items())))
        if key not in built:
            built[key] = make_tiny_model(family, tmp_path_factory.mktemp(family), **kw)
        return built[key]

    return get


@pytest.fixture(scope="session")
def qwen3_tts_golden() -> Callable[[str], Path]:
    """qwen3_tts_golden(stem) -> the golden folder of tests/reference/<stem>.py (the Qwen3-TTS
    reference's outputs); the test skips, naming the script that builds it, while it is absent."""

    def get(stem: str) -> Path:
        path = QWEN3_TTS_GOLDEN / stem
        if not path.is_dir():
            pytest.skip(f"no {path}: run tests/reference/build_qwen3_tts_golden.sh (reference qwen-tts 0.1.1)")
        return path

    return get


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module of tiny models (`pytestmark =
    pytest.mark.usefixtures("one_torch_thread")`): hundreds of small ops per frame run several
    times faster on one thread than on a pool that competes with other processes for the cores."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
