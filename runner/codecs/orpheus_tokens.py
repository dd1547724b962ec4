"""The Orpheus audio token layout: token ids <-> SNAC codes, and a frame's codes -> SNAC levels.

Orpheus writes one 24 kHz SNAC frame as 7 tokens. Token j of a frame (j = audio index mod 7)
carries one code of codebook slot j, as id `audio_token_offset + j * codebook_size + code`; the
end token (`end_token_id`) lies outside that range. Everything Orpheus-specific about the codec
lives here, so a model-family seam can own it; the rest of runner/codecs sees (n, 7) code frames.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

# Orpheus interleaving of one frame's 7 tokens into SNAC's 3 levels (strides 4, 2, 1):
# level 0 gets token 0, level 1 tokens 1 and 4, level 2 tokens 2, 3, 5, 6 (time order).
ORPHEUS_LEVELS: tuple[tuple[int, ...], ...] = ((0,), (1, 4), (2, 3, 5, 6))
# codes per frame: sum of the level sizes (7)
FRAME_WIDTH = sum(len(g) for g in ORPHEUS_LEVELS)


class TokenLayout(Protocol):
    """What the helpers read of the codec config (runner.codecs.config.CodecConfig has it)."""

    audio_token_offset: int
    codebook_size: int
    end_token_id: int
    tokens_per_frame: int


def audio_token_range(cfg: TokenLayout, audio_index: int) -> tuple[int, int]:
    """[lo, hi) of valid ids for the audio token at `audio_index` (0-based among audio tokens)."""
    lo = cfg.audio_token_offset + (audio_index % cfg.tokens_per_frame) * cfg.codebook_size
    return lo, lo + cfg.codebook_size


def invalid_token_reason(cfg: TokenLayout, token: int, audio_index: int) -> str:
    lo, hi = audio_token_range(cfg, audio_index)
    return (
        f"invalid audio token {token} at audio index {audio_index} "
        f"(expected range [{lo}, {hi}) or end token {cfg.end_token_id})"
    )


def tokens_to_codes(cfg: TokenLayout, token_ids: list[int]) -> np.ndarray:
    """Audio token ids (no end token) -> codes (n_frames, 7) int64 in Orpheus token order.

    A trailing incomplete frame is dropped. Raises ValueError on an out-of-range token.
    """
    toks = np.asarray(token_ids, dtype=np.int64)
    pos = np.arange(toks.size) % cfg.tokens_per_frame
    codes = toks - cfg.audio_token_offset - pos * cfg.codebook_size
    bad = np.flatnonzero((codes < 0) | (codes >= cfg.codebook_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(invalid_token_reason(cfg, int(toks[i]), i))
    n = toks.size // cfg.tokens_per_frame
    return codes[: n * cfg.tokens_per_frame].reshape(n, cfg.tokens_per_frame)


def codes_to_tokens(cfg: TokenLayout, codes: np.ndarray) -> list[int]:
    """Inverse of tokens_to_codes: (n_frames, 7) codes -> flat Orpheus token ids."""
    codes = np.asarray(codes, dtype=np.int64)
    if codes.ndim != 2 or codes.shape[1] != cfg.tokens_per_frame:
        raise ValueError(f"codes must have shape (n, {cfg.tokens_per_frame}), got {codes.shape}")
    if codes.size and (codes.min() < 0 or codes.max() >= cfg.codebook_size):
        raise ValueError(f"codes must lie in [0, {cfg.codebook_size})")
    offs = cfg.audio_token_offset + np.arange(cfg.tokens_per_frame) * cfg.codebook_size
    return (codes + offs).reshape(-1).tolist()


def frames_to_levels(codes: torch.Tensor) -> list[torch.Tensor]:
    """(B, W, 7) frame codes -> SNAC levels [(B, W), (B, 2W), (B, 4W)] (long)."""
    b, w, _ = codes.shape
    return [codes[:, :, list(idx)].reshape(b, w * len(idx)) for idx in ORPHEUS_LEVELS]
