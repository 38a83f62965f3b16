"""A prompt's token ids as the policy server wrote them. A coding agent's conversation comes
back on every call as a ~200 KB JSON array of 48k ids that extends the previous call's prompt;
`RawTokenIds` keeps the array's bytes and parses only the ids past those it shares, byte for
byte, with the previous prompt (`RawTokenIds.split`), so a call costs what its new tokens cost.
`answer_of` reads a whole answer so."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import msgspec

from darl.gateway import json_codec
from darl.gateway.errors import GatewayError
from darl.gateway.protocols.chat.protocol import CHAT, Endpoint

# Typed: an array that is not integers alone is refused, so a parsed array is known flat.
_IDS = msgspec.json.Decoder(list[int])


class CaptureError(GatewayError, ValueError):
    """The upstream answered without the fields DARL must capture (e.g. no token ids)."""


class RawTokenIds(Sequence[int]):
    """A JSON array of token ids as the policy server wrote it, read as a list of ints; parsed
    whole only when asked for an id, a slice or its length before `split` gave it."""

    __slots__ = ("_count", "_flat", "_ids", "raw")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self._ids: list[Any] | None = None
        self._count: int | None = None
        # Known to be a flat array of integers: each comma in it separates two ids.
        self._flat = False

    @property
    def flat(self) -> bool:
        return self._flat

    def ids(self) -> list[Any]:
        """The ids, parsed (once): what the standard library reads from `raw`."""
        if self._ids is None:
            try:
                self._ids = _IDS.decode(self.raw)
                self._flat = True
            except msgspec.DecodeError:  # not integers alone: read as any JSON array
                try:
                    self._ids = json_codec.loads(self.raw)
                except ValueError as err:
                    raise CaptureError(f"upstream prompt_token_ids are not JSON: {err}") from err
            self._count = len(self._ids)
        return self._ids

    def split(self, prev: RawTokenIds) -> tuple[int, list[int], list[int]] | None:
        """`(k, prev_rest, rest)`: this prompt and `prev` (a flat one) start with the same k ids,
        byte for byte, after which `prev` has `prev_rest` and this one `rest`. Only the ids
        past the last comma the two share are parsed (and `prev`'s are counted). None when
        this one is not an array of integers alone."""
        a, b = self.raw, prev.raw
        shared = json_codec.common_bytes(a, b)
        cut = a.rfind(b",", 0, shared)
        if cut < 0 or not prev._flat:
            return None
        try:
            rest = _IDS.decode(b"[" + a[cut + 1 :])
        except msgspec.DecodeError:
            return None
        # The bytes up to `cut` are prev's: its commas there are those before its k-th id.
        k = len(prev) - 1 - b.count(b",", cut + 1)
        prev_rest = _IDS.decode(b"[" + b[cut + 1 :])
        self._count = k + len(rest)
        self._flat = True
        return k, prev_rest, rest

    def __len__(self) -> int:
        return len(self.ids()) if self._count is None else self._count

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self.ids()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RawTokenIds):
            return self.raw == other.raw or self.ids() == other.ids()
        if isinstance(other, list):
            return self.ids() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list, which is unhashable

    def __repr__(self) -> str:
        return f"RawTokenIds({self.raw[:40]!r}{'...' if len(self.raw) > 40 else ''})"


def token_ids_list(ids: Sequence[int]) -> list[int]:
    """`ids` as a list (a RawTokenIds parsed, a list as it is)."""
    if isinstance(ids, RawTokenIds):
        return ids.ids()
    return ids if isinstance(ids, list) else list(ids)


def answer_of(endpoint: Endpoint, body: bytes) -> Any:
    """The policy server's JSON answer (or stream chunk) as `json_codec.loads` reads it, except
    that a chat answer's prompt token ids, a flat array once at the top level, are a
    RawTokenIds: the rest is parsed around them. Raises ValueError if `body` is not JSON."""
    span = _ids_span(body) if endpoint == CHAT else None
    if span is not None:
        start, end = span
        try:
            # Each part parses as an object only if the array sits at the top level.
            head = json_codec.loads(body[:start] + b"0}")
            tail = json_codec.loads(b'{"prompt_token_ids":0' + body[end:])
        except ValueError:
            head = tail = None
        if (
            isinstance(head, dict)
            and isinstance(tail, dict)
            and _is_zero(head.get(_KEY))
            and _is_zero(tail[_KEY])
        ):
            answer = {**head, **tail}
            answer[_KEY] = RawTokenIds(body[start:end])
            return answer
    return json_codec.loads(body)


def null_prompt_ids(body: bytes) -> bytes | None:
    """`body` (a chat answer or a stream event whose one `"prompt_token_ids"` holds a flat array)
    with that array made `null` and every other byte as it came; None when `_ids_span` finds no
    such array. Only for a body `answer_of` read with its ids as a RawTokenIds, where the array
    is known to sit at the top level."""
    span = _ids_span(body)
    if span is None:
        return None
    start, end = span
    return b"".join((body[:start], b"null", body[end:]))


def _is_zero(value: Any) -> bool:
    """The 0 put in the array's place (not a later duplicate of the key, nor False)."""
    return type(value) is int and value == 0


_KEY = "prompt_token_ids"
_QUOTED_KEY = b'"prompt_token_ids"'


def _ids_span(body: bytes) -> tuple[int, int] | None:
    """Where the array after the body's one `"prompt_token_ids":` lies, if it holds no string,
    array or object (so its first `]` ends it)."""
    key = body.find(_QUOTED_KEY)
    if key < 0:
        return None
    colon = key + len(_QUOTED_KEY)
    while body[colon : colon + 1] in _SPACE:
        colon += 1
    start = colon + 1
    while body[start : start + 1] in _SPACE:
        start += 1
    if body[colon : colon + 1] != b":" or body[start : start + 1] != b"[":
        return None
    end = body.find(b"]", start) + 1
    if end <= 0 or any(body.find(c, start + 1, end) >= 0 for c in (b'"', b"[", b"{")):
        return None
    # No quote in the array: a second key can only come after it (searched for past the ~200
    # KB array, a 48k prompt's search took most of this function's time).
    if body.find(_QUOTED_KEY, end) >= 0:
        return None
    return start, end


_SPACE = (b" ", b"\t", b"\n", b"\r")
