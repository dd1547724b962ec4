"""Character and word timings of a segment's audio, sent while the audio streams.

The engine reports when each chunk of a segment's audio was produced, not which character it
speaks, so timings are derived: a segment's characters are spread evenly over its audio at
the speaking rate (characters per second), and each chunk carries the characters whose start
falls inside it. The rate starts at `DEFAULT_CHARS_PER_SECOND` and is learned per stream from
every finished segment (characters / seconds of its audio), so from the second segment on it
is the voice's own rate. When the segment ends, characters not yet sent go with the end
(squeezed between the last sent character and the end of the audio).

Precision (docs/api.md "Timings"): a segment's first character starts exactly at its first
audio sample and every character lies inside its own segment's audio, so the error never
crosses a segment boundary; inside a segment a character's time is off by how far the
speech's local rate differs from the segment's even spread (about a word's length on real
speech), plus, for a compressed format, the encoder's delay (MP3 ~46 ms, AAC ~43 ms).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CHARS_PER_SECOND = 15.0  # English read speech; replaced by the measured rate
_RATE_BOUNDS = (4.0, 40.0)  # a learned rate outside this is a degenerate segment, not a voice


@dataclass(frozen=True)
class CharTime:
    char: str
    start_s: float  # from the segment's first sample
    end_s: float


class SpeakingRate:
    """A stream's characters per second, learned from its finished segments."""

    def __init__(self, chars_per_second: float = DEFAULT_CHARS_PER_SECOND):
        self.chars_per_second = chars_per_second
        self._chars = 0
        self._seconds = 0.0

    def learn(self, chars: int, seconds: float) -> None:
        if chars <= 0 or seconds <= 0:
            return
        self._chars += chars
        self._seconds += seconds
        lo, hi = _RATE_BOUNDS
        self.chars_per_second = min(hi, max(lo, self._chars / self._seconds))


class SegmentTimer:
    """Timings of one segment's characters as its audio arrives chunk by chunk."""

    def __init__(self, text: str, sample_rate: int, rate: SpeakingRate):
        self.text = text
        self._sample_rate = sample_rate
        self._rate = rate
        self._step_s = 1.0 / rate.chars_per_second  # one character's share of the audio
        self._sent = 0  # characters already timed
        self._samples = 0  # audio samples seen so far

    @property
    def seconds(self) -> float:
        return self._samples / self._sample_rate

    def advance(self, n_samples: int) -> list[CharTime]:
        """The characters that start inside the next `n_samples` of audio (times from the
        segment's start); the last character is kept for `finish` so the end is exact."""
        start_s = self.seconds
        self._samples += n_samples
        end_s = self.seconds
        out: list[CharTime] = []
        last = len(self.text) - 1
        while self._sent < last and self._sent * self._step_s < end_s:
            i = self._sent
            begin = max(i * self._step_s, start_s)
            out.append(CharTime(self.text[i], begin, min((i + 1) * self._step_s, end_s)))
            self._sent += 1
        return out

    def finish(self) -> list[CharTime]:
        """The characters not yet timed, spread between the last timed one and the end of the
        audio; the rate learns from this segment."""
        total = self.seconds
        left = len(self.text) - self._sent
        begin = min(self._sent * self._step_s, total)
        if left <= 0:
            return []
        step = (total - begin) / left
        out = [CharTime(self.text[self._sent + k], begin + k * step, begin + (k + 1) * step) for k in range(left)]
        self._sent = len(self.text)
        self._rate.learn(len(self.text), total)
        return out


def words(chars: list[CharTime]) -> list[tuple[str, float, float]]:
    """(word, start, end) of the whitespace-separated words in a run of timed characters; a word
    cut by the run's end is returned as far as it goes (callers keep runs whole segments or
    carry the tail)."""
    out: list[tuple[str, float, float]] = []
    word: list[CharTime] = []
    for c in [*chars, None]:
        if c is None or c.char.isspace():
            if word:
                out.append(("".join(w.char for w in word), word[0].start_s, word[-1].end_s))
                word = []
        else:
            word.append(c)
    return out
