"""The model profile: read once from the model folder, shared by the server and the engine."""

from __future__ import annotations

import json

import msgspec
import pytest

from streaming.profile import (
    ORPHEUS_AUDIO_TOKEN_OFFSET,
    ORPHEUS_END_OF_SPEECH,
    ModelProfile,
    ProfileError,
    read_profile,
)


def _config(folder, vocab_size: int) -> None:
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size}))


def test_no_file_and_orpheus_vocabulary_is_orpheus_without_codec(tmp_path):
    _config(tmp_path, 156940)  # Orpheus-3B: audio tokens up to 128266 + 7 * 4096
    p = read_profile(tmp_path)
    assert p.family == "orpheus" and p.codec is None and p.speech.voices[0] == "tara" and not p.speaks


def test_no_file_and_plain_vocabulary_is_a_text_model(tmp_path):
    _config(tmp_path, 151936)  # a Qwen3 vocabulary: no room for Orpheus's audio tokens
    p = read_profile(tmp_path)
    assert (p.family, p.speech, p.codec, p.speaks) == ("text", None, None, False)


def test_a_codec_on_the_command_line_means_speech(tmp_path):
    _config(tmp_path, 1000)
    assert read_profile(tmp_path, codec_path="/snac").speaks


def test_missing_config_is_named(tmp_path):
    with pytest.raises(ProfileError, match="config.json"):
        read_profile(tmp_path)


def test_codec_path_from_the_command_line_gets_orpheus_layout(tmp_path):
    _config(tmp_path, 156940)
    p = read_profile(tmp_path, codec_path="/abs/snac")
    assert p.codec == {"path": "/abs/snac", "audio_token_offset": ORPHEUS_AUDIO_TOKEN_OFFSET, "codebook_size": 4096,
                       "end_token_id": ORPHEUS_END_OF_SPEECH}
    assert p.speech.sampling.stop_token_ids == [ORPHEUS_END_OF_SPEECH]


def test_relative_codec_path_resolves_inside_the_folder(tmp_path):
    (tmp_path / "snac").mkdir()
    (tmp_path / "omnistream.json").write_text(json.dumps({"codec": {"path": "snac", "codebook_size": 64}}))
    p = read_profile(tmp_path)
    assert p.codec["path"] == str(tmp_path / "snac") and p.codec["codebook_size"] == 64


def test_text_family_has_no_speech(tmp_path):
    (tmp_path / "omnistream.json").write_text(json.dumps({"family": "text"}))
    p = read_profile(tmp_path)
    assert (p.family, p.speech, p.codec, p.sample_rate) == ("text", None, None, 0)


@pytest.mark.parametrize("content,word", [({"family": "bark"}, "family"), ({"voicez": ["a"]}, "voicez"),
                                          ({"sample_rate": 0}, "sample_rate"), ("{", "omnistream.json")])
def test_bad_profile_names_file_and_field(tmp_path, content, word):
    (tmp_path / "omnistream.json").write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ProfileError) as e:
        read_profile(tmp_path)
    assert word in str(e.value) and "omnistream.json" in str(e.value)


def test_profile_round_trips_as_engine_argument(tmp_path):
    (tmp_path / "omnistream.json").write_text(json.dumps({"voices": ["a", "b"], "codec": {"path": "/c"}}))
    p = read_profile(tmp_path)
    assert msgspec.json.decode(msgspec.json.encode(p), type=ModelProfile) == p


def test_the_profile_and_the_codec_agree_on_the_frame_width():
    from runner.codecs.orpheus_tokens import FRAME_WIDTH
    from streaming.profile import ORPHEUS_TOKENS_PER_FRAME

    assert FRAME_WIDTH == ORPHEUS_TOKENS_PER_FRAME
