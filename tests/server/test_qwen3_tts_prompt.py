"""Qwen3-TTS's front end (docs/qwen3_tts.md Stage 4) on the golden tiny checkpoints of
tests/reference/qwen3_tts_golden.py: a folder naming Qwen3TTSForConditionalGeneration is the
qwen3_tts family with its speakers as voices, its speech_tokenizer/ as codec and
generation_config.json's code-0 sampling; the prompt rows (text ids, codec part, trailing text)
equal those generate() itself embedded, for every prompt kind; the served tokenizer's text
reaches them through the wrapper's assistant turn."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from server.errors import APIError
from server.tokenizer import TextTokenizer
from server.tts.qwen3_tts_prompt import (CloneRef, Qwen3TtsPrompts, StreamedText, assistant_turn, qwen3_tts_rows,
                                         split_turn)
from server.tts.voices import SpeechProfile
from streaming.profile import ProfileError, read_profile
from streaming.qwen3_tts_profile import qwen3_tts_sampling
from streaming.sampling_params import SamplingParams
from tests.support.tiny_qwen3_tts import ASSISTANT, IM_START, NEWLINE, write_tiny_qwen_tokenizer

# tests/reference/qwen3_tts_golden.py's cases(): language, speaker, text mode, instruct
CASES = {
    "speaker_streaming": ("english", "alice", False),
    "speaker_non_streaming": ("auto", "alice", True),
    "dialect_streaming": ("auto", "bob", False),  # bob's dialect replaces auto
    "instruct_no_speaker": ("chinese", None, True),
}
ROLE = [IM_START, ASSISTANT, NEWLINE]


@pytest.fixture(scope="module")
def golden(qwen3_tts_golden) -> Path:
    return qwen3_tts_golden("qwen3_tts_golden")


def text_of(case: dict[str, np.ndarray], non_streaming: bool) -> tuple[list[int], list[int]]:
    """(instruct ids, text ids) the golden case was generated from, read back off its rows."""
    ids, codec = case["text_ids"].tolist(), case["codec_ids"]
    role_at = next(i for i in range(len(ids)) if ids[i : i + 3] == ROLE)
    if not non_streaming:
        return ids[:role_at], [ids[-1], *case["trailing_ids"].tolist()[:-1]]
    tts_bos_at = role_at + 3 + int(np.argmax(np.asarray(ids[role_at + 3 :]) == 153))
    return ids[:role_at], ids[tts_bos_at + 1 : -2]  # ... text, tts_eos, tts_pad


@pytest.mark.parametrize("model", ["custom_voice", "ends"])
def test_rows_equal_the_references_prompts(golden, model):
    spec = read_profile(golden / model / "checkpoint").speech
    names = json.loads((golden / "manifest.json").read_text())["models"][model]
    assert set(names) == set(CASES)
    for name in names:
        case = dict(np.load(golden / model / f"{name}.npz"))
        language, speaker, non_streaming = CASES[name]
        instruct, text = text_of(case, non_streaming)
        rows = qwen3_tts_rows(spec.qwen3_tts, ROLE, text, speaker, language, instruct, non_streaming)
        assert rows.ids == case["text_ids"].tolist(), name
        np.testing.assert_array_equal(np.array(rows.frames), case["codec_ids"], err_msg=name)
        assert rows.step_text_ids == case["trailing_ids"].tolist(), name


def test_a_qwen3_tts_folder_is_detected_with_its_speakers_codec_and_sampling(golden):
    folder = golden / "custom_voice" / "checkpoint"
    p = read_profile(folder)
    assert p.family == "qwen3_tts" and p.speaks
    assert (p.speech.voices, p.speech.default_voice, p.sample_rate) == (("alice", "bob"), "alice", 24000)
    assert p.codec == {"path": str(folder / "speech_tokenizer")}
    assert read_profile(folder, "/elsewhere/codec").codec == {"path": "/elsewhere/codec"}
    ids = p.speech.qwen3_tts
    assert (ids.speakers, ids.speaker_dialects, ids.non_streaming) == ({"alice": 60, "bob": 61}, {"bob": "sichuan"}, True)
    # generation_config.json's code-0 keys, its repetition_penalty included (code 0's history)
    assert p.speech.sampling == SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05,
                                               max_tokens=1125)


def test_sampling_follows_generation_config(golden, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_k": 7, "temperature": 0.5,
                                                                 "repetition_penalty": 1.2}))
    assert qwen3_tts_sampling(tmp_path) == SamplingParams(temperature=0.0, top_k=7, top_p=1.0, repetition_penalty=1.2,
                                                          max_tokens=1125)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.5}))
    assert qwen3_tts_sampling(tmp_path).temperature == 0.5


# tests/reference/qwen3_tts_golden.py's Base cases: language, reference transcript length (0:
# the x-vector alone), text mode
BASE_CASES = {"xvector": ("english", 0, False), "icl_streaming": ("auto", 2, False),
              "icl_non_streaming": ("english", 2, True)}


def test_base_rows_equal_the_references_prompts(golden):
    """Cloned voices: the x-vector's row (no codec table, tts_pad) where the speaker goes and,
    in ICL mode, the clip's transcript and frames (ipc.PromptVector carries the vector)."""
    spec = read_profile(golden / "base" / "checkpoint").speech
    for name, (language, n_ref, non_streaming) in BASE_CASES.items():
        case = dict(np.load(golden / "base" / f"{name}.npz"))
        ids, codec, trailing = case["text_ids"].tolist(), case["codec_ids"], case["trailing_ids"].tolist()
        clip = codec[(codec >= 0).all(axis=1)].tolist()
        after = int(case["xvector_row"]) + 2  # the x-vector's row, then codec_pad over tts_bos
        if not n_ref:
            said = [ids[-1], *trailing[:-1]]
        elif non_streaming:
            said = ids[after : after + len(ids) - after - len(clip) - 2]  # ... tts_eos, then bos + clip rows
        else:
            said = [*ids[after : after + len(clip) + 1], *trailing[:-1]]
        ref_ids, text = said[:n_ref], said[n_ref:]
        clone = CloneRef(ref_ids, clip)
        assert clone.icl == bool(n_ref)
        rows = qwen3_tts_rows(spec.qwen3_tts, ROLE, text, None, language, (), non_streaming, clone=clone)
        assert rows.ids == ids, name
        np.testing.assert_array_equal(np.array(rows.frames), codec, err_msg=name)
        assert rows.step_text_ids == trailing and rows.vector_row == int(case["xvector_row"]), name


