"""JSON on the gateway's hot path, as bytes: orjson, which parses and writes a call's bodies
several times faster than the standard library (a 48k-token conversation is a ~200 KB body the
gateway reads, forwards, and records on every call).

Where orjson refuses what the standard library takes (NaN and Infinity, integers past 64
bits), the standard library reads or writes it instead, so the gateway accepts and answers
exactly what it did with `json` alone; its errors are the standard library's. A NaN or an
Infinity read so (a policy server's `-Infinity` logprob, say) is written back as it was
read, where orjson would write `null`.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


class NonFinite(float):
    """NaN, Infinity or -Infinity as the standard library reads them. orjson writes no float
    subclass, so `dumps` hands a value holding one to the standard library, which writes it
    back as read."""


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """The JSON value in `data`; raises json.JSONDecodeError (a ValueError) if it is none."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        text = bytes(data) if isinstance(data, memoryview) else data
        return json.loads(text, parse_constant=NonFinite)


def dumps(value: Any) -> bytes:
    """`value` as compact JSON (UTF-8, no spaces)."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError: a NonFinite, an integer past 64 bits, ...
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
