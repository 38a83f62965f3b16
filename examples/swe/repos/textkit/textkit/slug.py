"""URL slugs: lower-case ASCII words joined by a separator."""

from __future__ import annotations

import unicodedata


def slugify(text: str, separator: str = "-", max_length: int | None = None) -> str:
    """The slug of `text`: accents dropped, letters and digits kept, every other run of
    characters turned into one `separator`. With `max_length`, the slug is cut at a word
    boundary when one lies within the limit."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    words = []
    current = []
    for char in ascii_text.lower():
        if char.isalnum():
            current.append(char)
        elif current:
            words.append("".join(current))
            current = []
    if current:
        words.append("".join(current))
    slug = separator.join(words)
    if max_length is not None and len(slug) > max_length:
        slug = _shorten(slug, separator, max_length)
    return slug


def _shorten(slug: str, separator: str, max_length: int) -> str:
    if max_length < 1:
        raise ValueError(f"max_length must be positive, not {max_length}")
    cut = slug[:max_length]
    # A cut that ends inside a word backs up to the previous separator, if there is one.
    if not slug[max_length:].startswith(separator):
        boundary = cut.rfind(separator)
        if boundary > 0:
            cut = cut[:boundary]
    return cut.strip(separator)


def unique_slug(text: str, taken: set[str], separator: str = "-") -> str:
    """The slug of `text`, numbered (`-2`, `-3`, ...) until it is not in `taken`."""
    base = slugify(text, separator) or "item"
    slug = base
    number = 2
    while slug in taken:
        slug = f"{base}{separator}{number}"
        number += 1
    return slug
