"""The model-family seam: what the engine asks of a model family, and nothing more.

A family says how a step's sampled ids become audio: which ids a row may sample next (a logits
constraint), which id ends speech, and which codec stage turns codes into PCM. A step yields,
per row, a frame of `codes_per_frame` codes (Orpheus: 1 token per step; a multi-codebook talker
K). The engine calls these at construction and per request, never per step on the host.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import torch

from runner.config import EngineConfig
from runner.layers.base import AttentionBackend, OpsBackend
from runner.models.llama import build_random_model
from runner.models.loader import load_model
from streaming import ipc
from streaming.profile import ModelProfile
from streaming.sampling_params import InvalidRequest, SamplingParams


class LogitsConstraint(Protocol):
    """A model-declared rule on which ids may come next, as a per-row window of allowed ids.

    vocab_span: [lo, hi), contiguous ids holding every window; the runner computes only those
    logits for constrained rows. out_index: index among the request's outputs of the token
    being sampled ([R] int64, on the device), true even in async mode. gather_window gives the
    window's logits ([R, W], -inf on ids not allowed) from logits of ids [base, base + N);
    window_ids maps sampled window columns back to token ids. The sampler's filters and race
    then run over W columns instead of the vocabulary."""

    @property
    def vocab_span(self) -> tuple[int, int]: ...

    def gather_window(self, logits: torch.Tensor, out_index: torch.Tensor, base: int = 0) -> torch.Tensor: ...

    def window_ids(self, cols: torch.Tensor, out_index: torch.Tensor) -> torch.Tensor: ...


class StepText:
    """The text ids fed with a request's generated frames (Qwen3-TTS's trailing text,
    docs/qwen3_tts.md §1): output frame n is embedded with ids[n], then with `pad` once the
    ids run out. The host knows every row's frame index, even while that frame is on the
    device, so the id is packed on the host like any input.

    An open one (`closed` False: the request's text is still arriving, Engine.append_text)
    has no id past its last yet: `ready(n)` is False there, and the scheduler holds a row
    whose next input needs that id (its KV and slot stay) until more text or the end comes."""

    __slots__ = ("ids", "pad", "closed")
    PENDING = -1  # at(n) of an id not arrived yet: never computed (the row is held)

    def __init__(self, ids: tuple[int, ...] | list[int], pad: int, closed: bool = True):
        self.ids = list(ids)
        self.pad = pad
        self.closed = closed

    def at(self, n: int) -> int:
        if n < len(self.ids):
            return self.ids[n]
        return self.pad if self.closed else self.PENDING

    def ready(self, n: int) -> bool:
        return n < len(self.ids) or self.closed

    def extend(self, ids: list[int], final: bool) -> None:
        assert not self.closed, "text appended after its end"
        self.ids += ids
        self.closed = final


@dataclass(frozen=True)
class PromptVectors:
    """Vectors added to some prompt positions' input embeddings (Qwen3-TTS Base: the voice's
    x-vector over its speaker position). `key` hashes positions and values: it seeds the
    request's prefix-cache chain, so two prompts share cached blocks only with equal vectors."""

    positions: np.ndarray  # [n] int64, distinct, inside the prompt
    values: np.ndarray  # [n, hidden] float32
    key: int

    @staticmethod
    def of(positions: list[int], values: np.ndarray) -> PromptVectors:
        pos = np.asarray(positions, dtype=np.int64)
        vals = np.ascontiguousarray(values, dtype=np.float32)
        return PromptVectors(pos, vals, hash((pos.tobytes(), vals.tobytes())))


@dataclass(frozen=True)
class EncodedReference:
    """A reference clip encoded once at upload (ModelFamily.encode_reference): the codes a
    voice prompt carries, and for a family that conditions on one, the speaker vector."""

    codes: np.ndarray  # [frames, K] int
    speaker_embedding: np.ndarray | None = None  # [hidden] float32

    def reply(self, request_id: str) -> ipc.EncodedAudio:
        xvec = self.speaker_embedding
        return ipc.EncodedAudio(request_id, codes=self.codes.tolist(),
                                speaker_embedding=b"" if xvec is None else xvec.astype("<f4").tobytes())


