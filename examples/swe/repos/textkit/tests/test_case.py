from textkit import (
    camel_case,
    kebab_case,
    pascal_case,
    snake_case,
    split_words,
    title_case,
)


def test_split_on_spaces_and_punctuation():
    assert split_words("hello, big-world") == ["hello", "big", "world"]


def test_split_camel_case():
    assert split_words("parseResponseBody") == ["parse", "Response", "Body"]


def test_split_keeps_acronyms_together():
    assert split_words("parseHTTPResponse") == ["parse", "HTTP", "Response"]


def test_split_acronym_at_the_end():
    assert split_words("loadJSON") == ["load", "JSON"]


def test_split_digits_apart():
    assert split_words("utf8Decode") == ["utf", "8", "Decode"]


def test_split_single_letter_word():
    assert split_words("aValue") == ["a", "Value"]


def test_split_nothing():
    assert split_words("  --  ") == []


def test_snake_case():
    assert snake_case("HTTPServerError") == "http_server_error"


def test_kebab_case():
    assert kebab_case("Hello World Again") == "hello-world-again"


def test_camel_case():
    assert camel_case("user_id_list") == "userIdList"


def test_camel_case_lowers_a_leading_acronym():
    assert camel_case("HTTP response") == "httpResponse"


def test_camel_case_of_nothing():
    assert camel_case("") == ""


def test_pascal_case():
    assert pascal_case("user-account settings") == "UserAccountSettings"


def test_title_case_keeps_small_words_lower_inside():
    assert title_case("the lord of the rings") == "The Lord of the Rings"


def test_title_case_capitalises_small_words_at_the_ends():
    assert title_case("of mice and men to") == "Of Mice and Men To"


def test_title_case_keeps_acronyms():
    assert title_case("a guide to NASA missions") == "A Guide to NASA Missions"


def test_title_case_lowers_the_rest_of_each_word():
    assert title_case("hELLO wORLD") == "Hello World"
