"""A chat request's messages as the agent sent them. A coding agent resends its whole
conversation on every call, ~950 messages at 48k tokens; the gateway forwards them to the
policy server and stores the ones that are new, and reads none of them. `read_chat` reads a
chat request's other fields and keeps its messages as the JSON array's bytes (`SentMessages`),
checked to be objects without building one. They are written out as those bytes
(`json_codec.dumps`), compared with the previous call's as bytes (`SentMessages.extension`), and
parsed, once, only where a message is read (replay matching, a prompt's tokens counted)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import msgspec

from darl.gateway import json_codec

# A JSON object's top-level fields, each as its text: the whole body is checked, nothing built.
_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])


class _Object(msgspec.Struct, gc=False):
    """Any JSON object (its fields skipped): decoding a list of them checks that every item
    is an object, at the cost of an empty struct each."""


_OBJECTS = msgspec.json.Decoder(list[_Object])
_EACH = msgspec.json.Decoder(list[msgspec.Raw])


class SentMessages(json_codec.RawJSON, Sequence[Any]):
    """The messages of a chat request: `raw`, the JSON array the agent sent, known to hold
    `count` objects (at least one). Read as a list of dicts when asked for a message."""

    __slots__ = ("_count", "_each", "_read", "raw")

    def __init__(self, raw: bytes, count: int) -> None:
        self.raw = raw
        self._count = count
        self._each: list[msgspec.Raw] | None = None
        self._read: list[Any] | None = None

    def each(self) -> list[msgspec.Raw]:
        """Each message's JSON text, as sent (views into `raw`)."""
        if self._each is None:
            self._each = _EACH.decode(self.raw)
        return self._each

    def read(self) -> list[Any]:
        """The messages, parsed (once)."""
        if self._read is None:
            self._read = json_codec.loads(self.raw)
        return self._read

    def extension(self, prev: SentMessages) -> list[msgspec.Raw] | None:
        """The messages past `prev`'s (as sent) if this request's messages are `prev`'s, byte
        for byte, and more (or none more); None otherwise. Found by one comparison of bytes,
        and only the new messages are read."""
        shared = json_codec.common_bytes(self.raw, prev.raw)
        if shared == len(prev.raw) == len(self.raw):
            return []
        # `prev` up to its closing bracket, then a comma: its messages, then more (each item is
        # an object, which ends where its braces close, whatever follows it).
        if shared != len(prev.raw) - 1 or self.raw[shared : shared + 1] != b",":
            return None
        new = _EACH.decode(b"[" + self.raw[shared + 1 :])
        return new if len(prev) + len(new) == len(self) else None

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        return self.read()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.read())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SentMessages):
            return self.raw == other.raw or self.read() == other.read()
        if isinstance(other, list):
            return self.read() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list, which is unhashable

    def __repr__(self) -> str:
        return f"SentMessages({self._count} messages, {len(self.raw)} bytes)"


def read_chat(body: bytes) -> dict[str, Any] | None:
    """A chat request read from `body` with its messages as sent (`SentMessages`), its other
    fields as `json_codec.loads` reads them; None when `body` is not a JSON object whose
    `messages` are a non-empty array of objects in UTF-8, or holds what msgspec refuses (NaN,
    say): the caller reads it whole, and refuses it in the words it always has."""
    try:
        fields = _FIELDS.decode(body)
        raw = fields.get("messages")
        if raw is None:
            return None
        count = len(_OBJECTS.decode(raw))
        messages = bytes(raw)
        if not messages.isascii():
            messages.decode()  # the skim checks no string's UTF-8
        read: dict[str, Any] = {
            key: None if key == "messages" else json_codec.loads(memoryview(value))
            for key, value in fields.items()
        }
    except (msgspec.DecodeError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    if count == 0:
        return None
    read["messages"] = SentMessages(messages, count)
    return read


def with_messages_read(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with its messages as a list of dicts, if they are `SentMessages`."""
    messages = body.get("messages")
    if isinstance(messages, SentMessages):
        return {**body, "messages": messages.read()}
    return body
