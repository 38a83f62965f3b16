"""How every trajectory store backend writes a call: one JSON object per call whose prompt is
the delta against the previous call of the attempt (its prompt plus its answer), whose chat
messages are the delta against the previous request's, and the tail cache that remembers,
per attempt, what the next delta is taken against and which sequence comes next.

A coding agent resends its whole conversation, ~950 messages at 48k tokens, on every call.
Found message by message, the messages a request shares with the previous one cost a walk
through two trees of dicts, the previous one cold in the cache: ~0.45 ms of the gateway's CPU
a call at 48k. When both calls came as the agent sent them (`SentMessages`), the messages are
compared as the JSON bytes the agent sent instead, and the new ones stored as those bytes:
bytes that are equal read as equal messages, so what the line keeps is exact; a message sent
again with other spacing or key order is stored again, where a comparison of the dicts would
have kept it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from darl.gateway import json_codec
from darl.gateway.lru import LRUCache
from darl.gateway.protocols.chat.capture import with_prompt_token_ids
from darl.gateway.protocols.chat.prompt_ids import RawTokenIds, token_ids_list
from darl.gateway.protocols.chat.protocol import CHAT, Endpoint
from darl.gateway.protocols.chat.sent_messages import SentMessages
from darl.gateway.store.base import (
    AlreadyReplayedError,
    AttemptClosedError,
    CallBudgetSpentError,
    ReplayOverError,
)
from darl.gateway.store.record import CallRecord
from darl.workflows import contracts

FORMAT_VERSION = 1


# How many items `common_prefix` compares at once, as a slice comparison in C.
_CHUNK = 256


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items `a` and `b` share (lists or strings). Compared a chunk at a time
    in C, and in Python only inside the chunk where they part: a 48k-token prompt that
    extends the previous call's is one comparison, not 48k steps of a loop."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i : i + _CHUNK] == b[i : i + _CHUNK]:
        i += _CHUNK
    while a[i] == b[i]:
        i += 1
    return i


@dataclass
class Tail:
    """What the next delta is taken against: the previous call of the attempt."""

    next_sequence: int = 0
    loaded: bool = False
    # How much of the stored attempt this tail has read (the directory store: bytes of the
    # file), so a writer sees when another process appended since.
    position: int = 0
    # Appends holding or waiting for the lock: a tail in use is never evicted, or a fresh one
    # would reload the attempt without the record being written and reuse its sequence.
    users: int = 0
    # The previous call's context, its prompt then its answer: kept apart, not copied into one
    # list, so a live prompt stays the bytes the policy server sent (see `prompt_delta`).
    prompt_ids: Sequence[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    # The previous request's messages: as the agent sent them (a live call that came as sent;
    # `messages` is then empty), or read.
    messages: list[Any] = field(default_factory=list)
    sent_messages: SentMessages | None = None
    prompt_text: str = ""
    # The attempt was closed: every later append is refused (see `check_append`).
    closed: bool = False
    # What the attempt's calls say of its replay (rule 10): the recorded calls they reproduce,
    # and whether one of them is live and received (a replayed call after it is refused).
    reproduced: set[str] = field(default_factory=set)
    live: bool = False
    # The attempt's own answers its agent never received: a call of the attempt that
    # reproduces one (an `Idempotency-Key` retry, `calls.idempotency`) answers the same
    # request, so no replay rule refuses it, and it is live once received.
    unreceived: set[str] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def context(self, length: int) -> list[int]:
        """The first `length` ids of the previous call's context."""
        prompt = token_ids_list(self.prompt_ids)
        if length <= len(prompt):
            return prompt[:length]
        return prompt + self.completion_ids[: length - len(prompt)]

    def advance(self, record: CallRecord) -> None:
        self.next_sequence = record.sequence + 1
        if record.unreceived:
            self.unreceived.add(record.call_id)
        if record.replayed_from is None or record.replayed_from in self.unreceived:
            # An answer its agent never received ends no replay: the agent saw nothing new.
            self.live = self.live or not record.unreceived
        if record.replayed_from is not None:
            self.reproduced.add(record.replayed_from)
        self.prompt_ids = record.prompt_token_ids
        self.completion_ids = record.completion_token_ids()
        sent = record.sent_messages
        self.sent_messages = sent
        self.messages = [] if sent is not None else list(record.request.get("messages") or [])
        prompt = record.request.get("prompt")
        self.prompt_text = prompt if isinstance(prompt, str) else ""

    def previous_messages(self) -> list[Any]:
        """The previous request's messages, read."""
        if self.sent_messages is None:
            return self.messages
        return self.sent_messages.read()

    def close_at_next_sequence(self) -> None:
        """The attempt's close took the next sequence (the S3 store's mark): only answers
        their agents never received follow it."""
        self.closed = True
        self.next_sequence += 1

    def reset(self) -> None:
        """Forget everything read: the next load starts at the attempt's first call."""
        self.closed = False
        self.reproduced = set()
        self.live = False
        self.unreceived = set()
        self.next_sequence = 0
        self.position = 0
        self.prompt_ids = []
        self.completion_ids = []
        self.messages = []
        self.sent_messages = None
        self.prompt_text = ""