def test_a_base_folder_clones_uploaded_voices_only(golden):
    p = read_profile(golden / "base" / "checkpoint")
    assert p.family == "qwen3_tts" and p.speaks
    s = p.speech
    assert (s.voices, s.default_voice, s.clones_voices, s.takes_reference_audio) == ((), "", True, True)
    # the wrapper's generate_voice_clone: streaming text by default, no instruct
    assert (s.qwen3_tts.non_streaming, s.qwen3_tts.takes_instruct) == (False, False)
    profile = SpeechProfile(s)
    assert profile.task_type == "Base"
    calls = (lambda: profile.resolve_voice(None), lambda: profile.resolve_voice(""),
             lambda: profile.build_prompt(None, "", "hi"))  # a session's default voice is ""
    for call in calls:
        with pytest.raises(APIError, match=r"voice: this model speaks uploaded voices only: name one \(uploaded: "
                                           r"none yet") as e:
            call()
        assert e.value.param == "voice"


def test_bad_config_is_a_profile_error(golden, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(golden / "custom_voice" / "checkpoint", folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["talker_config"]["codec_pad_id"] = 5  # a code, not a special id
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match="codec_pad_id"):
        read_profile(folder)


def test_served_prompt_through_the_tokenizer(golden, tmp_path):
    """SpeechProfile.build_prompt: the assistant turn tokenized whole, role and text sliced off
    it, the non-streaming rows (CustomVoice's default) of the voice's speaker; unknown voices
    refused naming `voice`."""
    folder = tmp_path / "cv"
    shutil.copytree(golden / "custom_voice" / "checkpoint", folder)
    write_tiny_qwen_tokenizer(folder)
    tok = TextTokenizer.from_folder(folder)
    profile = SpeechProfile(read_profile(folder).speech)
    turn = tok.encode(assistant_turn("Hi."))
    assert split_turn(turn) == (ROLE, tok.encode("Hi."))
    got = profile.build_prompt(tok, "bob", "Hi.")
    want = qwen3_tts_rows(profile.spec.qwen3_tts, ROLE, tok.encode("Hi."), "bob", "auto", (), True)
    assert (got.ids, got.frames, got.step_text_ids) == (want.ids, want.frames, None)
    # role (3), think, think_bos, sichuan (bob's dialect for auto), think_eos, bob, codec_pad
    assert [f[0] for f in got.frames[3:9]] == [43, 45, 52, 46, 61, 40]
    assert profile.resolve_voice(None) == "alice"
    with pytest.raises(APIError) as e:
        profile.resolve_voice("carol")
    assert e.value.param == "voice" and "alice, bob" in str(e.value)


async def test_language_and_instructions_reach_the_rows(golden, tmp_path):
    """A language puts its codec id in the think prefix (a dialect speaker keeps its dialect
    only for chinese/auto), instructions become the leading user turn, as generate() lays out
    the golden instruct case; an unknown language is refused naming `language`; a 0.6B folder
    (tts_model_size "0b6", whose instruct the wrapper drops) takes no instructions."""
    folder = tmp_path / "cv"
    shutil.copytree(golden / "custom_voice" / "checkpoint", folder)
    write_tiny_qwen_tokenizer(folder)
    tok = TextTokenizer.from_folder(folder)
    profile = SpeechProfile(read_profile(folder).speech)
    assert profile.languages == ("chinese", "english", "sichuan") and profile.takes_instructions
    got = await profile.build_prompt_async(tok, "bob", "Hi.", "English", "Be calm.")
    instruct = tok.encode("<|im_start|>user\nBe calm.<|im_end|>\n")
    assert instruct[:2] == [IM_START, tok.encode("u")[0]] and len(instruct) == 16
    want = qwen3_tts_rows(profile.spec.qwen3_tts, ROLE, tok.encode("Hi."), "bob", "english", instruct, True)
    assert (got.ids, got.frames) == (want.ids, want.frames)
    assert got.ids[: len(instruct)] == instruct and [f[0] for f in got.frames[19:24]] == [43, 45, 50, 46, 61]
    with pytest.raises(APIError) as e:
        await profile.build_prompt_async(tok, "bob", "Hi.", "klingon")
    assert e.value.param == "language"
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | {"tts_model_size": "0b6"}))
    assert not SpeechProfile(read_profile(folder).speech).takes_instructions