@dataclass(frozen=True)
class Code0Rule:
    """Which code-0 ids a frame may draw (Qwen3-TTS, M:2044-2066): ids [0, num_codes) and
    `eos`, eos only from the request's frame `min_frames` on. Applied on the device from the
    rows' frame counters: no host sync, CUDA-graph safe.

    repetition_penalty: code 0 takes the request's `sampling.repetition_penalty` (transformers'
    RepetitionPenaltyLogitsProcessor) over the code-0 ids the request has generated (not its
    prompt's), before the window; the frame runner keeps that history per slot on the device."""

    vocab: int  # code 0's logits width (the talker's codec table: codes + special ids)
    num_codes: int
    eos: int
    min_frames: int
    repetition_penalty: bool = False


@dataclass(frozen=True)
class FrameLayout:
    """What the frame runner (runner/engine/frame_runner.py) needs to know of a multi-codebook
    family's rows and draws, declared once by the family.

    A position's input row is its K codes, then a text id where `text_column` (the family feeds
    a text id with every generated frame: FrameLog.step_text). The scheduler sees one id per
    generated position: `frame_id`, or `end_id` for the frame that ends the audio (the view's
    eos, so the stop rule is unchanged)."""

    num_codebooks: int  # K
    codebook_size: int  # codes of each group (the codec's); code 0 may have more logits (code0)
    frame_id: int
    end_id: int
    text_column: bool = False
    code0: Code0Rule | None = None  # None: code 0 draws from its logits as they are
    # groups 1..K-1 sample with these parameters unless the request gives its own; None: with
    # the request's (CSM: one set of parameters per frame)
    group_sampling: SamplingParams | None = None

    @property
    def row_width(self) -> int:
        return self.num_codebooks + int(self.text_column)

    @property
    def code0_penalty(self) -> bool:
        """Whether code 0 takes the request's repetition_penalty (SamplingParams.validate's flag)."""
        return self.code0 is not None and self.code0.repetition_penalty


