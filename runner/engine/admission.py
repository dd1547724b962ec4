"""What a request may be, judged before it is queued (Engine.add_request): its prompt ids against
the vocabulary, the model's length and the KV cache, its hidden-state layers, and the parts its
model family judges (frames, step text, group sampling, prompt vectors). Each refusal is an
InvalidRequest naming the field; nothing here touches the engine's state."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runner.engine.request import FrameLog
from runner.families.base import ModelFamily, PromptVectors, StepText
from streaming import ipc
from streaming.sampling_params import InvalidRequest, SamplingParams


def check_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int, kv_tokens: int) -> None:
    """A non-empty prompt of ids in [0, vocab_size) that leaves room for one new token under
    max_model_len and in the KV cache's kv_tokens slots."""
    if not prompt_token_ids:
        raise InvalidRequest("prompt_token_ids", "must not be empty")
    for i, t in enumerate(prompt_token_ids):
        if not isinstance(t, int) or not (0 <= t < vocab_size):
            raise InvalidRequest("prompt_token_ids", f"token {t!r} at index {i} is outside the vocabulary [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequest(
            "prompt_token_ids", f"prompt of {len(prompt_token_ids)} tokens leaves no room under max_model_len={max_model_len}"
        )
    if len(prompt_token_ids) + 1 > kv_tokens:
        raise InvalidRequest("prompt_token_ids", "prompt does not fit in the KV cache")


def check_layers(layers: tuple[int, ...], num_layers: int) -> None:
    """Hidden-state layers in HF indexing over the L + 1 states, negative ones from the end."""
    for layer in layers:
        if not (-(num_layers + 1) <= layer <= num_layers):
            raise InvalidRequest("hidden_state_layers", f"layer {layer} out of range [-{num_layers + 1}, {num_layers}]")


@dataclass(frozen=True)
class FamilyParts:
    """A request's parts besides its ids and sampling, as its family judged them (None where
    the family has none)."""

    frames: FrameLog | None  # every position's row (a multi-codebook family)
    group_sampling: SamplingParams | None  # groups 1..K-1's own parameters (None: the family's)
    vectors: PromptVectors | None  # vectors over prompt positions (Qwen3-TTS Base's x-vector)
    open_text: StepText | None  # its step text while more is to come (Engine.append_text)
    codec_prefix: np.ndarray | None  # frames priming its codec stream (an audio request's)


def family_parts(family: ModelFamily, num_codebooks: int | None, prompt_token_ids: list[int],
                 prompt_frames: list[list[int]] | np.ndarray | None, step_text_ids: list[int] | None,
                 step_text_open: bool, group_sampling: SamplingParams | None,
                 prompt_vectors: list[ipc.PromptVector] | None, audio: bool) -> FamilyParts:
    """Each part judged by `family` (a family without it refuses it naming the field);
    num_codebooks: K of a multi-codebook family's rows, None for one without frames."""
    step_text = family.step_text(None if step_text_ids is None else list(step_text_ids), step_text_open)
    group_sampling = family.check_group_sampling(group_sampling)
    # a family without frames checks that none came and returns None
    rows = family.prompt_frames(prompt_token_ids, None if prompt_frames is None else np.asarray(prompt_frames))
    return FamilyParts(
        frames=FrameLog(rows, num_codebooks, step_text) if num_codebooks is not None else None,
        group_sampling=group_sampling,
        vectors=family.prompt_vectors(len(prompt_token_ids), prompt_vectors),
        open_text=step_text if step_text_open else None,
        codec_prefix=family.codec_prefix(rows) if audio else None,
    )
