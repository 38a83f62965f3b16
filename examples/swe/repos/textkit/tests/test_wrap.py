import pytest
from textkit import justify, truncate, wrap


def test_wrap_fills_lines():
    text = "the quick brown fox jumps over the lazy dog"
    assert wrap(text, 15) == ["the quick brown", "fox jumps over", "the lazy dog"]


def test_wrap_a_word_exactly_the_width():
    assert wrap("abcde fgh", 5) == ["abcde", "fgh"]


def test_wrap_splits_long_words():
    assert wrap("abcdefghij xy", 4) == ["abcd", "efgh", "ij", "xy"]


def test_wrap_long_word_after_a_line():
    assert wrap("ab abcdefgh", 4) == ["ab", "abcd", "efgh"]


def test_wrap_collapses_whitespace():
    assert wrap("  one \n two\tthree  ", 20) == ["one two three"]


def test_wrap_nothing():
    assert wrap("", 10) == []


def test_wrap_rejects_zero_width():
    with pytest.raises(ValueError):
        wrap("text", 0)


def test_justify_spreads_gaps_evenly():
    assert justify("a b c", 9) == "a   b   c"


def test_justify_gives_extra_spaces_to_the_left():
    assert justify("aa bb cc dd", 15) == "aa   bb  cc  dd"


def test_justify_pads_a_single_word():
    assert justify("word", 8) == "word    "


def test_justify_rejects_a_line_too_long():
    with pytest.raises(ValueError):
        justify("hello world", 6)


def test_truncate_leaves_short_text():
    assert truncate("short", 10) == "short"


def test_truncate_at_exactly_the_width():
    assert truncate("exactly10!", 10) == "exactly10!"


def test_truncate_adds_the_placeholder():
    assert truncate("The quick brown fox", 12) == "The quick..."


def test_truncate_drops_the_space_before_the_placeholder():
    assert truncate("Hello world again", 9) == "Hello..."


def test_truncate_with_a_custom_placeholder():
    assert truncate("abcdefghij", 6, placeholder="~") == "abcde~"


def test_truncate_rejects_a_width_below_the_placeholder():
    with pytest.raises(ValueError):
        truncate("abcdefghij", 2)
