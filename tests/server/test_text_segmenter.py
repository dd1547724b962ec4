import pytest

from server.tts.text_segmenter import TextSegmenter


def segments_of(chunks: list[str], **kw) -> list[str]:
    seg = TextSegmenter(**kw)
    out: list[str] = []
    for c in chunks:
        out += seg.push(c)
    return out + seg.flush()


def test_sentences_come_out_as_soon_as_they_end():
    seg = TextSegmenter()
    assert seg.push("Hello there. How are") == ["Hello there."]
    assert seg.push(" you? Fine") == ["How are you?"]
    assert seg.flush() == ["Fine"]
    assert seg.flush() == []


def test_terminator_at_end_of_buffer_waits_for_the_next_character():
    seg = TextSegmenter()
    assert seg.push("It is 3.") == []
    assert seg.push("14 exactly. Yes") == ["It is 3.14 exactly."]
    assert seg.flush() == ["Yes"]


def test_abbreviations_and_initials_do_not_end_sentences():
    text = "Dr. Smith met Mrs. Jones, e.g. at St. Mary's. J. R. R. Tolkien wrote it. Done"
    assert segments_of([text]) == ["Dr. Smith met Mrs. Jones, e.g. at St. Mary's.", "J. R. R. Tolkien wrote it.", "Done"]


def test_decimal_numbers_and_thousands_stay_whole():
    assert segments_of(["Pi is 3.14159 and 1,000,000 is big, really big, quite a lot of it. Ok"], min_clause_chars=10) == [
        "Pi is 3.14159 and 1,000,000 is big,",
        "really big,",
        "quite a lot of it.",
        "Ok",
    ]


def test_clause_marks_split_only_long_segments():
    seg = TextSegmenter(min_clause_chars=20)
    assert seg.push("Well, ok, ") == []  # too short to split at these commas
    assert seg.push("so this is getting longer; and longer") == ["Well, ok, so this is getting longer;"]
    assert seg.flush() == ["and longer"]


def test_question_exclamation_runs_ellipsis_and_closing_quotes():
    assert segments_of(['He said "Really?!" Then... she left. (Yes.) End']) == [
        'He said "Really?!"',
        "Then...",
        "she left.",
        "(Yes.)",
        "End",
    ]


def test_cjk_sentence_and_clause_marks():
    assert segments_of(["你好。今天天气很好！我们走吧？好"]) == ["你好。", "今天天气很好！", "我们走吧？", "好"]
    assert segments_of(["一二三四五，六七八"], min_clause_chars=3) == ["一二三四五，", "六七八"]


def test_newline_ends_a_segment():
    assert segments_of(["first line\nsecond line\n\nthird"]) == ["first line", "second line", "third"]


def test_long_text_without_boundaries_is_cut_at_a_space():
    words = " ".join(["word"] * 40)  # 199 chars, no punctuation
    out = segments_of([words], min_clause_chars=10, max_chars=50)
    assert all(len(s) <= 50 for s in out)
    assert " ".join(out) == words


def test_punctuation_only_pieces_are_dropped():
    assert segments_of(["... !!! Hi."]) == ["Hi."]
    assert segments_of(["   "]) == []


@pytest.mark.parametrize(
    "text",
    [
        "Hello there. This is Dr. Who, at 3.14 p.m. on Jan. 5th! Isn't it? Yes, and, more, text; here: done.",
        "Short. Sentences. Everywhere. 你好。再见！",
    ],
)
def test_char_by_char_streaming_matches_one_push(text):
    assert segments_of(list(text)) == segments_of([text])


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError):
        TextSegmenter(min_clause_chars=50, max_chars=50)


class _CharByCharSegmenter(TextSegmenter):
    """The rules applied at every index in turn (the segmenter's first form): the reference
    that the boundary-jumping `_find_cut` must match on any text."""

    def _find_cut(self):
        from server.tts.text_segmenter import _WAIT

        n = len(self._buf)
        start = r = n - len(self._buf.lstrip())
        while not isinstance(r, tuple) and r != _WAIT and r < n:  # every index from the start
            r = self._rule_at(r, start)
        return r if isinstance(r, tuple) else None


def test_jumping_to_boundaries_matches_the_rules_applied_at_every_character():
    """Random texts rich in boundary marks, closers, abbreviations and long unbroken runs, fed
    in random pieces with small limits (so the length cut also lands inside skipped runs of
    terminators): the same segments, piece by piece, as the character-by-character rules."""
    import random

    rng = random.Random(5)
    atoms = ["a", "b", "word", " ", "  ", ".", "...", "?!", "!", ",", ";", ":", "\n", "。", "！", "，", "、", '"', ")",
             "’", "」", "Dr", "e.g", "J", "I", "3", "14", "1,000", "x" * 12]
    for case in range(400):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 60)))
        min_clause = rng.randint(1, 12)
        max_chars = rng.randint(min_clause + 1, 30)
        fast, ref = TextSegmenter(min_clause, max_chars), _CharByCharSegmenter(min_clause, max_chars)
        i = 0
        while i < len(text):
            k = rng.randint(1, 9)
            piece, i = text[i : i + k], i + k
            assert fast.push(piece) == ref.push(piece), (case, text, min_clause, max_chars)
        assert fast.flush() == ref.flush(), (case, text, min_clause, max_chars)