async def test_voice_design_folder_speaks_without_a_speaker_row(golden, tmp_path):
    """A VoiceDesign folder (tts_model_type "voice_design", no spk_id) has one voice, "design";
    its prompt is the golden instruct_no_speaker layout: instruct turn, role, think prefix with
    the language, no speaker row, text."""
    folder = tmp_path / "vd"
    shutil.copytree(golden / "custom_voice" / "checkpoint", folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["tts_model_type"] = "voice_design"
    raw["talker_config"].update(spk_id={}, spk_is_dialect={})
    (folder / "config.json").write_text(json.dumps(raw))
    write_tiny_qwen_tokenizer(folder)
    tok = TextTokenizer.from_folder(folder)
    profile = SpeechProfile(read_profile(folder).speech)
    assert (profile.voices, profile.default_voice, profile.takes_instructions) == (("design",), "design", True)
    assert profile.task_type == "VoiceDesign"  # vllm-omni's session.config name for it
    got = await profile.build_prompt_async(tok, "design", "Hi.", "chinese", "A deep voice.")
    instruct = tok.encode("<|im_start|>user\nA deep voice.<|im_end|>\n")
    want = qwen3_tts_rows(profile.spec.qwen3_tts, ROLE, tok.encode("Hi."), None, "chinese", instruct, True)
    assert (got.ids, got.frames) == (want.ids, want.frames)
    n = len(instruct) + 3
    assert [f[0] for f in got.frames[n : n + 5]] == [43, 45, 51, 46, 40]  # think.. chinese .., then codec_pad


async def test_streamed_text_hands_out_final_ids_only(default_model_dir, tmp_path):
    """A byte-level BPE (the embedded default's, with Qwen's chat tokens added as special
    tokens, and 'assistant' one token as in Qwen's): fed a character at a time, every id handed out is the whole text's id at that
    index (ids never change once given), ids come before the text ends (at each space), and
    the ids of the whole text are handed out in the end."""
    from tokenizers import Tokenizer

    bpe = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    bpe.add_special_tokens(["<|im_start|>", "<|im_end|>", "assistant"])  # one id each, as in Qwen's vocabulary
    bpe.save(str(tmp_path / "tokenizer.json"))
    tok = TextTokenizer.from_folder(tmp_path)
    text = "Hello there, how are you doing today? I'm fine: 42 apples, thanks!"
    whole = split_turn(tok.encode(assistant_turn(text)))[1]
    stream = StreamedText(tok)
    got, early = [], 0
    for i, ch in enumerate(text):
        new = await stream.feed(ch, final=i == len(text) - 1)
        got += new
        assert got == whole[: len(got)], (i, ch)
        early = early or (len(got) if i < len(text) - 1 else 0)
    assert got == whole and early > 0
    assert await StreamedText(tok).feed("nospace", final=False) == []


async def test_streamed_chinese_text_settles_at_each_punctuation_mark(tmp_path):
    """A byte-level BPE with Qwen2's normalizer and pre-tokenizer (server/qwen2_tokenizer.py's),
    trained here on Chinese and English: a Chinese text without spaces, fed a character at a
    time, hands out ids at its punctuation marks (each before the text ends), every id the whole
    text's id at that index."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from server.qwen2_tokenizer import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    corpus = ["今天天气很好，我们去公园散步吧。", "你好，世界！这是一个测试。", "Hello there, how are you today?"]
    bpe.train_from_iterator(corpus * 20, trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|im_start|>", "<|im_end|>", "assistant"]))
    bpe.save(str(tmp_path / "tokenizer.json"))
    tok = TextTokenizer.from_folder(tmp_path)
    text = "你好，世界！今天天气很好，我们去公园散步吧。好的"
    whole = split_turn(tok.encode(assistant_turn(text)))[1]
    assert len(whole) < len(text.encode())  # merges happened: a word's ids depend on all of it
    stream, got, first_at = StreamedText(tok), [], []
    for i, ch in enumerate(text):
        new = await stream.feed(ch, final=i == len(text) - 1)
        if new and i < len(text) - 1:
            first_at.append(i)
        got += new
        assert got == whole[: len(got)], (i, ch)
    assert got == whole
    # settled at the marks: "你好" once "，" came, "，世界" once "！" came, ...
    assert first_at[:2] == [text.index("，"), text.index("！")]


def test_open_rows_hold_back_the_end_and_wait_for_enough_text(golden):
    """The open prompt is the streaming layout of the ids so far without its closing tts_eos;
    an ICL voice's rows pair text with its clip's frames, so they wait for enough ids."""
    spec = read_profile(golden / "custom_voice" / "checkpoint").speech
    prompts = Qwen3TtsPrompts(spec.qwen3_tts)
    whole = qwen3_tts_rows(spec.qwen3_tts, ROLE, [5, 6, 7], "alice", "english", (), False)
    open_ = prompts.build_open(ROLE, [5, 6, 7], "alice", "english")
    assert (open_.ids, open_.frames) == (whole.ids, whole.frames)
    assert open_.step_text_ids == [6, 7] and whole.step_text_ids == [6, 7, spec.qwen3_tts.tts_eos]
    assert prompts.build_open(ROLE, [], "alice") is None
    base = Qwen3TtsPrompts(read_profile(golden / "base" / "checkpoint").speech.qwen3_tts)
    clip = CloneRef([9, 9], [[1, 2, 3, 4]] * 5)  # bos + 5 frames: 6 codec rows, 2 transcript ids
    assert base.build_open(ROLE, [5, 6, 7], "v", clone=clip) is None  # 2 + 3 + eos = 6 rows: no trailing
    rows = base.build_open(ROLE, [5, 6, 7, 8], "v", clone=clip)  # 7 rows: eos trails, all 4 ids in the prompt
    assert rows is not None and rows.step_text_ids == [] and rows.vector_row is not None
    assert base.build_open(ROLE, [5, 6, 7, 8, 10], "v", clone=clip).step_text_ids == [10]
