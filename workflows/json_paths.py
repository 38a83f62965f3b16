"""Dotted paths into JSON values (`items.0.answer`): how a spec names a value inside a task or
inside an agent workflow's result. Pure, so workflows and activities read paths alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def value_at(value: Any, path: str) -> Any:
    """The value at the dotted `path` inside `value` (any JSON value): an object's field by
    name, a list's item by index (`items.0`); the empty path is `value` itself. Raises
    LookupError naming the first part that is not there."""
    for part in path.split(".") if path else ():
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise LookupError(part)
    return value
