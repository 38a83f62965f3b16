"""JSON on the gateway's hot path, as bytes: msgspec reads and orjson writes a call's bodies
several times faster than the standard library (a 48k-token conversation is a ~200 KB body the
gateway reads, forwards, and records on every call); JSON text kept as read is written as it
is (`RawJSON`), and two texts are compared as bytes (`common_bytes`).

What they refuse and the standard library takes (NaN and Infinity, a number past a double,
a lone surrogate), the standard library reads or writes instead, so the gateway accepts and
answers exactly what it did with `json` alone, and its errors are the standard library's. A
NaN or an Infinity read so (a policy server's `-Infinity` logprob, say) is written back as it
was read, where orjson would write `null`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import orjson

# msgspec, not orjson, reads: orjson turns an integer past 64 bits into a float, silently;
# msgspec keeps it whole, as the standard library does.
_DECODER = msgspec.json.Decoder()


class RawJSON:
    """A value held as the JSON text it was read from, `raw`: `dumps` writes that text as it
    is, where the value sits (a chat request's messages as the agent sent them, say)."""

    __slots__ = ()
    raw: bytes


class NonFinite(float):
    """NaN, Infinity or -Infinity as the standard library reads them. orjson writes no float
    subclass, so `dumps` hands a value holding one to the standard library, which writes it
    back as read."""


def _float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else NonFinite(value)  # 1e400 reads as Infinity


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """The JSON value in `data`; raises json.JSONDecodeError (a ValueError) if it is none."""
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError:
        text = bytes(data) if isinstance(data, memoryview) else data
        return json.loads(text, parse_constant=NonFinite, parse_float=_float)


def dumps(value: Any) -> bytes:
    """`value` as compact JSON (UTF-8, no spaces); a `RawJSON` or a `msgspec.Raw` in it is
    written as the text it holds."""
    try:
        return orjson.dumps(value, default=_as_written)
    except TypeError:  # orjson.JSONEncodeError: a NonFinite, an integer past 64 bits, ...
        return json.dumps(value, separators=(",", ":"), default=_as_read).encode()


def _as_written(value: Any) -> orjson.Fragment:
    if isinstance(value, RawJSON):
        return orjson.Fragment(_one_line(value.raw))
    if isinstance(value, msgspec.Raw):
        return orjson.Fragment(_one_line(bytes(value)))
    raise TypeError(f"{type(value).__name__} is not JSON")


def _one_line(text: bytes) -> bytes:
    """JSON `text` on one line, as the rest of `dumps` writes (a store keeps a call a line):
    a line break in JSON text is whitespace between tokens (a string holds none unescaped),
    so a space in its place reads the same."""
    if b"\n" in text or b"\r" in text:
        return text.replace(b"\n", b" ").replace(b"\r", b" ")
    return text


def _as_read(value: Any) -> Any:
    """What the standard library writes in place of a value held as JSON text: that text,
    read (it writes no text as it is)."""
    if isinstance(value, RawJSON):
        return loads(value.raw)
    if isinstance(value, msgspec.Raw):
        return loads(memoryview(value))
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def common_bytes(a: bytes, b: bytes) -> int:
    """How many leading bytes `a` and `b` share, by memcmp (no copies): the whole shorter one,
    else a binary search, after a gallop back from the end. An array that extends the previous
    call's (a prompt's ids, a conversation's messages) parts from it within its last few bytes
    (where the previous array closed), so the gallop finds the bounds in a few comparisons
    instead of the ~18 a 200 KB search takes."""
    n = min(len(a), len(b))
    view = memoryview(b)
    if a.startswith(view[:n]):
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    step = 1
    while step < n:
        if a.startswith(view[: n - step]):
            low = n - step
            break
        high = n - step
        step *= 4
    while high - low > 1:
        mid = (low + high) // 2
        if a.startswith(view[:mid]):
            low = mid
        else:
            high = mid
    return low
