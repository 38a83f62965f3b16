"""JSON on the gateway's hot path, as bytes: msgspec reads and orjson writes a call's bodies
several times faster than the standard library (a 48k-token conversation is a ~200 KB body the
gateway reads, forwards, and records on every call).

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
    """`value` as compact JSON (UTF-8, no spaces)."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError: a NonFinite, an integer past 64 bits, ...
        return json.dumps(value, separators=(",", ":")).encode()
