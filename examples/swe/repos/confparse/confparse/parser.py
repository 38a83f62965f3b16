"""The INI-style text format: sections of keys, comments and continuation lines."""

from __future__ import annotations


class ConfigError(ValueError):
    """Text that is not a valid configuration, with the line at fault."""

    def __init__(self, message: str, line: int) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


def parse(text: str) -> dict[str, dict[str, str]]:
    """Sections by name, each its keys (lower-cased) and raw values, in file order."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    last_key: str | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped[0] in "#;":
            continue
        if raw[0] in " \t" and current is not None and last_key is not None:
            current[last_key] += "\n" + stripped
            continue
        if stripped.startswith("["):
            if not stripped.endswith("]"):
                raise ConfigError(f"unclosed section header {stripped!r}", number)
            name = stripped[1:-1].strip()
            if not name:
                raise ConfigError("empty section name", number)
            current = sections.setdefault(name, {})
            last_key = None
            continue
        key, separator, value = stripped.partition("=")
        if not separator:
            raise ConfigError(f"expected 'key = value', got {stripped!r}", number)
        if current is None:
            raise ConfigError(f"key {key.strip()!r} outside any section", number)
        key = key.strip().lower()
        if not key:
            raise ConfigError("a value without a key", number)
        current[key] = unquote(strip_comment(value.strip()))
        last_key = key
    return sections


def strip_comment(value: str) -> str:
    """The value without a trailing comment: `#` or `;` after a space, outside quotes."""
    quote = None
    for index, char in enumerate(value):
        if char in "\"'":
            if quote is None:
                quote = char
            elif quote == char:
                quote = None
        elif char in "#;" and quote is None and index > 0 and value[index - 1] == " ":
            return value[:index].rstrip()
    return value


def unquote(value: str) -> str:
    """A value in matching single or double quotes, without them."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value