@torch.no_grad()
def fill_random_(model: torch.nn.Module, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A multi-codebook model built empty, filled in place with N(0, 0.02) from a fixed seed
    (`--random-weights`: benchmarks and tests). Small values: a random deep stack stays finite
    in bf16."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for p in model.parameters():
        p.normal_(0.0, 0.02, generator=gen)
    return model


class CodecStageLike(Protocol):
    """What the engine calls on a family's codec stage (runner/codecs/stage.py is the SNAC one)."""

    sample_rate: int

    def can_open(self) -> bool:
        """Whether open() has room for one more request now (a stage with per-stream state
        holds a bounded number of them)."""
        ...
    def open(self, key: object, seed: int | None = None, prefix_frames: np.ndarray | None = None) -> None: ...
    def push_many(self, items: list[tuple[object, object]]) -> None:
        """(key, code) pairs: a token id (one code per step) or a frame of K codes."""
        ...
    def close(self, key: object) -> None: ...
    def abort(self, key: object) -> None: ...
    def step(self, wait: bool = False) -> dict: ...
    def __len__(self) -> int: ...
    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream its decodes run on (None on the CPU): the stall report names it."""
        ...


class ModelFamily(ABC):
    """One family of models, built from the folder's profile (streaming/profile.py)."""

    name: ClassVar[str]

    def __init__(self, profile: ModelProfile, model_path: str = ""):
        self.profile = profile
        self.model_path = model_path
        # codes a row yields per step: 1 (a token) for one-token-per-step families; a
        # multi-codebook family K (the engine then runs runner/engine/frame_runner.py)
        self.codes_per_frame = 1

    def load_model(self, cfg: EngineConfig, attn: AttentionBackend, ops: OpsBackend,
                   random_weights: bool = False) -> torch.nn.Module:
        """The model of cfg.model on the runner's device and dtype: from the folder's
        safetensors, or (benchmarks) random weights of its shape."""
        r = cfg.runner
        if random_weights:
            return build_random_model(cfg.model, r.torch_device, r.torch_dtype, attn=attn, ops=ops)
        return load_model(cfg.model, r.torch_device, r.torch_dtype, attn=attn, ops=ops)

    def code_limit(self, codec: CodecStageLike | None) -> int | None:
        """Multi-codebook families: codes at or above this are never sampled (the codec cannot
        decode them); None: no limit."""
        return None

    def encode_reference(self, codec: CodecStageLike, pcm: np.ndarray) -> EncodedReference:
        """A reference clip (int16 mono at the codec's rate) -> the codes a prompt carries
        ([frames, K]) and any speaker vector; InvalidRequest for a family that takes no
        reference audio."""
        raise InvalidRequest("audio", f"the {self.name} family takes no reference audio (voices are its built-in ones)")

    def prompt_vectors(self, prompt_len: int, vectors: list[ipc.PromptVector] | None) -> PromptVectors | None:
        """The vectors a prompt adds over some positions' embeddings; None when there are none.
        Refused (InvalidRequest naming `prompt_vectors`) by a family whose prompts take none."""
        if vectors:
            raise InvalidRequest("prompt_vectors", f"the {self.name} family takes no prompt vectors")
        return None

    def warm_up_args(self, prompt_token_ids: list[int]) -> dict:
        """add_request arguments a request of these prompt ids needs besides them (a family
        whose prompts are rows: their codec part), for the engine's start-up requests."""
        return {}

    def codec_prefix(self, rows: np.ndarray | None) -> np.ndarray | None:
        """Frames [n, K] the codec decodes into a request's stream before its own and never
        emits (a reference clip the audio continues), from the prompt's rows; None: none."""
        return None

    def prompt_frames(self, prompt_token_ids: list[int], frames: np.ndarray | None) -> np.ndarray | None:
        """The codes of every prompt position ([P, K] int64) for a multi-codebook family, from
        the frames of its audio positions; None for a family without frames (which refuses
        frames). Raises InvalidRequest naming `prompt_frames`."""
        if frames is not None:
            raise InvalidRequest("prompt_frames", f"the {self.name} family takes no audio frames in a prompt")
        return None

    def frame_layout(self) -> FrameLayout | None:
        """A multi-codebook family's rows and draws (codes_per_frame > 1); None for a family
        that yields one token per step."""
        return None

    def check_group_sampling(self, params: SamplingParams | None) -> SamplingParams | None:
        """A request's own parameters for codebooks 1..K-1 (FrameLayout.group_sampling), judged
        for this family; None keeps the family's. Refused (InvalidRequest naming
        `group_sampling`) by a family that samples every code with `sampling`."""
        if params is not None:
            raise InvalidRequest("group_sampling", f"the {self.name} family samples every code with `sampling`")
        return None

    def step_text(self, step_text_ids: list[int] | None, open: bool = False) -> StepText | None:
        """The text ids a request feeds with its generated frames (open: more will come);
        None for a family without them (which refuses any). Raises InvalidRequest naming
        `step_text_ids`."""
        if step_text_ids or open:
            raise InvalidRequest("step_text_ids", f"the {self.name} family takes no per-step text ids")
        return None

    @property
    def speaks(self) -> bool:
        """Whether requests may ask for audio (the profile's rule: a speech spec and a codec)."""
        return self.profile.speaks

    @abstractmethod
    def build_codec(self, device: torch.device, dtype: torch.dtype, tuning: str = "auto") -> CodecStageLike | None:
        """The codec stage of audio requests, or None when the folder names no codec. tuning:
        RunnerConfig.tuning, the codec kernels' tuning tables ("auto" | "none")."""

    @abstractmethod
    def logits_constraint(self, backend: str) -> LogitsConstraint | None:
        """The rule audio rows sample under (backend: 'torch' or 'triton'), or None."""

    @abstractmethod
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an audio request (added to its sampling's stop ids)."""