class TailCache:
    """The tails of the attempts being written, least recently used evicted past `bound`
    (never one an append holds or waits for)."""

    def __init__(self, bound: int) -> None:
        self._tails: LRUCache[tuple[str, int], Tail] = LRUCache(
            bound, in_use=lambda tail: tail.users > 0
        )

    @asynccontextmanager
    async def hold(self, rollout_id: str, attempt: int) -> AsyncIterator[Tail]:
        """The attempt's tail, locked against this process's other appends to it."""
        tail = self._get((rollout_id, attempt))
        tail.users += 1
        try:
            async with tail.lock:
                yield tail
        finally:
            tail.users -= 1

    def forget(self, rollout_id: str, attempt: int) -> None:
        tail = self._tails.peek((rollout_id, attempt))
        if tail is not None and tail.users == 0:
            self._tails.pop((rollout_id, attempt))

    def __len__(self) -> int:
        return len(self._tails)

    def _get(self, key: tuple[str, int]) -> Tail:
        tail = self._tails.get(key)
        if tail is None:
            tail = Tail()
            self._tails.put(key, tail)
        return tail


def check_append(tail: Tail, record: CallRecord) -> None:
    """Raise what rules `record` out, given the attempt as `tail` has read it (under the
    attempt's lock, or at the sequence the record is about to take): a close, unless its
    agent never received it (not part of the trajectory the close handed over, it is kept for
    the next attempt's replay); a sequence past the attempt's budget of calls, replayed ones
    included (read when called, so a test may lower it); for a replayed call (rule 10), a
    call that reproduces its record already, or a live call (unless it reproduces an answer
    of its own attempt that its agent never received: it answers a retried request)."""
    where = f"attempt {record.attempt} of rollout {record.rollout_id}"
    if tail.closed and not record.unreceived:
        raise AttemptClosedError(f"{where} was closed; call {record.call_id} was not recorded")
    if tail.next_sequence >= contracts.MAX_CALLS_PER_ATTEMPT:
        raise CallBudgetSpentError(
            f"{where} holds {tail.next_sequence} calls; call {record.call_id} was not recorded"
        )
    if record.replayed_from is None:
        return
    if record.replayed_from in tail.reproduced:
        raise AlreadyReplayedError(
            f"{where} has reproduced recorded call {record.replayed_from} already",
            frozenset(tail.reproduced),
        )
    if tail.live and record.replayed_from not in tail.unreceived:
        raise ReplayOverError(f"{where} has a live call: its replay is over")


def prompt_delta(tail: Tail, prompt: Sequence[int]) -> tuple[int, list[int]]:
    """How many leading ids `prompt` shares with the previous call's context (its prompt then
    its answer), and the ids after them. A prompt read as bytes that extends the previous
    one's is compared as bytes, and only its ids past the previous prompt are parsed."""
    prev = tail.prompt_ids
    if isinstance(prompt, RawTokenIds) and isinstance(prev, RawTokenIds):
        split = prompt.split(prev)
        if split is not None:
            k, prev_rest, rest = split
            more = common_prefix(prev_rest + tail.completion_ids, rest)
            return k + more, rest[more:]
    ids = token_ids_list(prompt)
    base = common_prefix(tail.context(len(ids)), ids)
    return base, ids[base:]


def encode_record(record: CallRecord, tail: Tail) -> dict[str, Any]:
    """The stored form of `record`, the call after `tail`."""
    base, ids = prompt_delta(tail, record.prompt_token_ids)
    request = dict(record.request)
    messages = request.pop("messages", None)
    prompt = request.pop("prompt", None)
    line: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "call_id": record.call_id,
        "rollout_id": record.rollout_id,
        "attempt": record.attempt,
        "seq": record.sequence,
        "endpoint": record.endpoint,
        "upstream": record.upstream,
        "policy_version": record.policy_version,
        "created_at": record.created_at,
        "latency_ms": record.latency_ms,
        "retry_count": record.retry_count,
        "streamed": record.streamed,
        "prompt_ids": {"base": base, "ids": ids},
        "request": request,
        "response": _without_prompt_ids(record.endpoint, record.response),
    }
    if record.protocol != record.endpoint:
        line["protocol"] = record.protocol
    if record.exchange:
        line["exchange"] = record.exchange
    if record.replayed_from is not None:
        line["replayed_from"] = record.replayed_from
    if record.replay_normalized:
        line["replay_normalized"] = True
    if record.unreceived:
        line["unreceived"] = True
    if record.idempotency_key is not None:
        line["idempotency_key"] = record.idempotency_key
    if messages is not None:
        kept, items = new_messages(tail, messages, record.sent_messages)
        line["messages"] = {"base": kept, "items": items}
    if isinstance(prompt, str):
        kept = common_prefix(tail.prompt_text, prompt)
        line["prompt_text"] = {"base": kept, "text": prompt[kept:]}
    elif prompt is not None:
        line["prompt"] = prompt
    return line


