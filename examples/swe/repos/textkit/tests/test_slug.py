import pytest
from textkit import slugify, unique_slug


def test_words_are_joined_with_hyphens():
    assert slugify("Hello World") == "hello-world"


def test_punctuation_runs_become_one_separator():
    assert slugify("Rock & Roll -- Live!") == "rock-roll-live"


def test_leading_and_trailing_punctuation_is_dropped():
    assert slugify("  ...Hello, World!  ") == "hello-world"


def test_accents_are_dropped():
    assert slugify("Crème brûlée à la carte") == "creme-brulee-a-la-carte"


def test_digits_are_kept():
    assert slugify("Top 10 Tips for 2024") == "top-10-tips-for-2024"


def test_custom_separator():
    assert slugify("Hello Big World", separator="_") == "hello_big_world"


def test_empty_text_gives_an_empty_slug():
    assert slugify("!!!") == ""


def test_max_length_cuts_at_a_word_boundary():
    assert slugify("The quick brown fox", max_length=12) == "the-quick"


def test_max_length_keeps_a_whole_word_ending_at_the_limit():
    assert slugify("The quick brown fox", max_length=15) == "the-quick-brown"


def test_max_length_cuts_inside_a_single_long_word():
    assert slugify("Supercalifragilistic", max_length=5) == "super"


def test_max_length_longer_than_the_slug_changes_nothing():
    assert slugify("short title", max_length=50) == "short-title"


def test_max_length_must_be_positive():
    with pytest.raises(ValueError):
        slugify("Hello World", max_length=0)


def test_unique_slug_is_the_slug_when_free():
    assert unique_slug("Hello World", {"other"}) == "hello-world"


def test_unique_slug_numbers_from_two():
    assert unique_slug("Hello World", {"hello-world"}) == "hello-world-2"


def test_unique_slug_skips_numbers_taken():
    taken = {"report", "report-2", "report-3"}
    assert unique_slug("Report", taken) == "report-4"


def test_unique_slug_of_nothing_is_item():
    assert unique_slug("???", set()) == "item"
