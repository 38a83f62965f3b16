"""Small text utilities: slugs, case conversion and fixed-width wrapping."""

from textkit.case import camel_case, kebab_case, pascal_case, snake_case, split_words, title_case
from textkit.slug import slugify, unique_slug
from textkit.wrap import justify, truncate, wrap

__all__ = [
    "camel_case",
    "justify",
    "kebab_case",
    "pascal_case",
    "slugify",
    "snake_case",
    "split_words",
    "title_case",
    "truncate",
    "unique_slug",
    "wrap",
]
