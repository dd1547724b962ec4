"""The public ZeroMQ API's messages, defined once for the gateway (server/routes/zmq_gateway.py)
and the Python clients (streaming/zmq_client.py). docs/zmq.md describes the same wire format
for other languages.

  client -> server: one frame, a msgpack map (ZmqRequest); `api_key` on every message when the
  server has a key
     {"type": "generate", "id": str, "prompt_token_ids": [int] | "prompt": str,
      "sampling": {...SamplingParams fields}, "hidden_state_layers": [int], "api_key": str}
     {"type": "speech", "id": str, "input": str, "voice": str, "sampling": {...},
      "stream_input": bool}            (true: more text follows as "append" messages; Qwen3-TTS)
     {"type": "append", "id": str, "input": str, "final": bool}   (the next piece of that text;
                                       final: the text is complete; the first may be final too)
     {"type": "abort", "id": str}
     {"type": "ping", "id": str}                      (answered by a pong: a liveness check)
  server -> client: multipart [header, *tensor frames]; the header is a msgpack map
     {"type": "step", "id", "token_ids": [int], "hidden": TensorRef | nil,
      "hidden_positions": [first, end], "audio": TensorRef | nil, "finished": bool,
      "finish_reason": str | nil, "usage": {...} (on the finished step)}       (StepReply)
     {"type": "error", "id", "code": one of ERROR_CODES, "message": str,
      "param": str | nil}                                                       (ErrorReply)
     {"type": "pong", "id"}                                                     (PongReply)
  TensorRef = [frame index, numpy dtype string, shape]; frames are raw little-endian bytes.

Defaults are left off the wire (omit_defaults), so a reader must treat a missing key as its
default; ErrorReply always carries all five keys.
"""

from __future__ import annotations

import msgspec
import numpy as np

from streaming.ipc import TensorRef
from streaming.schema import GenerateRequest, GenerationOptions, SchemaError, schema_error

# ErrorReply.code values
INVALID_REQUEST = "invalid_request"  # a field is wrong (param names it) or the frame is unreadable
UNAUTHORIZED = "unauthorized"  # the server has a key and `api_key` is missing or wrong
TOO_LARGE = "too_large"  # the frame is over the server's zmq_max_message_bytes
NO_SPEECH = "model_has_no_speech"  # a speech request to a model without a speech profile
OVERLOADED = "overloaded"
UNAVAILABLE = "unavailable"
INTERNAL_ERROR = "internal_error"  # a server bug handling this frame (logged); the gateway keeps serving
ERROR_CODES = (INVALID_REQUEST, UNAUTHORIZED, TOO_LARGE, NO_SPEECH, OVERLOADED, UNAVAILABLE, INTERNAL_ERROR)

REQUEST_TYPES = ("generate", "speech", "append", "abort", "ping")


