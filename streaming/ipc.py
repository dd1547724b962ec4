"""IPC messages between front ends and the engine process: one msgspec Struct per message,
one encode path and one decode path. Never pickle.

Wire format (ZeroMQ multipart): frame 0 is the msgpack-encoded message; numpy arrays travel as
raw little-endian frames 1..n that the message points at with `TensorRef` (zero-copy on both
ends: numpy buffers are sent as they are and read back with `np.frombuffer`). The array <->
TensorRef conversion is msgspec's enc_hook / dec_hook, so a Struct with `np.ndarray` fields
(RequestOutput) is itself the wire record: no second, hand-copied message type.
"""

from __future__ import annotations

import threading
from typing import Union

import msgspec
import numpy as np

from streaming.sampling_params import SamplingParams


class TensorRef(msgspec.Struct, array_like=True):
    frame: int  # index into the multipart frames (>= 1)
    dtype: str  # numpy dtype string, e.g. "<f4", "<i2", "<u2" (bf16 travels as raw uint16)
    shape: list[int]


# ---- front end -> engine -------------------------------------------------------------------


class PromptVector(msgspec.Struct, forbid_unknown_fields=True):
    """A vector added to one prompt position's input embedding (Qwen3-TTS Base: a voice's
    x-vector over its speaker position): `values` the hidden size's float32s, little-endian."""

    position: int
    values: bytes


