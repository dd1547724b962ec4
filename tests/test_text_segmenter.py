import pytest

from server.text_segmenter import TextSegmenter


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
