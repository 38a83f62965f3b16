"""Fixed-width text: greedy wrapping, full justification and truncation."""

from __future__ import annotations


def wrap(text: str, width: int) -> list[str]:
    """The words of `text` in lines of at most `width` characters, each line filled as far as
    it goes; a word longer than `width` is split across lines."""
    if width < 1:
        raise ValueError(f"width must be at least 1, not {width}")
    lines: list[str] = []
    line = ""
    for word in text.split():
        while len(word) > width:
            if line:
                lines.append(line)
                line = ""
            lines.append(word[:width])
            word = word[width:]
        if not word:
            continue
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= width:
            line += " " + word
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines


def justify(line: str, width: int) -> str:
    """`line` spread to exactly `width` characters by widening the gaps between its words;
    the leftmost gaps take the extra spaces. A single word is padded on the right."""
    words = line.split()
    if len(words) < 2:
        return line.strip().ljust(width)
    gaps = len(words) - 1
    spaces = width - sum(len(word) for word in words)
    if spaces < gaps:
        raise ValueError(f"{line!r} does not fit in {width} characters")
    base, extra = divmod(spaces, gaps)
    parts = []
    for index, word in enumerate(words[:-1]):
        parts.append(word)
        parts.append(" " * (base + 1 if index < extra else base))
    parts.append(words[-1])
    return "".join(parts)


def truncate(text: str, width: int, placeholder: str = "...") -> str:
    """`text` cut to at most `width` characters, ending in `placeholder` when it was cut."""
    if len(text) <= width:
        return text
    if width < len(placeholder):
        raise ValueError(f"width {width} is shorter than the placeholder {placeholder!r}")
    return text[: width - len(placeholder)].rstrip() + placeholder