class AddRequest(msgspec.Struct, tag="add", forbid_unknown_fields=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # Hidden states of every computed position at these layers (HF indexing; see Request).
    hidden_state_layers: list[int] = []
    audio: bool = False  # route sampled tokens through the codec stage and return PCM
    # Multi-codebook models: the codes of the prompt's audio positions (a voice's reference
    # clip), one row of K codes per audio position, in order.
    prompt_frames: list[list[int]] | None = None
    # Families that feed a text id with every generated frame (Qwen3-TTS's trailing text):
    # those ids, one a frame, in order (then the family's pad id).
    step_text_ids: list[int] | None = None
    # Families that sample codebooks 1..K-1 apart (Qwen3-TTS's subtalker): their parameters;
    # None: the family's defaults.
    group_sampling: SamplingParams | None = None
    # Families whose prompts take vectors beside ids and codes (ModelFamily.prompt_vectors)
    prompt_vectors: list[PromptVector] | None = None
    # step_text_ids is only the start: AppendText messages bring the rest (the text streams in)
    step_text_open: bool = False


class AppendText(msgspec.Struct, tag="append", forbid_unknown_fields=True):
    """More step text ids of a request added with step_text_open; final: its text is complete."""

    request_id: str
    step_text_ids: list[int]
    final: bool = False


class EncodeAudio(msgspec.Struct, tag="encode", forbid_unknown_fields=True):
    """A reference clip to encode into the codec's codes once (a voice upload): s16le mono PCM
    at the codec's sample rate (Ready.sample_rate)."""

    request_id: str
    pcm: bytes


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class GetStats(msgspec.Struct, tag="stats"):
    pass


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineInbound = Union[AddRequest, AppendText, EncodeAudio, AbortRequests, GetStats, Shutdown]


# ---- engine -> front end -------------------------------------------------------------------


# finish_reason of a request the engine had no room for (its codec's streams all in use): the
# front end answers it as overloaded (503 / the protocol's overloaded error), not as a bad field
FINISH_OVERLOADED = "overloaded"


class RequestOutput(msgspec.Struct, omit_defaults=True):
    """One request's news from one engine step: what Engine.step() returns, what crosses the
    process boundary (inside StepOutputs) and what the front end reads."""

    request_id: str
    new_token_ids: list[int] = []
    # Multi-codebook models: the frames of the new positions, [len(new_token_ids), K] int64 codes
    frames: np.ndarray | None = None
    hidden: np.ndarray | None = None  # [n_new_positions, n_layers, hidden]; bf16 as raw uint16
    hidden_positions: tuple[int, int] = (0, 0)  # [first, last+1) positions of the hidden rows
    audio: np.ndarray | None = None  # int16 PCM samples of this step
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None  # "field: message" for rejected requests
    error_field: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class StepOutputs(msgspec.Struct, tag="step"):
    outputs: list[RequestOutput]


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
    # Codec streams open in the codec stage (each holds a decode slot until its request's audio
    # is emitted or aborted): 0 when idle, like a full free-block count.
    num_codec_streams: int = 0
    # Requests refused for lack of room (the codec's streams all in use: FINISH_OVERLOADED)
    num_refused_total: int = 0


class Ready(msgspec.Struct, tag="ready"):
    model: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_model_len: int
    max_num_seqs: int
    sample_rate: int = 0  # 0 when no codec stage is loaded
    dtype: str = ""
    codes_per_frame: int = 1  # codes a step yields per request (a multi-codebook model: K)
    code0_penalty: bool = False  # a multi-codebook model whose code 0 takes repetition_penalty (Qwen3-TTS)


class EncodedAudio(msgspec.Struct, tag="encoded"):
    """The answer to EncodeAudio: codes [frames][codebooks], or why the clip cannot be encoded."""

    request_id: str
    codes: list[list[int]] = []
    # families whose voices also carry a speaker vector (Qwen3-TTS Base's x-vector): float32 LE
    speaker_embedding: bytes = b""
    error: str | None = None


class EngineDead(msgspec.Struct, tag="dead"):
    reason: str


EngineOutbound = Union[StepOutputs, EngineStats, Ready, EncodedAudio, EngineDead]


# ---- one encode / decode path ---------------------------------------------------------------

# The multipart frames of the message being encoded or decoded on this thread: the hooks below
# append arrays to them (encode) or view arrays in them (decode). Set only around one call.
_frames = threading.local()


def _array_to_ref(obj: object) -> TensorRef:
    if not isinstance(obj, np.ndarray):
        raise NotImplementedError(f"cannot encode {type(obj).__name__} in an IPC message")
    arr = np.ascontiguousarray(obj)
    frames: list = _frames.current
    frames.append(memoryview(arr).cast("B"))
    return TensorRef(frame=len(frames) - 1, dtype=arr.dtype.str, shape=list(arr.shape))


def _ref_to_array(tp: type, obj: object) -> np.ndarray:
    if tp is not np.ndarray:
        raise NotImplementedError(f"cannot decode {tp} from an IPC message")
    ref = TensorRef(*obj)  # array_like: decoded as [frame, dtype, shape]
    return np.frombuffer(_frames.current[ref.frame], dtype=np.dtype(ref.dtype)).reshape(ref.shape)


_enc = msgspec.msgpack.Encoder()
_array_enc = msgspec.msgpack.Encoder(enc_hook=_array_to_ref)
_in_dec = msgspec.msgpack.Decoder(EngineInbound)
_out_dec = msgspec.msgpack.Decoder(EngineOutbound, dec_hook=_ref_to_array)


def encode_inbound(msg: EngineInbound) -> bytes:
    return _enc.encode(msg)


def decode_inbound(buf: bytes | memoryview) -> EngineInbound:
    return _in_dec.decode(buf)


def encode_outputs(outputs: list[RequestOutput]) -> list:
    """-> multipart frames: [header, array frames...]"""
    frames: list = [b""]
    _frames.current = frames
    try:
        frames[0] = _array_enc.encode(StepOutputs(outputs))
    finally:
        _frames.current = None
    return frames


def encode_outbound(msg: EngineOutbound) -> list:
    return [_enc.encode(msg)]


def decode_outbound(frames: list) -> EngineOutbound | list[RequestOutput]:
    """Decode a multipart message from the engine. Step outputs come back as RequestOutputs
    whose arrays are read-only views on the received frames."""
    _frames.current = frames
    try:
        msg = _out_dec.decode(frames[0])
    finally:
        _frames.current = None
    return msg.outputs if isinstance(msg, StepOutputs) else msg
