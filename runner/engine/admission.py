"""What a request may be, judged before it is queued (Engine.add_request): its prompt ids against
the vocabulary, the model's length and the KV cache, and its hidden-state layers. Each refusal is
an InvalidRequest naming the field; nothing here touches the engine's state."""

from __future__ import annotations

from streaming.sampling_params import InvalidRequest


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
