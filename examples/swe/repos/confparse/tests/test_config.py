import pytest
from confparse import Config


def test_get():
    config = Config.from_text("[db]\nhost = localhost\n")
    assert config.get("db", "host") == "localhost"


def test_get_is_case_insensitive_for_keys():
    config = Config.from_text("[db]\nHost = localhost\n")
    assert config.get("db", "HOST") == "localhost"


def test_get_a_missing_key():
    config = Config.from_text("[db]\nhost = localhost\n")
    with pytest.raises(KeyError):
        config.get("db", "port")


def test_get_a_missing_key_with_a_default():
    config = Config.from_text("[db]\nhost = localhost\n")
    assert config.get("db", "port", default=5432) == "5432"


def test_sections_in_file_order():
    config = Config.from_text("[b]\nx = 1\n[a]\ny = 2\n")
    assert config.sections() == ["b", "a"]


def test_reference_in_the_same_section():
    config = Config.from_text("[paths]\nroot = /srv\ndata = ${root}/data\n")
    assert config.get("paths", "data") == "/srv/data"


def test_reference_to_another_section():
    text = "[paths]\nroot = /srv\n[app]\nlogs = ${paths.root}/logs\n"
    assert Config.from_text(text).get("app", "logs") == "/srv/logs"


def test_several_references_in_one_value():
    text = "[a]\nhost = h\nport = 80\nurl = http://${host}:${port}/\n"
    assert Config.from_text(text).get("a", "url") == "http://h:80/"


def test_references_resolve_through_chains():
    text = "[a]\nx = 1\ny = ${x}2\nz = ${y}3\n"
    assert Config.from_text(text).get("a", "z") == "123"


def test_circular_references_are_an_error():
    config = Config.from_text("[a]\nx = ${y}\ny = ${x}\n")
    with pytest.raises(ValueError, match="circular"):
        config.get("a", "x")


def test_reference_to_a_missing_key():
    config = Config.from_text("[a]\nx = ${nope}\n")
    with pytest.raises(KeyError):
        config.get("a", "x")


def test_unclosed_reference():
    config = Config.from_text("[a]\nx = ${y\n")
    with pytest.raises(ValueError):
        config.get("a", "x")


def test_typed_getters():
    text = "[w]\nworkers = 8\ndebug = yes\ntags = a, b\ntimeout = 2m\n"
    config = Config.from_text(text)
    assert config.get_int("w", "workers") == 8
    assert config.get_bool("w", "debug") is True
    assert config.get_list("w", "tags") == ["a", "b"]
    assert config.get_duration("w", "timeout") == 120
