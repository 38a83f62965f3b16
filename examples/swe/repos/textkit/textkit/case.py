"""Splitting phrases and identifiers into words, and joining them in the usual cases."""

from __future__ import annotations

SMALL_WORDS = frozenset(
    {"a", "an", "and", "as", "at", "but", "by", "for", "in", "of", "on", "or", "the", "to"}
)


def split_words(text: str) -> list[str]:
    """The words of `text`, split at spaces, punctuation, case changes and digits:
    "parseHTTPResponse2" -> ["parse", "HTTP", "Response", "2"]."""
    words: list[str] = []
    current = ""
    for index, char in enumerate(text):
        if not char.isalnum():
            if current:
                words.append(current)
            current = ""
            continue
        if current and _starts_word(text, index):
            words.append(current)
            current = ""
        current += char
    if current:
        words.append(current)
    return words


def _starts_word(text: str, index: int) -> bool:
    char, previous = text[index], text[index - 1]
    if char.isdigit() != previous.isdigit():
        return True
    if char.isupper() and previous.islower():
        return True
    # The last capital of an acronym starts the next word: "HTTPResponse" -> "HTTP", "Response".
    following = text[index + 1] if index + 1 < len(text) else ""
    return char.isupper() and previous.isupper() and following.islower()


def snake_case(text: str) -> str:
    return "_".join(word.lower() for word in split_words(text))


def kebab_case(text: str) -> str:
    return "-".join(word.lower() for word in split_words(text))


def camel_case(text: str) -> str:
    words = split_words(text)
    if not words:
        return ""
    first, *rest = words
    return first.lower() + "".join(word.capitalize() for word in rest)


def pascal_case(text: str) -> str:
    return "".join(word.capitalize() for word in split_words(text))


def title_case(text: str) -> str:
    """Each word capitalised, except small words ("of", "the", ...) inside the title; words
    already in capitals (acronyms) are kept."""
    words = text.split()
    titled = []
    for position, word in enumerate(words):
        lower = word.lower()
        inside = 0 < position < len(words) - 1
        if inside and lower in SMALL_WORDS:
            titled.append(lower)
        elif word.isupper() and len(word) > 1:
            titled.append(word)
        else:
            titled.append(lower[:1].upper() + lower[1:])
    return " ".join(titled)
