"""Served tiny Qwen3-TTS folders: a golden talker checkpoint (tests/reference/qwen3_tts_golden.py)
with a tokenizer the server loads and a tiny 12 Hz codec as its speech_tokenizer/, laid out as a
released CustomVoice folder is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer
from tokenizers.models import BPE

from tests.support.tiny_qwen12hz import make_tiny_qwen12hz

# the golden talkers' text ids (tests/reference/qwen3_tts_golden.py): text vocab 200, chat
# tokens at 150/151/155/156; its random text ids lie below 140
IM_START, IM_END, ASSISTANT, NEWLINE = 150, 151, 155, 156
# ids 0..139, one a character: printable ASCII (0..94), then Latin-1 letters from U+00C0, so
# every golden text id is a character and a golden prompt can be spoken as text
PRINTABLE = [chr(c) for c in range(32, 127)] + [chr(c) for c in range(0xC0, 0xC0 + 45)]


def write_tiny_qwen_tokenizer(folder: Path) -> Tokenizer:
    """tokenizer.json of a character-level tokenizer over the golden ids: the chat tokens
    (`<|im_start|>`, `<|im_end|>`, `assistant`, `\\n`) are added tokens at the golden's ids,
    every PRINTABLE character one id below 140 (a BPE with no merges)."""
    vocab = {ch: i for i, ch in enumerate(PRINTABLE)}
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="?"))
    specials = {"<|im_start|>": IM_START, "<|im_end|>": IM_END, "assistant": ASSISTANT, "\n": NEWLINE}
    # added tokens take the next ids; the filler ids keep the golden's numbering
    filler = [AddedToken(f"<|filler_{i}|>", special=True) for i in range(len(PRINTABLE), max(specials.values()) + 1)]
    tok.add_special_tokens(filler)
    with_ids = json.loads(tok.to_str())
    for entry in with_ids["added_tokens"]:
        i = entry["id"]
        name = next((k for k, v in specials.items() if v == i), None)
        if name is not None:
            entry["content"] = name
    tok = Tokenizer.from_str(json.dumps(with_ids))
    tok.save(str(folder / "tokenizer.json"))
    return tok


def text_of_ids(ids: list[int]) -> str:
    """The text write_tiny_qwen_tokenizer's tokenizer reads as `ids` (each below 140)."""
    return "".join(PRINTABLE[i] for i in ids)


def make_served_qwen3_tts(path: Path, checkpoint: Path, max_frames: int = 40, greedy_groups: bool = False,
                          encoder: bool = False) -> Path:
    """A copy of the golden `checkpoint` at `path` with tokenizer.json, a tiny 12 Hz codec of its
    frames (4 codebooks of 32 codes) as speech_tokenizer/ and an omnistream.json capping
    utterances at max_frames (sampling as generation_config.json's, code-0 penalty included).
    greedy_groups: generation_config.json's subtalker_dosample false (groups 1..K-1 greedy, as
    the golden frames were drawn). encoder: the codec encodes uploads too (a Base folder)."""
    shutil.copytree(checkpoint, path)
    if greedy_groups:
        gen = json.loads((path / "generation_config.json").read_text())
        (path / "generation_config.json").write_text(json.dumps(gen | {"subtalker_dosample": False}))
    write_tiny_qwen_tokenizer(path)
    make_tiny_qwen12hz(path / "speech_tokenizer", seed=1, encoder=encoder, num_quantizers=4)
    (path / "omnistream.json").write_text(json.dumps({"family": "qwen3_tts", "sampling": {
        "temperature": 0.9, "top_k": 50, "repetition_penalty": 1.05, "max_tokens": max_frames}}))
    return path