class ZmqRequest(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """One request frame. `type` stays a plain string (not a msgspec tag) so that the gateway,
    not the decoder, answers an unknown type, with the request's id. The generation fields are
    streaming.schema's (strict types, unknown keys refused, as on HTTP and the WebSockets)."""

    type: str  # one of REQUEST_TYPES
    id: str  # the client's; the gateway namespaces it per connection
    api_key: str | None = None  # required on every message when the server has a key
    prompt_token_ids: list[int] | None = None  # generate: the prompt as tokens, or ...
    prompt: str | None = None  # ... as text, tokenized by the server
    input: str | None = None  # speech: the text to speak
    voice: str | None = None  # speech: one of the profile's voices; None = its default
    sampling: GenerationOptions | None = None  # SamplingParams fields (speech: over the voice defaults)
    hidden_state_layers: list[int] | None = None  # generate: output_hidden_states indexing
    stream_input: bool | None = None  # speech: `input` is the text's first piece, "append"s bring the rest
    final: bool | None = None  # append (and a stream_input speech): the text is complete

    def generate_request(self) -> GenerateRequest:
        """The generate fields, for streaming.schema.generate_job."""
        return GenerateRequest(self.prompt_token_ids, self.prompt, self.sampling, self.hidden_state_layers)


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
    # multi-codebook models (CSM): the codes of the new positions, [len(token_ids), K] int64
    frames: TensorRef | None = None


class ErrorReply(msgspec.Struct, tag_field="type", tag="error"):
    """The request did not run (or ended); param names the offending field."""

    id: str  # "" when the frame could not be read far enough to know it
    code: str  # INVALID_REQUEST | OVERLOADED | UNAVAILABLE
    message: str
    param: str | None = None


class PongReply(msgspec.Struct, tag_field="type", tag="pong"):
    """The answer to a ping (same id): the server is up and reading this connection."""

    id: str


class RequestError(Exception):
    """A frame the gateway cannot serve; becomes an ErrorReply. `id` is the request's when the
    frame could be read far enough to know it, else ""."""

    def __init__(self, code: str, message: str, param: str | None = None, id: str = ""):
        super().__init__(message)
        self.code, self.message, self.param, self.id = code, message, param, id

    def reply(self) -> ErrorReply:
        return ErrorReply(self.id, self.code, self.message, self.param)


Reply = StepReply | ErrorReply | PongReply

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(ZmqRequest)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: ZmqRequest | StepReply | ErrorReply) -> bytes:
    return _encoder.encode(msg)


def decode_request(frame: bytes) -> ZmqRequest:
    """Raises msgspec.DecodeError (not msgpack) or msgspec.ValidationError (wrong shape)."""
    return _request_decoder.decode(frame)


class Envelope(msgspec.Struct):
    """The keys the gateway reads before judging a frame: whose it is and whether it may run.
    Any types, so that a frame wrong elsewhere still yields these two."""

    id: object = ""
    api_key: object = None


_envelope_decoder = msgspec.msgpack.Decoder(Envelope)


def peek(frame: bytes) -> tuple[str, object]:
    """(id, api_key) of a frame that is a msgpack map: id "" unless it is a string, so even a
    frame refused as a whole gets its error under the id the client waits on."""
    try:
        env = _envelope_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):  # see read_request
        return "", None
    return (env.id if isinstance(env.id, str) else ""), env.api_key


def read_request(frame: bytes, max_bytes: int) -> ZmqRequest:
    """The request in a client's frame, or RequestError naming what is wrong: the size limit,
    an unreadable frame, or the field (the client's name, dotted when nested: sampling.top_p)
    with the wrong type, missing or unknown, in streaming.schema's words. The fields' values
    are judged later, by the gateway (streaming.schema again)."""
    if len(frame) > max_bytes:
        raise RequestError(TOO_LARGE, f"message of {len(frame)} bytes is over the limit of {max_bytes} bytes "
                           "(the server's zmq_max_message_bytes)", None, peek(frame)[0])
    try:
        return _request_decoder.decode(frame)
    except msgspec.ValidationError as e:  # a subclass of DecodeError: first
        raise from_schema(schema_error(e, ZmqRequest), peek(frame)[0]) from None
    except msgspec.DecodeError as e:  # not msgpack, or a string that is not UTF-8
        raise RequestError(INVALID_REQUEST, f"a request is one msgpack map with UTF-8 strings: {e}",
                           None, peek(frame)[0]) from None
    except RecursionError:  # msgspec's own nesting limit: a 1 KB frame of nested arrays reaches it
        raise RequestError(INVALID_REQUEST, "a request is one msgpack map; this frame is nested too deeply "
                           "to read", None, peek(frame)[0]) from None


def from_schema(e: SchemaError, rid: str) -> RequestError:
    """A schema refusal as this protocol's error (code invalid_request, param = the field)."""
    if e.field is None:
        return RequestError(INVALID_REQUEST, f"a request is one msgpack map with string keys: {e}", None, rid)
    return RequestError(INVALID_REQUEST, str(e), e.field, rid)


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
