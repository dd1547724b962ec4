"""Every mistake in a message of the speech-session (vllm-omni names included), ElevenLabs and
Cartesia WebSockets gets that protocol's error shape naming exactly the field: each field of
each message Struct (nested ones by their dotted path) is given every JSON value its type
refuses, and an unknown key at every level (tests/support/fuzz_schema.field_mistakes), one
mistake per message, on one socket per protocol that must stay open throughout."""

from __future__ import annotations

import json

import msgspec
import pytest
import websockets

from server.tts.cartesia_messages import CancelRequest, GenerationRequest
from server.tts.elevenlabs_messages import ElevenLabsInput
from streaming.schema import InputDone, InputFlush, InputText, SessionClose, SessionConfig
from tests.server.ws_support import recv_json
from tests.support.fake_engine import FakeEngine, serve
from tests.support.fuzz_schema import field_mistakes, with_path

PCM = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}


def cases(cls: type[msgspec.Struct], base: dict) -> list[tuple[str, dict]]:
    return [(path, with_path(base, path, value)) for path, value in field_mistakes(cls)]


async def test_speech_session_names_every_mistaken_field():
    messages = (
        cases(SessionConfig, {"type": "session.config"})
        + cases(InputText, {"type": "input.text", "text": "Hi."})
        + [c for cls in (InputFlush, InputDone, SessionClose) for c in cases(cls, {"type": cls.__struct_config__.tag})]
    )
    async with serve(FakeEngine()) as s:
        async with websockets.connect(s.url("/v1/audio/speech/stream", "ws")) as ws:
            await recv_json(ws)  # session.created
            for path, msg in messages:
                await ws.send(json.dumps(msg))
                err = await recv_json(ws)
                assert set(err) == {"type", "code", "message", "param"}, (msg, err)
                assert (err["type"], err["code"], err["param"]) == ("error", "invalid_field", path), (msg, err)
            assert len(messages) > 50


@pytest.mark.parametrize("multi", [True, False], ids=["multi-stream-input", "stream-input"])
async def test_elevenlabs_names_every_mistaken_field(multi: bool):
    base = {"text": " ", "context_id": "c"} if multi else {"text": " "}
    path = "/v1/text-to-speech/tara/" + ("multi-stream-input" if multi else "stream-input")
    async with serve(FakeEngine()) as s:
        async with websockets.connect(s.url(path, "ws")) as ws:
            for field, msg in cases(ElevenLabsInput, base):
                await ws.send(json.dumps(msg))
                err = await recv_json(ws)
                raw_id = msg.get("context_id", msg.get("contextId"))
                expected = {"type": "error", "error": "invalid_field", "code": "invalid_field", "param": field}
                if multi and isinstance(raw_id, str):
                    expected["contextId"] = raw_id
                assert {k: v for k, v in err.items() if k != "message"} == expected, (msg, err)
                assert field in err["message"], err


async def test_cartesia_names_every_mistaken_field():
    base = {"context_id": "c", "transcript": "Hi.", "continue": True, "voice": {"mode": "id", "id": "tara"},
            "output_format": PCM}
    messages = cases(GenerationRequest, base) + cases(CancelRequest, {"context_id": "c", "cancel": True})
    async with serve(FakeEngine()) as s:
        async with websockets.connect(s.url("/tts/websocket", "ws")) as ws:
            for field, msg in messages:
                await ws.send(json.dumps(msg))
                err = await recv_json(ws)
                raw_id = msg.get("context_id")
                expected = {"type": "error", "context_id": raw_id if isinstance(raw_id, str) else None,
                            "code": "invalid_field", "param": field, "done": True, "status_code": 400}
                assert {k: v for k, v in err.items() if k != "error"} == expected, (msg, err)
                assert field in err["error"], err
