"""server/tts/voice_store.py on its own: voices round-trip through the folder (codes, transcript
and a speaker vector), a store that needs speaker vectors skips voices without one (a folder a
CSM server wrote), and deleting removes every file of the voice."""

import numpy as np
import pytest

from server.tts.voice_store import ReferenceVoice, VoiceStore


def voice(name: str, xvec: bool) -> ReferenceVoice:
    rng = np.random.default_rng(len(name))
    return ReferenceVoice(name, "", "a transcript" if xvec else "said", rng.integers(0, 32, (5, 4)).astype(np.int16),
                          0.4, rng.standard_normal(8).astype(np.float32) if xvec else None)


def test_voices_round_trip_with_their_speaker_vector(tmp_path):
    store = VoiceStore(tmp_path, 4)
    store.add(voice("clone", True))
    store.add(voice("plain", False))
    again = VoiceStore(tmp_path, 4)
    for name in ("clone", "plain"):
        a, b = store.get(name), again.get(name)
        assert (a.name, a.speaker, a.transcript, a.duration_s) == (b.name, b.speaker, b.transcript, b.duration_s)
        np.testing.assert_array_equal(a.codes, b.codes)
        assert (a.speaker_embedding is None) == (b.speaker_embedding is None) == (name == "plain")
    np.testing.assert_array_equal(again.get("clone").speaker_embedding, store.get("clone").speaker_embedding)
    assert again.get("clone").info()["speaker_embedding"] is True
    # a clone model's store: the voice without a vector stays on disk, unloaded
    cloning = VoiceStore(tmp_path, 4, needs_embedding=True)
    assert [v.name for v in cloning.list()] == ["clone"] and (tmp_path / "plain.npy").exists()
    with pytest.raises(ValueError, match="need a speaker vector"):
        cloning.add(voice("other", False))
    assert cloning.delete("clone")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.json", "plain.npy"]
