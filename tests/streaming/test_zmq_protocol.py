"""streaming/zmq_protocol.py: the Structs write the maps docs/zmq.md documents, byte for byte."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from streaming.ipc import TensorRef
from streaming.schema import GenerationOptions
from streaming.zmq_protocol import (
    ErrorReply,
    StepReply,
    ZmqRequest,
    decode_reply,
    decode_request,
    encode,
    pack_tensor,
    unpack_tensor,
)

plain = msgspec.msgpack.Encoder()  # what a client in another language sends: a plain map


def test_requests_encode_as_the_documented_maps():
    gen = ZmqRequest("generate", "1", prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 4, "temperature": 0},
                     hidden_state_layers=[-1])
    assert encode(gen) == plain.encode({"type": "generate", "id": "1", "prompt_token_ids": [1, 2, 3],
                                        "sampling": {"max_tokens": 4, "temperature": 0}, "hidden_state_layers": [-1]})
    speech = ZmqRequest("speech", "2", input="Hi.", voice="tara", sampling={"seed": 1})
    assert encode(speech) == plain.encode({"type": "speech", "id": "2", "input": "Hi.", "voice": "tara",
                                           "sampling": {"seed": 1}})
    assert encode(ZmqRequest("abort", "3")) == plain.encode({"type": "abort", "id": "3"})


def test_documented_request_maps_decode_and_unknown_keys_are_refused():
    msg = decode_request(plain.encode({"type": "generate", "id": "1", "prompt": "Hello", "sampling": {"top_k": 5}}))
    assert msg == ZmqRequest("generate", "1", prompt="Hello", sampling=GenerationOptions(top_k=5))
    assert decode_request(plain.encode({"type": "speech", "id": "2", "input": "Hi."})).sampling is None
    with pytest.raises(msgspec.ValidationError, match="unknown field `promt`"):
        decode_request(plain.encode({"type": "generate", "id": "1", "promt": "Hello"}))
    with pytest.raises(msgspec.DecodeError):
        decode_request(b"\xc1")


def test_replies_encode_as_the_documented_maps():
    step = StepReply("a", [5, 6], TensorRef(1, "<f4", [2, 1, 8]), [0, 2], TensorRef(2, "<i2", [240]),
                     True, "length", {"prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": 0})
    assert encode(step) == plain.encode({
        "type": "step", "id": "a", "token_ids": [5, 6], "hidden": [1, "<f4", [2, 1, 8]], "hidden_positions": [0, 2],
        "audio": [2, "<i2", [240]], "finished": True, "finish_reason": "length",
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": 0},
    })
    # defaults stay off the wire
    assert encode(StepReply("a", [7])) == plain.encode({"type": "step", "id": "a", "token_ids": [7]})
    err = ErrorReply("b", "invalid_request", "voice: unknown", "voice")
    assert encode(err) == plain.encode({"type": "error", "id": "b", "code": "invalid_request",
                                        "message": "voice: unknown", "param": "voice"})
    assert msgspec.msgpack.decode(encode(ErrorReply("", "overloaded", "full")))["param"] is None


def test_replies_decode_by_type_with_missing_keys_as_defaults():
    assert decode_reply(plain.encode({"type": "step", "id": "a"})) == StepReply("a")
    got = decode_reply(plain.encode({"type": "error", "id": "b", "code": "unavailable", "message": "down"}))
    assert got == ErrorReply("b", "unavailable", "down", None)
    with pytest.raises(msgspec.ValidationError):
        decode_reply(plain.encode({"type": "stpe", "id": "a"}))


@pytest.mark.parametrize("arr", [
    np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2],  # not contiguous: copied
    np.arange(10, dtype=np.uint16),  # bf16 travels as its raw bits
    np.zeros((0, 1, 8), dtype=np.float32),
])
def test_tensors_round_trip_through_frames(arr):
    frames: list = []
    first = pack_tensor(np.zeros(3, np.int16), frames)  # e.g. the audio chunk: frame 1
    ref = pack_tensor(arr, frames)
    assert (first.frame, ref.frame) == (1, 2) and ref.dtype == arr.dtype.str and ref.shape == list(arr.shape)
    received = [b"header", *(bytes(f) for f in frames)]  # what recv_multipart hands back
    np.testing.assert_array_equal(unpack_tensor(ref, received), arr)
    assert pack_tensor(None, frames) is None and unpack_tensor(None, received) is None


@pytest.mark.parametrize("frame", [
    b"\x91" * 1000 + b"\xc0",  # arrays nested 1000 deep: msgspec's recursion limit
    b"\x83\xa4type\xa5abort\xa2id\xa1x\xb3hidden_state_layers" + b"\x91" * 1000 + b"\xc0",
])
def test_a_deeply_nested_frame_is_a_request_error_not_a_recursion_error(frame):
    """msgspec raises RecursionError (not DecodeError) past its nesting limit; escaping the
    gateway's read it ended the socket loop, and ZeroMQ answered nobody after one such frame."""
    from streaming.zmq_protocol import INVALID_REQUEST, RequestError, peek, read_request

    assert peek(frame) == ("", None)  # the envelope's untyped fields recurse into the nesting
    with pytest.raises(RequestError) as e:  # the typed decoder refuses the first wrong type instead
        read_request(frame, 1 << 20)
    assert e.value.code == INVALID_REQUEST and e.value.id == ""
