"""Text <-> token ids in the front end (as in vLLM: the engine sees token ids only)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tokenizers import Tokenizer

from server.qwen2_tokenizer import has_qwen2_files, qwen2_bpe

# Longer texts are tokenized off the event loop (encode_async); below it, inline is cheaper
# than the thread hop (~1 ms of tokenizing).
INLINE_ENCODE_CHARS = 4096


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, bos_token_id: int | None = None):
        self._tok = tokenizer
        self.bos_token_id = bos_token_id

    @classmethod
    def from_folder(cls, path: str | Path) -> "TextTokenizer":
        """Read `tokenizer.json` (else a Qwen2 BPE's vocab.json + merges.txt) and, when present,
        the BOS token from `tokenizer_config.json`."""
        folder = Path(path)
        if (folder / "tokenizer.json").is_file():
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        elif has_qwen2_files(folder):  # Qwen folders without tokenizer.json (Qwen3-TTS)
            tok = qwen2_bpe(folder)
        else:
            raise FileNotFoundError(f"{folder / 'tokenizer.json'}: missing (the front end tokenizes with the model "
                                    "folder's tokenizer.json, or a Qwen2 BPE's vocab.json + merges.txt)")
        bos_id: int | None = None
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            bos = cfg.get("bos_token")
            if isinstance(bos, dict):  # older configs wrap it as an AddedToken dict
                bos = bos.get("content")
            if isinstance(bos, str):
                bos_id = tok.token_to_id(bos)
                if bos_id is None:
                    raise ValueError(f"{cfg_path}: bos_token {bos!r} is not in tokenizer.json")
        return cls(tok, bos_id)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        # Special tokens are added explicitly (not by the tokenizer's post-processor) so a
        # prompt template controls exactly where BOS goes.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("add_bos requested but the tokenizer has no BOS token")
            return [self.bos_token_id, *ids]
        return ids

    async def encode_async(self, text: str, add_bos: bool = False) -> list[int]:
        """encode() that cannot stall the event loop: a text over INLINE_ENCODE_CHARS is
        tokenized in a worker thread through encode_batch, which releases the GIL (encode holds
        it, so even in a thread a 1 MB text stalled the loop ~0.7 s)."""
        if len(text) <= INLINE_ENCODE_CHARS:
            return self.encode(text, add_bos)
        if add_bos and self.bos_token_id is None:
            raise ValueError("add_bos requested but the tokenizer has no BOS token")
        ids = await asyncio.to_thread(lambda: self._tok.encode_batch([text], add_special_tokens=False)[0].ids)
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def settled(self, text: str) -> str:
        """The longest prefix of `text` (as the tokenizer normalizes it) whose ids no text
        appended after it can change: up to where its last pre-tokenized word starts. BPE never
        merges across words, and the pre-tokenizer's split of the text before its last word does
        not depend on what follows (Qwen2's regex: a word is a letter run with at most one
        leading non-letter, a number, a punctuation run, a whitespace run). So Chinese text
        settles at each punctuation mark and English at each space. A tokenizer without a
        pre-tokenizer settles at the last whitespace."""
        norm = self._tok.normalizer.normalize_str(text) if self._tok.normalizer is not None else text
        pre = self._tok.pre_tokenizer
        if pre is None:
            return norm[: max(0, *(norm.rfind(c) for c in " \t\n"))]
        words = pre.pre_tokenize_str(norm)
        return norm[: words[-1][1][0]] if words else ""

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Turns a growing token stream into text deltas.

    Decoding a token alone can be wrong (byte-level pieces of one UTF-8 character, or spacing
    that depends on the previous token), so each delta is the difference between decoding a
    short window with and without the new tokens, and a delta that ends in an incomplete
    character is held back until the next token completes it.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start (context for the next delta)
        self._read = 0  # tokens before this index have been emitted

    def push(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character comes out as U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix :], self._skip)
        if after.endswith("\ufffd") and not final:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]
