import pytest
from confparse import to_bool, to_duration, to_int, to_list, to_size


def test_bool_words():
    assert to_bool("Yes") is True
    assert to_bool(" off ") is False


def test_bool_digits():
    assert to_bool("1") is True
    assert to_bool("0") is False


def test_bool_rejects_other_words():
    with pytest.raises(ValueError):
        to_bool("maybe")


def test_int_decimal_and_hex():
    assert to_int(" 42 ") == 42
    assert to_int("0x1F") == 31


def test_int_with_underscores():
    assert to_int("1_000") == 1000


def test_list_by_commas():
    assert to_list("a, b ,c") == ["a", "b", "c"]


def test_list_drops_blanks():
    assert to_list("a,,b,") == ["a", "b"]


def test_list_by_lines():
    assert to_list("one\ntwo, three") == ["one", "two", "three"]


def test_list_with_another_separator():
    assert to_list("a:b", separator=":") == ["a", "b"]


def test_duration_bare_seconds():
    assert to_duration("45") == 45


def test_duration_units():
    assert to_duration("90s") == 90
    assert to_duration("15m") == 900
    assert to_duration("2d") == 172800


def test_duration_combined():
    assert to_duration("1h30m") == 5400


def test_duration_needs_a_unit_after_a_number():
    with pytest.raises(ValueError):
        to_duration("1h30")


def test_duration_rejects_unknown_units():
    with pytest.raises(ValueError):
        to_duration("3w")


def test_size_in_bytes():
    assert to_size("512") == 512


def test_size_units():
    assert to_size("10kb") == 10240
    assert to_size("1.5 MB") == 1572864


def test_size_rejects_unknown_units():
    with pytest.raises(ValueError):
        to_size("3tb")
