"""The engine's output record across the process boundary: RequestOutput is itself the wire
Struct, arrays travel as raw frames and come back as read-only views on them."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from streaming import ipc
from streaming.sampling_params import SamplingParams


def _full_output() -> ipc.RequestOutput:
    return ipc.RequestOutput(
        "r1",
        new_token_ids=[5, 6, 7],
        hidden=np.arange(2 * 3 * 4, dtype=np.uint16).reshape(2, 3, 4),  # bf16 travels as raw uint16
        hidden_positions=(10, 12),
        audio=np.arange(-4, 4, dtype=np.int16),
        finished=True,
        finish_reason="stop",
        error="codec: failed",
        error_field="codec",
        num_prompt_tokens=9,
        num_output_tokens=3,
        num_cached_tokens=4,
    )


def _frames_over_the_wire(frames: list) -> list:
    return [bytes(f) for f in frames]  # what a ZeroMQ peer receives: fresh buffers


def test_every_field_survives_the_round_trip():
    sent = [_full_output(), ipc.RequestOutput("r2", new_token_ids=[1])]
    got = ipc.decode_outbound(_frames_over_the_wire(ipc.encode_outputs(sent)))
    assert isinstance(got, list) and len(got) == 2
    for a, b in zip(sent, got):
        for name in ipc.RequestOutput.__struct_fields__:
            va, vb = getattr(a, name), getattr(b, name)
            if isinstance(va, np.ndarray):
                assert vb.dtype == va.dtype and np.array_equal(va, vb), name
            else:
                assert vb == va, name
    assert got[1].hidden is None and got[1].audio is None and got[1].hidden_positions == (0, 0)


def test_arrays_are_frames_and_come_back_as_views():
    out = _full_output()
    frames = ipc.encode_outputs([out])
    assert len(frames) == 3  # header, hidden, audio
    assert bytes(frames[1]) == out.hidden.tobytes() and bytes(frames[2]) == out.audio.tobytes()
    received = _frames_over_the_wire(frames)
    got = ipc.decode_outbound(received)[0]
    assert not got.hidden.flags.writeable and not got.audio.flags.writeable
    assert np.shares_memory(got.audio, np.frombuffer(received[2], dtype=np.int16))


def test_non_contiguous_arrays_are_sent_contiguous():
    h = np.arange(4 * 3 * 2, dtype=np.float32).reshape(4, 3, 2)[:, [0, 2], :]
    got = ipc.decode_outbound(ipc.encode_outputs([ipc.RequestOutput("r", hidden=h[::2], hidden_positions=(0, 2))]))[0]
    assert np.array_equal(got.hidden, h[::2])


def test_other_outbound_messages_and_the_inbound_ones():
    dead = ipc.decode_outbound(ipc.encode_outbound(ipc.EngineDead("boom")))
    assert dead == ipc.EngineDead("boom")
    add = ipc.AddRequest("r", [1, 2], hidden_state_layers=[-1], audio=True)
    assert ipc.decode_inbound(ipc.encode_inbound(add)) == add
    # a Qwen3-TTS request: codec part per prompt position, trailing text, the groups' parameters
    qwen = ipc.AddRequest("q", [7, 8], prompt_frames=[[-1, -1], [41, -1]], step_text_ids=[5, 6],
                          group_sampling=SamplingParams(temperature=0.5, top_k=3))
    back = ipc.decode_inbound(ipc.encode_inbound(qwen))
    assert back == qwen and back.group_sampling.top_k == 3
    assert ipc.decode_inbound(ipc.encode_inbound(ipc.GetStats())) == ipc.GetStats()


def test_inbound_messages_have_no_client_field():
    for msg in (ipc.AddRequest, ipc.AbortRequests, ipc.GetStats):
        assert "client" not in msg.__struct_fields__
    with pytest.raises(msgspec.ValidationError):  # AddRequest forbids unknown fields
        ipc.decode_inbound(msgspec.msgpack.encode({"type": "add", "request_id": "r", "prompt_token_ids": [1], "client": b"x"}))
