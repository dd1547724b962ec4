"""A Qwen2 byte-level BPE built from a folder's vocab.json + merges.txt + tokenizer_config.json,
for model folders that ship no tokenizer.json (the released Qwen3-TTS folders). The same
tokenizer transformers' Qwen2Tokenizer builds (its normalizer, pre-tokenizer regex, byte-level
decoder), with the added tokens of tokenizer_config.json's `added_tokens_decoder` at their ids
(the chat tokens <|im_start|>/<|im_end|> are not in vocab.json; a gap in their numbering is
held by placeholders, where transformers 5 would renumber the tokens past it)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

# transformers' Qwen2 PRETOKENIZE_REGEX (models/qwen2/tokenization_qwen2.py)
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                     r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
FILES = ("vocab.json", "merges.txt")
_ADDED_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def has_qwen2_files(folder: Path) -> bool:
    return all((folder / f).is_file() for f in FILES)


def qwen2_bpe(folder: str | Path) -> Tokenizer:
    """The folder's Qwen2 BPE; ValueError naming the file when one is unusable."""
    folder = Path(folder)
    try:
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{folder / 'vocab.json'}: not JSON ({e})") from None
    lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    # a "#version" header line, then one "a b" merge a line
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise ValueError(f"{folder / 'merges.txt'}: a merge is two tokens a line, got {' '.join(bad)!r}")
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    added = _added_tokens(folder)
    if not added:
        return tok
    # tokenizers numbers added tokens after the vocabulary in order, whatever id they are
    # given: a gap in the config's ids is filled with unused placeholders so every token lands
    # on its id (the ids the model was trained with), then checked
    filled, next_id = [], tok.get_vocab_size()
    for entry in added:
        if entry["id"] >= next_id:
            filled += [_placeholder(i) for i in range(next_id, entry["id"])]
            next_id = entry["id"] + 1
        filled.append(entry)
    raw = json.loads(tok.to_str())
    raw["added_tokens"] = filled
    tok = Tokenizer.from_str(json.dumps(raw))
    for entry in added:
        if tok.token_to_id(entry["content"]) != entry["id"]:
            raise ValueError(f"{folder / 'tokenizer_config.json'}: added token {entry['content']!r} should have id "
                             f"{entry['id']}, got {tok.token_to_id(entry['content'])}")
    return tok


def _placeholder(i: int) -> dict:
    return {"id": i, "content": f"<|omnistream_unused_{i}|>", "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def _added_tokens(folder: Path) -> list[dict]:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return []
    try:
        decoder = json.loads(path.read_text(encoding="utf-8")).get("added_tokens_decoder") or {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    out = []
    for key, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"{path}: added_tokens_decoder[{key!r}] has no content")
        # transformers' defaults for a flag the entry omits
        flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        flags.update({k: bool(entry[k]) for k in _ADDED_FLAGS if k in entry})
        out.append({"id": int(key), "content": entry["content"], **flags})
    return out
