"""Conversions of configuration values to Python types."""

from __future__ import annotations

TRUE = frozenset({"1", "yes", "true", "on"})
FALSE = frozenset({"0", "no", "false", "off"})
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
BYTES = {"b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}


def to_bool(value: str) -> bool:
    word = value.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ValueError(f"not a boolean: {value!r} (use yes/no, true/false, on/off, 1/0)")


def to_int(value: str) -> int:
    """Decimal, or hexadecimal/octal/binary with 0x/0o/0b; underscores allowed."""
    return int(value.strip(), 0)


def to_list(value: str, separator: str = ",") -> list[str]:
    """Items split by `separator` or by lines, stripped, blanks dropped."""
    items = []
    for line in value.splitlines():
        for item in line.split(separator):
            if item.strip():
                items.append(item.strip())
    return items


def to_duration(value: str) -> int:
    """Seconds from "90s", "15m", "1h30m", "2d"; a bare number is seconds."""
    text = value.strip().lower()
    if text.isdigit():
        return int(text)
    total = 0
    number = ""
    for char in text:
        if char.isdigit():
            number += char
        elif char in SECONDS and number:
            total += int(number) * SECONDS[char]
            number = ""
        else:
            raise ValueError(f"not a duration: {value!r}")
    if number or not text:
        raise ValueError(f"not a duration: {value!r} (a number needs a unit)")
    return total


def to_size(value: str) -> int:
    """Bytes from "512", "10kb", "1.5 MB" (powers of 1024)."""
    text = value.strip().lower().replace(" ", "")
    digits = text.rstrip("kmgb")
    unit = text[len(digits) :] or "b"
    if unit not in BYTES or not digits:
        raise ValueError(f"not a size: {value!r}")
    return int(float(digits) * BYTES[unit])
