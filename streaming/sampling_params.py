"""Per-request sampling parameters: one msgspec Struct that crosses the IPC boundary as is.

`validate(vocab_size)` names the offending field in every error, so a front end can hand the
message to the client unchanged.
"""

from __future__ import annotations

import msgspec


class InvalidRequest(ValueError):
    """A request field is invalid. `field` names it (dotted for nested fields)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    temperature: float = 1.0  # 0 => greedy
    top_k: int = 0  # 0 => disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics: over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI semantics: over output tokens only
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int, codes_per_frame: int = 1, code0_penalty: bool = False) -> None:
        """Bounds of every field; a multi-codebook model (codes_per_frame > 1) takes no token
        penalty, logit bias or min_tokens: its codes have no history, no per-id bias. Except
        code0_penalty (a family whose code 0 keeps a per-request history, Qwen3-TTS): then
        repetition_penalty applies to code 0 over its generated ids; frequency / presence
        penalties stay refused."""

        def bad(field: str, msg: str) -> InvalidRequest:
            return InvalidRequest(f"sampling.{field}", msg)

        if not (0.0 <= self.temperature <= 100.0):
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if self.max_tokens <= 0:
            raise bad("max_tokens", f"must be > 0, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise bad("seed", f"must be in [0, 2**63), got {self.seed}")
        for tok, val in self.logit_bias.items():
            if not (0 <= tok < vocab_size):
                raise bad("logit_bias", f"token id {tok} outside the vocabulary [0, {vocab_size})")
            if not (-100.0 <= val <= 100.0):
                raise bad("logit_bias", f"bias for token {tok} must be in [-100, 100], got {val}")
        for tok in self.stop_token_ids:
            if not (0 <= tok < vocab_size):
                raise bad("stop_token_ids", f"token id {tok} outside the vocabulary [0, {vocab_size})")
        if codes_per_frame > 1:
            if self.repetition_penalty != 1.0 and not code0_penalty:
                raise bad("repetition_penalty", "not supported by multi-codebook models (codes have no history)")
            for name in ("frequency_penalty", "presence_penalty"):
                if getattr(self, name) != 0.0:
                    why = ("code 0 takes repetition_penalty only" if code0_penalty else "codes have no history")
                    raise bad(name, f"not supported by multi-codebook models ({why})")
            if self.logit_bias:
                raise bad("logit_bias", "not supported by multi-codebook models (no per-id bias of codes)")
            if self.min_tokens:
                raise bad("min_tokens", "not supported by multi-codebook models")


def decode_sampling_params(raw: dict) -> SamplingParams:
    """Build SamplingParams from a JSON-ish dict; unknown fields and wrong types name the field."""
    try:
        return msgspec.convert(raw, SamplingParams, strict=False)
    except msgspec.ValidationError as e:
        # msgspec says e.g. "Object contains unknown field `foo`" or "Expected `float`, got `str` - at `$.top_p`"
        msg = str(e)
        field = "sampling"
        if "unknown field" in msg:
            field = "sampling." + msg.split("`")[1]
        elif "at `$." in msg:
            field = "sampling." + msg.rsplit("at `$.", 1)[1].rstrip("`").split("[")[0]
        raise InvalidRequest(field, msg) from None
