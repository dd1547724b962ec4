"""A plain language-model folder (no omnistream.json, a vocabulary without Orpheus's audio
tokens) serves what it can: completions; every speech route answers one
clear error; no voices are listed. A folder missing a file fails at start in one line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.support.server_proc import REPO, ServerProc, free_port, http_get, start_server
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.e2e


def _text_folder(root: Path) -> Path:
    from runner.models.default_model import ensure_default_model

    folder = make_tiny_model("qwen3", root / "qwen3", vocab_size=1024)
    default = ensure_default_model(root / "cache")  # borrow a real tokenizer (ids < 1024)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def text_server(tmp_path_factory) -> ServerProc:
    root = tmp_path_factory.mktemp("text-model")
    srv = start_server(root / "srv", "--model", str(_text_folder(root)))
    try:
        yield srv
    finally:
        srv.stop()


def test_text_model_lists_no_voices_and_answers_to_the_alias(text_server: ServerProc):
    status, body = http_get(text_server.base_url + "/v1/audio/voices")
    assert status == 200 and body["voices"] == [] and body["default_voice"] is None
    status, card = http_get(text_server.base_url + "/v1/models/omnistream")
    assert status == 200 and card["speech"] is False


def test_text_model_serves_completions(text_server: ServerProc):
    client = openai.OpenAI(base_url=text_server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    out = client.completions.create(model="omnistream", prompt="Hello there", max_tokens=5,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5


async def test_every_speech_route_says_the_model_has_no_speech(text_server: ServerProc):
    async with aiohttp.ClientSession() as s:
        async with s.post(text_server.base_url + "/v1/audio/speech", json={"model": "omnistream", "input": "hi",
                                                                          "voice": "tara"}) as r:
            body = await r.json()
        assert r.status == 400
        assert body["error"]["param"] == "model" and body["error"]["code"] == "model_has_no_speech"
        for path in ("/v1/audio/speech/stream", "/v1/text-to-speech/tara/stream-input"):
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await s.ws_connect(text_server.ws_url + path)
            assert e.value.status == 400
    assert text_server.health() == 200  # and it keeps serving


def test_a_missing_tokenizer_is_named_in_one_line(tmp_path):
    folder = _text_folder(tmp_path)
    (folder / "tokenizer.json").unlink()
    proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(folder), "--device", "cpu",
                           "--port", str(free_port()), "--zmq-endpoint", "none"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "tokenizer.json" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
