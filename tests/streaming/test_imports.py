"""streaming/ is the shared wire protocol: clients and the front end import it without the
runner or torch (its modules need msgspec and numpy)."""

import subprocess
import sys

MODULES = ("streaming.profile", "streaming.schema", "streaming.speech_schema", "streaming.ipc", "streaming.qwen3_tts_profile",
           "streaming.qwen3_tts_ids", "streaming.sampling_params")


def test_streaming_imports_neither_the_runner_nor_torch() -> None:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in MODULES)
            + "print(sorted({m.split('.')[0] for m in sys.modules} & {'runner', 'server', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
