"""Uploaded reference voices: a clip's codec codes, its transcript and (Qwen3-TTS Base) its
speaker vector, kept in a folder the operator names (`--voices-dir`), loaded at start-up,
bounded in count.

A voice is encoded once, at upload, by the engine's codec (ipc.EncodeAudio); a request in that
voice carries the stored codes as its prompt frames, so nothing re-encodes audio per request,
and every request in the voice shares the same prompt prefix (the prefix cache serves it).

On disk, per voice: `<name>.json` ({"name", "speaker", "transcript", "frames", "duration_s",
"speaker_embedding"}), `<name>.npy` (the codes, [frames, K] int16) and, where the model gave one,
`<name>.spk.npy` (the speaker vector, float32). A file that does not parse is skipped with a log
line, not a start-up failure (an operator's folder may hold other files); so is a voice without
a speaker vector in a store that needs one (a folder written by a CSM server).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")  # also a safe file name (no dots: suffixes)


class VoiceStoreError(ValueError):
    """A voice cannot be added: the message names the field (`field`)."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.status = status


@dataclass(frozen=True)
class ReferenceVoice:
    name: str
    speaker: str  # the model's speaker id the clip and the requests are voiced as
    transcript: str
    codes: np.ndarray  # [frames, K] int16
    duration_s: float  # of the uploaded clip
    speaker_embedding: np.ndarray | None = None  # [hidden] float32 (Qwen3-TTS Base's x-vector)

    @property
    def num_frames(self) -> int:
        return int(self.codes.shape[0])

    def info(self) -> dict:
        return {"voice_id": self.name, "name": self.name, "type": "reference", "speaker": self.speaker,
                "transcript": self.transcript, "frames": self.num_frames, "duration_s": round(self.duration_s, 3),
                "speaker_embedding": self.speaker_embedding is not None}


class VoiceStore:
    def __init__(self, folder: str | Path | None, max_voices: int, reserved: tuple[str, ...] = (),
                 needs_embedding: bool = False):
        """folder None: no uploads (list() is empty, add() refuses naming --voices-dir).
        reserved: the model's built-in voice names, which no stored voice may take.
        needs_embedding: every voice carries a speaker vector (the model conditions on one)."""
        self.folder = Path(folder) if folder is not None else None
        self.max_voices = max_voices
        self.reserved = tuple(reserved)
        self.needs_embedding = needs_embedding
        self._voices: dict[str, ReferenceVoice] = {}
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._load()

    def _load(self) -> None:
        for meta_path in sorted(self.folder.glob("*.json")):
            try:
                meta = json.loads(meta_path.read_text())
                codes = np.load(meta_path.with_suffix(".npy"), allow_pickle=False)
                xvec = (np.load(meta_path.with_suffix(".spk.npy"), allow_pickle=False).astype(np.float32)
                        if meta.get("speaker_embedding") else None)
                voice = ReferenceVoice(meta["name"], meta["speaker"], meta["transcript"], codes.astype(np.int16),
                                       float(meta["duration_s"]), xvec)
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("voices: skipping %s (%s)", meta_path, e)
                continue
            if self.needs_embedding and (xvec is None or xvec.ndim != 1):
                log.warning("voices: skipping %s (no speaker vector: uploaded to a model that does not clone voices)",
                            meta_path)
                continue
            if voice.name != meta_path.stem or codes.ndim != 2:
                log.warning("voices: skipping %s (name or codes shape does not match)", meta_path)
                continue
            # a folder edited by hand (or written by another server) holds the upload rules too
            if (refused := self._name_refusal(voice.name)) is not None:
                log.warning("voices: skipping %s (%r is not a name an upload may take: %s)", meta_path, voice.name,
                            refused)
                continue
            if self._room_refusal() is not None:
                log.warning("voices: skipping %s (--max-voices %d reached; it stays on disk)", meta_path,
                            self.max_voices)
                continue
            self._voices[voice.name] = voice
        log.info("voices: %d reference voice(s) in %s", len(self._voices), self.folder)

    def __contains__(self, name: str) -> bool:
        return name in self._voices

    def get(self, name: str) -> ReferenceVoice | None:
        return self._voices.get(name)

    def list(self) -> list[ReferenceVoice]:
        return sorted(self._voices.values(), key=lambda v: v.name)

    def check_new(self, name: str) -> None:
        """Refuse (VoiceStoreError naming the field) before the clip is decoded and encoded."""
        if self.folder is None:
            raise VoiceStoreError("name", "voice uploads are off: the server runs without --voices-dir", status=400)
        refused = self._name_refusal(name) or self._room_refusal()
        if refused is not None:
            raise refused

    # The upload rules, once: check_new raises their refusal, _load skips a file they refuse.

    def _name_refusal(self, name: str) -> VoiceStoreError | None:
        if not NAME_RE.match(name):
            return VoiceStoreError("name", "1-64 letters, digits, '_' or '-', starting with a letter or digit")
        if name in self.reserved or name in self._voices:
            return VoiceStoreError("name", f"voice {name!r} already exists (delete it first)", status=409)
        return None

    def _room_refusal(self) -> VoiceStoreError | None:
        if len(self._voices) >= self.max_voices:
            return VoiceStoreError("name", f"the server keeps at most {self.max_voices} uploaded voices (delete one "
                                   "first)", status=409)
        return None

    def add(self, voice: ReferenceVoice) -> None:
        """Keep the voice in memory and on disk (written to temporary names, then renamed, so a
        crash never leaves a half voice that loads)."""
        self.check_new(voice.name)
        if self.needs_embedding and voice.speaker_embedding is None:
            raise ValueError("VoiceStore.add: this store's voices need a speaker vector")
        base = self.folder / voice.name
        arrays = {".npy": voice.codes.astype(np.int16)}
        if voice.speaker_embedding is not None:
            arrays[".spk.npy"] = voice.speaker_embedding.astype(np.float32)
        for suffix, array in arrays.items():
            with open(base.with_suffix(suffix + ".tmp"), "wb") as f:
                np.save(f, array, allow_pickle=False)
        tmp_json = base.with_suffix(".json.tmp")
        tmp_json.write_text(json.dumps({"name": voice.name, "speaker": voice.speaker, "transcript": voice.transcript,
                                        "frames": voice.num_frames, "duration_s": voice.duration_s,
                                        "speaker_embedding": voice.speaker_embedding is not None}))
        for suffix in arrays:
            os.replace(base.with_suffix(suffix + ".tmp"), base.with_suffix(suffix))
        os.replace(tmp_json, base.with_suffix(".json"))  # last: the .json is what _load looks for
        self._voices[voice.name] = voice

    def delete(self, name: str) -> bool:
        voice = self._voices.pop(name, None)
        if voice is None:
            return False
        for suffix in (".json", ".npy", ".spk.npy"):
            (self.folder / name).with_suffix(suffix).unlink(missing_ok=True)
        return True
