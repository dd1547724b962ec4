"""The public ZeroMQ API's messages, defined once for the gateway (server/routes/zmq_gateway.py)
and the Python clients (streaming/zmq_client.py). docs/zmq.md describes the same wire format
for other languages.

  client -> server: one frame, a msgpack map (ZmqRequest)
     {"type": "generate", "id": str, "prompt_token_ids": [int] | "prompt": str,
      "sampling": {...SamplingParams fields}, "hidden_state_layers": [int]}
     {"type": "speech", "id": str, "input": str, "voice": str, "sampling": {...}}
     {"type": "abort", "id": str}
  server -> client: multipart [header, *tensor frames]; the header is a msgpack map
     {"type": "step", "id", "token_ids": [int], "hidden": TensorRef | nil,
      "hidden_positions": [first, end], "audio": TensorRef | nil, "finished": bool,
      "finish_reason": str | nil, "usage": {...} (on the finished step)}       (StepReply)
     {"type": "error", "id", "code": "invalid_request" | "overloaded" | "unavailable",
      "message": str, "param": str | nil}                                         (ErrorReply)
  TensorRef = [frame index, numpy dtype string, shape]; frames are raw little-endian bytes.

Defaults are left off the wire (omit_defaults), so a reader must treat a missing key as its
default; ErrorReply always carries all five keys.
"""

from __future__ import annotations

import msgspec
import numpy as np

from streaming.ipc import TensorRef

# ErrorReply.code values
INVALID_REQUEST = "invalid_request"
OVERLOADED = "overloaded"
UNAVAILABLE = "unavailable"

REQUEST_TYPES = ("generate", "speech", "abort")


class ZmqRequest(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """One request frame. `type` stays a plain string (not a msgspec tag) so that the gateway,
    not the decoder, answers an unknown type, with the request's id."""

    type: str  # one of REQUEST_TYPES
    id: str  # the client's; the gateway namespaces it per connection
    prompt_token_ids: list[int] | None = None  # generate: the prompt as tokens, or ...
    prompt: str | None = None  # ... as text, tokenized by the server
    input: str | None = None  # speech: the text to speak
    voice: str | None = None  # speech: one of the profile's voices; None = its default
    sampling: dict = {}  # SamplingParams fields (speech: overrides of the voice defaults)
    hidden_state_layers: list[int] = []  # generate: output_hidden_states indexing


class StepReply(msgspec.Struct, omit_defaults=True, tag_field="type", tag="step"):
    """What one engine step produced for a request; the last one has finished=True and usage."""

    id: str
    token_ids: list[int] = []  # tokens accepted since the previous reply
    hidden: TensorRef | None = None  # [n_positions, n_layers, hidden_size]
    hidden_positions: list[int] = []  # [first, end) of the hidden rows
    audio: TensorRef | None = None  # int16 PCM
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    usage: dict | None = None  # prompt_tokens, completion_tokens, cached_tokens (+ error)


class ErrorReply(msgspec.Struct, tag_field="type", tag="error"):
    """The request did not run (or ended); param names the offending field."""

    id: str  # "" when the frame could not be read far enough to know it
    code: str  # INVALID_REQUEST | OVERLOADED | UNAVAILABLE
    message: str
    param: str | None = None


Reply = StepReply | ErrorReply

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(ZmqRequest)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: ZmqRequest | StepReply | ErrorReply) -> bytes:
    return _encoder.encode(msg)


def decode_request(frame: bytes) -> ZmqRequest:
    """Raises msgspec.DecodeError (not msgpack) or msgspec.ValidationError (wrong shape)."""
    return _request_decoder.decode(frame)


def decode_reply(frame: bytes) -> StepReply | ErrorReply:
    """Raises msgspec.DecodeError or msgspec.ValidationError (e.g. an unknown reply type)."""
    return _reply_decoder.decode(frame)


def pack_tensor(arr: np.ndarray | None, frames: list) -> TensorRef | None:
    """Append arr's bytes to frames, the tensor frames that follow the header (so the one
    appended k-th is multipart frame k), and return the reference to them. Zero-copy when
    C-contiguous and not empty (memoryview cannot cast a view with a zero in its shape)."""
    if arr is None:
        return None
    frames.append(memoryview(arr).cast("B") if arr.flags.c_contiguous and arr.size else arr.tobytes())
    return TensorRef(len(frames), arr.dtype.str, list(arr.shape))


def unpack_tensor(ref: TensorRef | None, frames: list) -> np.ndarray | None:
    """The array a TensorRef points at, a read-only view of its frame (no copy)."""
    if ref is None:
        return None
    return np.frombuffer(frames[ref.frame], dtype=np.dtype(ref.dtype)).reshape(ref.shape)
