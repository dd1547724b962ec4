"""Incremental segmentation of streamed text into speakable pieces.

An LLM streams text a few characters at a time; speech should start as soon as a sentence
(or a long enough clause) is complete, and each piece becomes one TTS request. `push()`
returns the segments completed by the new text, `flush()` everything that is left.

Rules:
- sentence ends: `. ! ?` (runs like `?!` or `...`, plus closing quotes/brackets) followed by
  whitespace; CJK `。！？` need no whitespace; a newline always ends a segment.
- a terminator at the very end of the buffer waits for the next character: "3." may become
  "3.14" and "Dr." may be followed by a name.
- `.` after a known abbreviation ("Dr.", "e.g.") or an initial ("J.") is not a sentence end.
- clause marks `, ; :` (and CJK `，；：、`) end a segment only once it is at least
  `min_clause_chars` long, and (ASCII) only when followed by whitespace, so "1,000" and
  "10:30" stay whole.
- a segment with no boundary at all is cut at the last space before `max_chars`.
"""

from __future__ import annotations

import re

_SENTENCE_ENDS = ".!?"
_CJK_SENTENCE_ENDS = "。！？"
_CLAUSE_MARKS = ",;:"
_CJK_CLAUSE_MARKS = "，；：、"
_CLOSERS = "\"')]}»”’」』）】"
_WAIT = -1  # TextSegmenter._rule_at: the next character, not received yet, decides
# every character at which a segment can end (the length limit aside)
_BOUNDARY = re.compile("[" + re.escape("\n" + _SENTENCE_ENDS + _CJK_SENTENCE_ENDS + _CLAUSE_MARKS + _CJK_CLAUSE_MARKS) + "]")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs no nos fig figs approx dept est inc ltd co corp gen col lt "
    "sgt capt rev hon jan feb mar apr jun jul aug sep sept oct nov dec e.g i.e cf al u.s u.k".split()
)


class TextSegmenter:
    def __init__(self, min_clause_chars: int = 40, max_chars: int = 300):
        if min_clause_chars < 1 or max_chars <= min_clause_chars:
            raise ValueError(f"need 1 <= min_clause_chars < max_chars, got {min_clause_chars}, {max_chars}")
        self._min_clause = min_clause_chars
        self._max_chars = max_chars
        self._buf = ""

    @property
    def pending(self) -> str:
        """Text received but not yet returned as a segment."""
        return self._buf

    def push(self, text: str) -> list[str]:
        self._buf += text
        return self._drain()

    def flush(self) -> list[str]:
        out = self._drain()
        rest, self._buf = self._buf.strip(), ""
        if _speakable(rest):
            out.append(rest)
        return out

    def _drain(self) -> list[str]:
        out: list[str] = []
        while (cut := self._find_cut()) is not None:
            end, resume = cut
            seg = self._buf[:end].strip()
            self._buf = self._buf[resume:]
            if _speakable(seg):
                out.append(seg)
        return out

    def _find_cut(self) -> tuple[int, int] | None:
        """(segment end, where the rest starts) of the first complete segment, or None."""
        buf = self._buf
        n = len(buf)
        start = n - len(buf.lstrip())
        over = start + self._max_chars  # the first index at which the segment is too long
        i = start
        while i < n:
            # Only boundary characters act; at any other index the one rule is the length
            # limit. So jump to the next boundary character unless the limit comes first (a
            # streaming server runs this for every text message of every session).
            m = _BOUNDARY.search(buf, i)
            nxt = m.start() if m else n
            if max(i, over) < nxt:
                return self._length_cut(start, max(i, over))
            if nxt == n:
                return None
            r = self._rule_at(nxt, start)
            if isinstance(r, tuple):
                return r
            if r == _WAIT:
                return None
            i = r
        return None

    def _rule_at(self, i: int, start: int) -> tuple[int, int] | int:
        """The rules at index i of the segment that starts at `start`: (end, resume) to cut, or
        the next index to look at (i + 1, or past a run of terminators that did not end a
        sentence), or _WAIT when a character not received yet decides."""
        buf = self._buf
        n = len(buf)
        ch = buf[i]
        seg_len = i + 1 - start
        if ch == "\n":
            return i, i + 1
        if ch in _CJK_SENTENCE_ENDS:
            j = self._skip(i + 1, _CJK_SENTENCE_ENDS + _CLOSERS)
            return j, j
        if ch in _SENTENCE_ENDS:
            j = self._skip(i + 1, _SENTENCE_ENDS)
            j = self._skip(j, _CLOSERS)
            if j == n:
                return _WAIT  # the next character decides
            if buf[j].isspace() and not (ch == "." and j == i + 1 and self._abbreviation_before(i)):
                return j, j
            return j
        if ch in _CJK_CLAUSE_MARKS and seg_len >= self._min_clause:
            return i + 1, i + 1
        if ch in _CLAUSE_MARKS and seg_len >= self._min_clause:
            if i + 1 == n:
                return _WAIT
            if buf[i + 1].isspace():
                return i + 1, i + 1
        if seg_len > self._max_chars:
            return self._length_cut(start, i)
        return i + 1

    def _length_cut(self, start: int, i: int) -> tuple[int, int]:
        """A segment with no boundary, too long at index i: cut at the last space before i."""
        space = self._buf.rfind(" ", start, i)
        return (space, space + 1) if space > start else (i, i)

    def _skip(self, j: int, chars: str) -> int:
        while j < len(self._buf) and self._buf[j] in chars:
            j += 1
        return j

    def _abbreviation_before(self, dot: int) -> bool:
        k = dot
        while k > 0 and (self._buf[k - 1].isalpha() or self._buf[k - 1] == "."):
            k -= 1
        word = self._buf[k:dot]
        if len(word) == 1 and word.isupper() and word != "I":
            return True  # an initial, as in "J. R. R. Tolkien"
        return word.lower() in _ABBREVIATIONS


def _speakable(segment: str) -> bool:
    return any(c.isalnum() for c in segment)