def new_messages(
    tail: Tail, messages: Sequence[Any], sent: SentMessages | None
) -> tuple[int, list[Any]]:
    """How many leading messages `messages` shares with the previous request, and the ones
    after them: compared as sent when both requests have them so (as bytes, a conversation
    that extends the previous one by one comparison), else message by message. A request's
    messages as sent are stored as sent."""
    prev = tail.sent_messages
    if sent is None:
        kept = common_prefix(tail.previous_messages(), messages)
        return kept, list(messages[kept:])
    if prev is not None:
        extension = sent.extension(prev)
        if extension is not None:
            return len(prev), extension
        kept = common_prefix(prev.each(), sent.each())
        return kept, sent.each()[kept:]
    # The previous request was read (an attempt's first call, or read back from the store):
    # compared as read, without keeping this one's reading in the tail.
    previous = tail.previous_messages()
    kept = common_prefix(previous, json_codec.loads(sent.raw)) if previous else 0
    return kept, sent.each()[kept:]


def encode_line(record: CallRecord, tail: Tail) -> bytes:
    """`encode_record` as one compact JSON line."""
    return json_codec.dumps(encode_record(record, tail)) + b"\n"


def decode_record(line: dict[str, Any], tail: Tail) -> CallRecord:
    """The call stored as `line`, the call after `tail` (which the caller then advances)."""
    if line.get("v") != FORMAT_VERSION:
        raise ValueError(f"unknown trajectory record version {line.get('v')!r}")
    delta = line["prompt_ids"]
    prompt_ids = tail.context(delta["base"]) + delta["ids"]
    request = dict(line["request"])
    if "messages" in line:
        m = line["messages"]
        request["messages"] = tail.previous_messages()[: m["base"]] + m["items"]
    if "prompt_text" in line:
        p = line["prompt_text"]
        request["prompt"] = tail.prompt_text[: p["base"]] + p["text"]
    elif "prompt" in line:
        request["prompt"] = line["prompt"]
    endpoint = line["endpoint"]
    return CallRecord(
        call_id=line["call_id"],
        rollout_id=line["rollout_id"],
        attempt=line["attempt"],
        sequence=line["seq"],
        endpoint=endpoint,
        upstream=line["upstream"],
        policy_version=line["policy_version"],
        created_at=line["created_at"],
        latency_ms=line["latency_ms"],
        retry_count=line["retry_count"],
        streamed=line["streamed"],
        request=request,
        response=with_prompt_token_ids(endpoint, line["response"], prompt_ids),
        prompt_token_ids=prompt_ids,
        protocol=line.get("protocol", endpoint),
        exchange=line.get("exchange") or {},
        replayed_from=line.get("replayed_from"),
        replay_normalized=bool(line.get("replay_normalized", False)),
        unreceived=bool(line.get("unreceived", False)),
        idempotency_key=line.get("idempotency_key"),
    )


def decode_into(tail: Tail, line: dict[str, Any]) -> CallRecord:
    """Decode the call after `tail` and advance the tail past it."""
    record = decode_record(line, tail)
    tail.advance(record)
    return record


def select_calls(
    records: list[CallRecord], rollout_id: str, call_ids: list[str] | None
) -> list[CallRecord]:
    """`TrajectoryStore.read`'s `call_ids` filter: exactly those calls, in order, or KeyError."""
    if call_ids is None:
        return records
    by_id = {r.call_id: r for r in records}
    missing = [c for c in call_ids if c not in by_id]
    if missing:
        raise KeyError(f"store has no record of calls {missing[:5]} of {rollout_id}")
    return sorted((by_id[c] for c in call_ids), key=lambda r: (r.attempt, r.sequence))


def _without_prompt_ids(endpoint: Endpoint, response: dict[str, Any]) -> dict[str, Any]:
    if endpoint == CHAT:
        return {k: v for k, v in response.items() if k != "prompt_token_ids"}
    choices = [
        {k: v for k, v in choice.items() if k != "prompt_token_ids"}
        for choice in response.get("choices") or []
    ]
    return {**response, "choices": choices}
