import pytest
from confparse import ConfigError, parse


def test_sections_and_keys():
    text = "[server]\nhost = example.org\nport = 8080\n"
    assert parse(text) == {"server": {"host": "example.org", "port": "8080"}}


def test_keys_are_lower_cased():
    assert parse("[a]\nName = x\n") == {"a": {"name": "x"}}


def test_comment_lines_and_blank_lines_are_skipped():
    text = "# top\n\n[a]\n; note\nk = v\n"
    assert parse(text) == {"a": {"k": "v"}}


def test_inline_comments_are_dropped():
    assert parse("[a]\nk = value # why\n") == {"a": {"k": "value"}}


def test_a_hash_inside_a_word_is_kept():
    assert parse("[a]\ncolor = #fff\nchannel = irc#dev\n") == {
        "a": {"color": "#fff", "channel": "irc#dev"}
    }


def test_quotes_protect_comment_characters():
    assert parse('[a]\nk = "a ; b" ; note\n') == {"a": {"k": "a ; b"}}


def test_single_quotes_are_removed():
    assert parse("[a]\nk = ' padded '\n") == {"a": {"k": " padded "}}


def test_equals_signs_in_values_are_kept():
    assert parse("[a]\nquery = x=1&y=2\n") == {"a": {"query": "x=1&y=2"}}


def test_continuation_lines_join_with_newlines():
    text = "[a]\npaths = /usr\n    /opt\n\t/srv\n"
    assert parse(text) == {"a": {"paths": "/usr\n/opt\n/srv"}}


def test_a_repeated_section_is_merged():
    text = "[a]\nx = 1\n[b]\ny = 2\n[a]\nz = 3\n"
    assert parse(text) == {"a": {"x": "1", "z": "3"}, "b": {"y": "2"}}


def test_key_outside_a_section():
    with pytest.raises(ConfigError) as raised:
        parse("k = v\n")
    assert raised.value.line == 1


def test_unclosed_section_header():
    with pytest.raises(ConfigError) as raised:
        parse("[a]\nk = v\n[broken\n")
    assert raised.value.line == 3


def test_line_without_equals():
    with pytest.raises(ConfigError) as raised:
        parse("[a]\njust words\n")
    assert raised.value.line == 2


def test_empty_section_name():
    with pytest.raises(ConfigError):
        parse("[ ]\n")


def test_error_message_names_the_line():
    with pytest.raises(ConfigError, match="line 2"):
        parse("[a]\n= value\n")
