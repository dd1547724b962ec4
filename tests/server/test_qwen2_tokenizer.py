"""A folder with a Qwen2 BPE's vocab.json + merges.txt and no tokenizer.json (the released
Qwen3-TTS folders) tokenizes as transformers' Qwen2Tokenizer does: the same ids for mixed text
(spaces, newlines, digits, contractions, CJK, NFC), the chat tokens of tokenizer_config.json at
their ids (past a gap in the numbering too, where transformers 5 renumbers), the same decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from server.qwen2_tokenizer import qwen2_bpe
from server.tokenizer import TextTokenizer

CORPUS = ["Hello there. How are you today? I'm fine, they'll say.", "The 12 Hz codec decodes 1920 samples.",
          "你好，世界！语音合成。", "line one\nline two\r\n\n  indented\tand tabbed", "café naïve déjà vu"] * 20
TEXTS = ["Hello there, how're you?", "<|im_start|>assistant\nSay 1234 things.<|im_end|>\n<|im_start|>assistant\n",
         "你好，世界", "cafe\u0301 (NFC composes it)", "  spaces   and\n\nnewlines\t", "emoji 🙂 unseen bytes",
         "x<|im_end|><|endoftext|>"]


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tok.model.save(str(folder))  # vocab.json, merges.txt
    n = tok.get_vocab_size()
    added = {n: "<|endoftext|>", n + 1: "<|im_start|>", n + 2: "<|im_end|>", n + 7: "<|tool|>"}  # a gap before the last
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "model_max_length": 1024, "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, c in added.items()}}))
    return folder


def test_ids_and_decode_equal_transformers_qwen2_tokenizer(qwen2_folder):
    from transformers import Qwen2Tokenizer

    ref = Qwen2Tokenizer.from_pretrained(str(qwen2_folder))
    ours = TextTokenizer.from_folder(qwen2_folder)
    assert not (qwen2_folder / "tokenizer.json").exists()
    assert ours.bos_token_id is None
    for text in TEXTS:
        want = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text) == want, text
        assert ours.decode(want, skip_special_tokens=False) == ref.decode(want, skip_special_tokens=False)
    vocab = json.loads((qwen2_folder / "vocab.json").read_text())
    assert ours.encode("<|im_start|><|tool|>") == [len(vocab) + 1, len(vocab) + 7]


def test_bad_merges_are_named(qwen2_folder, tmp_path):
    for name in ("vocab.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((qwen2_folder / name).read_text())
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b c\n")
    with pytest.raises(ValueError, match="merges.txt: a merge is two tokens"):
        qwen2_bpe(tmp_path)


def test_a_folder_without_any_tokenizer_names_both_forms(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json.*vocab.json \\+ merges.txt"):
        TextTokenizer.from_folder(tmp_path)
