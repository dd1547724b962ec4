"""IPC messages between front ends and the engine process: one msgspec Struct per message,
one encode path and one decode path. Never pickle.

Wire format (ZeroMQ multipart): frame 0 is the msgpack-encoded message; tensors travel as
raw little-endian frames 1..n that the message points at with `TensorRef` (zero-copy on both
ends: numpy buffers are sent as they are and read back with `np.frombuffer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import msgspec
import numpy as np

from streaming.sampling_params import SamplingParams


class TensorRef(msgspec.Struct, array_like=True):
    frame: int  # index into the multipart frames (>= 1)
    dtype: str  # numpy dtype string, e.g. "<f4", "<i2", "<u2" (bf16 travels as raw uint16)
    shape: list[int]


# ---- front end -> engine -------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", forbid_unknown_fields=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # Hidden states of every computed position at these layers (HF indexing; see Request).
    hidden_state_layers: list[int] = []
    audio: bool = False  # route sampled tokens through the codec stage and return PCM
    # Front-end identity the engine replies to (the ROUTER identity of the sending socket).
    client: bytes = b""


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]
    client: bytes = b""


class GetStats(msgspec.Struct, tag="stats"):
    client: bytes = b""


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineInbound = Union[AddRequest, AbortRequests, GetStats, Shutdown]


# ---- engine -> front end -------------------------------------------------------------------


class OutputMsg(msgspec.Struct, omit_defaults=True):
    request_id: str
    new_token_ids: list[int] = []
    hidden: TensorRef | None = None  # [n_new_positions, n_layers, hidden] in model dtype
    hidden_positions: list[int] = []  # [first, last+1) positions the hidden rows belong to
    audio: TensorRef | None = None  # int16 PCM samples of this step
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None  # "field: message" for rejected requests
    error_field: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class StepOutputs(msgspec.Struct, tag="step"):
    outputs: list[OutputMsg]


class EngineStats(msgspec.Struct, tag="stats"):
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_requests_total: int
    num_aborted_total: int
    num_preemptions_total: int
    num_prefix_cache_hit_tokens: int
    num_generated_tokens_total: int
    step_count: int
    active_request_ids: list[str] = []


class Ready(msgspec.Struct, tag="ready"):
    model: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_model_len: int
    max_num_seqs: int
    sample_rate: int = 0  # 0 when no codec stage is loaded
    dtype: str = ""


class EngineDead(msgspec.Struct, tag="dead"):
    reason: str


EngineOutbound = Union[StepOutputs, EngineStats, Ready, EngineDead]


# ---- in-memory output (what Engine.step() returns and the client reconstructs) --------------


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    hidden: np.ndarray | None = None  # [n, n_layers, hidden]
    hidden_positions: tuple[int, int] = (0, 0)
    audio: np.ndarray | None = None  # int16 [n_samples]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_field: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


# ---- one encode / decode path ---------------------------------------------------------------

_enc = msgspec.msgpack.Encoder()
_in_dec = msgspec.msgpack.Decoder(EngineInbound)
_out_dec = msgspec.msgpack.Decoder(EngineOutbound)


def _ref(arr: np.ndarray | None, frames: list) -> TensorRef | None:
    if arr is None:
        return None
    arr = np.ascontiguousarray(arr)
    frames.append(memoryview(arr).cast("B"))
    return TensorRef(frame=len(frames) - 1, dtype=arr.dtype.str, shape=list(arr.shape))


def _view(ref: TensorRef | None, frames: list) -> np.ndarray | None:
    if ref is None:
        return None
    return np.frombuffer(frames[ref.frame], dtype=np.dtype(ref.dtype)).reshape(ref.shape)


def encode_inbound(msg: EngineInbound) -> bytes:
    return _enc.encode(msg)


def decode_inbound(buf: bytes | memoryview) -> EngineInbound:
    return _in_dec.decode(buf)


def encode_outputs(outputs: list[RequestOutput]) -> list:
    """-> multipart frames: [header, tensor frames...]"""
    frames: list = [b""]
    msgs = [
        OutputMsg(
            request_id=o.request_id,
            new_token_ids=o.new_token_ids,
            hidden=_ref(o.hidden, frames),
            hidden_positions=list(o.hidden_positions) if o.hidden is not None else [],
            audio=_ref(o.audio, frames),
            finished=o.finished,
            finish_reason=o.finish_reason,
            error=o.error,
            error_field=o.error_field,
            num_prompt_tokens=o.num_prompt_tokens,
            num_output_tokens=o.num_output_tokens,
            num_cached_tokens=o.num_cached_tokens,
        )
        for o in outputs
    ]
    frames[0] = _enc.encode(StepOutputs(msgs))
    return frames


def encode_outbound(msg: EngineOutbound) -> list:
    return [_enc.encode(msg)]


def decode_outbound(frames: list) -> EngineOutbound | list[RequestOutput]:
    """Decode a multipart message from the engine. Step outputs come back as RequestOutputs
    whose arrays are read-only views on the received frames."""
    msg = _out_dec.decode(frames[0])
    if not isinstance(msg, StepOutputs):
        return msg
    return [
        RequestOutput(
            request_id=m.request_id,
            new_token_ids=m.new_token_ids,
            hidden=_view(m.hidden, frames),
            hidden_positions=tuple(m.hidden_positions) if m.hidden_positions else (0, 0),
            audio=_view(m.audio, frames),
            finished=m.finished,
            finish_reason=m.finish_reason,
            error=m.error,
            error_field=m.error_field,
            num_prompt_tokens=m.num_prompt_tokens,
            num_output_tokens=m.num_output_tokens,
            num_cached_tokens=m.num_cached_tokens,
        )
        for m in msg.outputs
    ]
