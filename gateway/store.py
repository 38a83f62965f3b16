"""The trajectory store: where the full record of every model call lives (request, response,
token ids, logprobs), so that none of it has to go through workflow history.

`TrajectoryStore` is the interface (an S3 backend can fill it later); `DirectoryTrajectoryStore`
keeps one append-only JSONL file per rollout attempt. Prompts are stored as the delta against
the previous call of the attempt (its prompt plus its answer), and chat messages as the delta
against the previous request's messages, so a trajectory's storage grows with its length, not
with turns x prompt length.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from darl.gateway.capture import (
    CHAT,
    Endpoint,
    completion_logprobs,
    completion_token_ids,
    finish_reason,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass(frozen=True)
class CallRecord:
    """One model call, whole: what was sent, what came back, and the token ids of both."""

    call_id: str
    rollout_id: str
    attempt: int
    sequence: int
    endpoint: Endpoint
    upstream: str
    policy_version: int
    created_at: float
    latency_ms: float
    retry_count: int
    streamed: bool
    request: dict[str, Any]
    response: dict[str, Any]
    prompt_token_ids: list[int]
    # The protocol the agent spoke (the Responses or Messages API, translated to a chat call;
    # see `translation`): the endpoint's own unless said.
    protocol: str = ""
    # What the protocol's answer needs of the call later: the ids it answered under, whether
    # it carried instructions (`previous_response_id` drops them).
    exchange: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.protocol:
            object.__setattr__(self, "protocol", self.endpoint)

    def completion_token_ids(self, choice: int = 0) -> list[int]:
        return completion_token_ids(self.response, choice)

    def completion_logprobs(self, choice: int = 0) -> list[float] | None:
        return completion_logprobs(self.endpoint, self.response, choice)

    def finish_reason(self) -> str | None:
        return finish_reason(self.response)


@dataclass(frozen=True)
class FailedCall:
    """A model call that got no answer: refused (a prompt too long: 400), failed at the policy
    server, or broken mid-stream. Kept so a user sees why an agent got nothing; never trained
    on."""

    call_id: str
    rollout_id: str
    attempt: int
    protocol: str
    status: int
    error: str
    latency_ms: float
    retry_count: int
    upstream: str | None
    created_at: float

    def summary(self) -> str:
        return f"{self.status} ({self.protocol}): {self.error[:300]}"


class TrajectoryStore(Protocol):
    async def append(self, record: CallRecord) -> CallRecord:
        """Durably add a call; the store assigns `sequence`. Returns the record as stored.
        Only then may the gateway signal the call and answer the agent."""

    async def read(
        self, rollout_id: str, attempt: int | None = None, call_ids: list[str] | None = None
    ) -> list[CallRecord]:
        """The calls of a rollout (one attempt, or all), in order, whole; with `call_ids`, only
        those (the committed calls a RolloutResult names)."""

    def ref(self, record: CallRecord) -> str:
        """A string that locates the record (goes into the ModelCallEvent)."""

    async def delivered(self, rollout_id: str, attempt: int) -> int:
        """The highest sequence whose event reached the workflow (-1: none yet)."""

    async def mark_delivered(self, rollout_id: str, attempt: int, sequence: int) -> None:
        """Remember that events up to `sequence` reached the workflow."""

    def forget(self, rollout_id: str, attempt: int) -> None:
        """The attempt has ended: drop what is cached for appending to it."""

    async def record_incident(self, rollout_id: str, attempt: int, what: str) -> None:
        """Durably note that DARL's infrastructure failed the attempt's agent (a 5xx the
        gateway answered it), for whichever gateway closes the attempt."""

    async def incidents(self, rollout_id: str, attempt: int) -> list[str]:
        """The attempt's recorded incidents, oldest first."""

    async def record_event(
        self, rollout_id: str, attempt: int, event: dict[str, Any]
    ) -> dict[str, Any]:
        """Durably keep an event the attempt's agent sent (Agent Lightning's events other than
        rewards); returns it as stored (with its timestamp)."""

    async def events(self, rollout_id: str, attempt: int) -> list[dict[str, Any]]:
        """The attempt's recorded events, oldest first."""

    async def record_failed_call(self, failure: FailedCall) -> None:
        """Durably note a model call of the attempt that got no answer."""

    async def failed_calls(self, rollout_id: str, attempt: int) -> list[FailedCall]:
        """The attempt's failed calls, oldest first."""

    async def mark_closed(self, rollout_id: str, attempt: int) -> None:
        """Remember that the attempt's agent ended: its calls are refused from now on, also
        by a gateway that starts later."""

    async def is_closed(self, rollout_id: str, attempt: int) -> bool:
        """Whether `mark_closed` was called for the attempt."""


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class _Tail:
    """What the next delta is taken against: the previous call of the attempt."""

    next_sequence: int = 0
    loaded: bool = False
    # Appends holding or waiting for the lock: a tail in use is never evicted, or a fresh one
    # would reload the file without the record being written and reuse its sequence.
    users: int = 0
    context_ids: list[int] = field(default_factory=list)
    messages: list[Any] = field(default_factory=list)
    prompt_text: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def advance(self, record: CallRecord) -> None:
        self.next_sequence = record.sequence + 1
        self.context_ids = record.prompt_token_ids + record.completion_token_ids()
        self.messages = list(record.request.get("messages") or [])
        prompt = record.request.get("prompt")
        self.prompt_text = prompt if isinstance(prompt, str) else ""


class DirectoryTrajectoryStore:
    """`<root>/<rollout_id>/attempt-<n>.jsonl`, one line per call, written with one append.

    `fsync=True` makes a record survive a machine crash, at the price of a disk flush per call;
    without it a record survives any process crash (it is in the page cache when append returns).
    """

    def __init__(self, root: Path, fsync: bool = False, cached_attempts: int = 4096) -> None:
        self.root = root
        self.fsync = fsync
        self._cached_attempts = cached_attempts
        self._tails: OrderedDict[tuple[str, int], _Tail] = OrderedDict()

    def path(self, rollout_id: str, attempt: int) -> Path:
        return self.root / rollout_id / f"attempt-{attempt}.jsonl"

    def ref(self, record: CallRecord) -> str:
        return f"{self.path(record.rollout_id, record.attempt)}#{record.sequence}"

    async def append(self, record: CallRecord) -> CallRecord:
        tail = self._tail(record.rollout_id, record.attempt)
        tail.users += 1
        try:
            return await self._append(tail, record)
        finally:
            tail.users -= 1

    async def _append(self, tail: _Tail, record: CallRecord) -> CallRecord:
        async with tail.lock:
            if not tail.loaded:
                self._reload(record.rollout_id, record.attempt, tail)
            stored = replace(record, sequence=tail.next_sequence)
            line = json.dumps(self._encode(stored, tail), separators=(",", ":")) + "\n"
            path = self.path(record.rollout_id, record.attempt)
            if self.fsync:
                await asyncio.to_thread(self._write, path, line.encode())
            else:
                self._write(path, line.encode())
            tail.advance(stored)
        return stored

    async def read(
        self, rollout_id: str, attempt: int | None = None, call_ids: list[str] | None = None
    ) -> list[CallRecord]:
        return await asyncio.to_thread(self.read_sync, rollout_id, attempt, call_ids)

    def read_sync(
        self, rollout_id: str, attempt: int | None = None, call_ids: list[str] | None = None
    ) -> list[CallRecord]:
        if attempt is None:
            attempts = sorted(
                int(p.stem.removeprefix("attempt-"))
                for p in (self.root / rollout_id).glob("attempt-*.jsonl")
            )
        else:
            attempts = [attempt]
        records = [r for a in attempts for r in self._decode_file(self.path(rollout_id, a))]
        if call_ids is None:
            return records
        by_id = {r.call_id: r for r in records}
        missing = [c for c in call_ids if c not in by_id]
        if missing:
            raise KeyError(f"store has no record of calls {missing[:5]} of {rollout_id}")
        return sorted((by_id[c] for c in call_ids), key=lambda r: (r.attempt, r.sequence))

    async def delivered(self, rollout_id: str, attempt: int) -> int:
        try:
            return int(self._delivered_path(rollout_id, attempt).read_text())
        except FileNotFoundError:
            return -1

    async def mark_delivered(self, rollout_id: str, attempt: int, sequence: int) -> None:
        path = self._delivered_path(rollout_id, attempt)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(str(sequence))
        os.replace(tmp, path)

    def _delivered_path(self, rollout_id: str, attempt: int) -> Path:
        return self.root / rollout_id / f"attempt-{attempt}.delivered"

    # Beside each attempt's calls, append-only JSON-lines files of what else it needs kept:
    # its incidents, its agent's events, its failed calls. Not `.jsonl`: `read` takes every
    # `attempt-*.jsonl` for a file of calls.

    def side_path(self, rollout_id: str, attempt: int, kind: str) -> Path:
        return self.root / rollout_id / f"attempt-{attempt}.{kind}"

    async def _append_line(self, path: Path, value: dict[str, Any]) -> None:
        line = json.dumps(value, separators=(",", ":")) + "\n"
        # After a torn last line (a crash mid-write, never answered), start on a line of its own.
        data = (b"\n" if _ends_torn(path) else b"") + line.encode()
        if self.fsync:
            await asyncio.to_thread(self._write, path, data)
        else:
            self._write(path, data)

    @staticmethod
    def _read_lines(path: Path) -> list[dict[str, Any]]:
        """The file's lines, less a torn one (a crash mid-write: what it said was never
        answered, so never relied on)."""
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            return []
        found = []
        for line in lines:
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                found.append(value)
        return found

    async def record_incident(self, rollout_id: str, attempt: int, what: str) -> None:
        path = self.side_path(rollout_id, attempt, "incidents")
        await self._append_line(path, {"at": time.time(), "what": what})

    async def incidents(self, rollout_id: str, attempt: int) -> list[str]:
        lines = self._read_lines(self.side_path(rollout_id, attempt, "incidents"))
        return [str(line["what"]) for line in lines if "what" in line]

    def events_path(self, rollout_id: str, attempt: int) -> Path:
        return self.side_path(rollout_id, attempt, "events")

    async def record_event(
        self, rollout_id: str, attempt: int, event: dict[str, Any]
    ) -> dict[str, Any]:
        stored = {**event, "timestamp": time.time()}
        await self._append_line(self.events_path(rollout_id, attempt), stored)
        return stored

    async def events(self, rollout_id: str, attempt: int) -> list[dict[str, Any]]:
        return self._read_lines(self.events_path(rollout_id, attempt))

    async def record_failed_call(self, failure: FailedCall) -> None:
        path = self.side_path(failure.rollout_id, failure.attempt, "failed")
        await self._append_line(path, asdict(failure))

    async def failed_calls(self, rollout_id: str, attempt: int) -> list[FailedCall]:
        lines = self._read_lines(self.side_path(rollout_id, attempt, "failed"))
        return [FailedCall(**line) for line in lines]

    async def mark_closed(self, rollout_id: str, attempt: int) -> None:
        path = self.root / rollout_id / f"attempt-{attempt}.closed"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()

    async def is_closed(self, rollout_id: str, attempt: int) -> bool:
        return (self.root / rollout_id / f"attempt-{attempt}.closed").exists()

    def forget(self, rollout_id: str, attempt: int) -> None:
        """Drop the cached tail of a finished attempt (the file stays)."""
        tail = self._tails.get((rollout_id, attempt))
        if tail is not None and tail.users == 0:
            del self._tails[(rollout_id, attempt)]

    # --- encoding ------------------------------------------------------------------------

    def _encode(self, record: CallRecord, tail: _Tail) -> dict[str, Any]:
        base = _common_prefix(tail.context_ids, record.prompt_token_ids)
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
            "prompt_ids": {"base": base, "ids": record.prompt_token_ids[base:]},
            "request": request,
            "response": _without_prompt_ids(record.endpoint, record.response),
        }
        if record.protocol != record.endpoint:
            line["protocol"] = record.protocol
        if record.exchange:
            line["exchange"] = record.exchange
        if messages is not None:
            kept = _common_prefix(tail.messages, messages)
            line["messages"] = {"base": kept, "items": messages[kept:]}
        if isinstance(prompt, str):
            kept = _common_prefix(tail.prompt_text, prompt)
            line["prompt_text"] = {"base": kept, "text": prompt[kept:]}
        elif prompt is not None:
            line["prompt"] = prompt
        return line

    def _decode_file(self, path: Path) -> list[CallRecord]:
        try:
            lines = path.read_bytes().splitlines()
        except FileNotFoundError:
            return []
        tail = _Tail()
        records = []
        for number, raw in enumerate(lines, 1):
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                if number == len(lines):
                    log.warning("%s: ignoring a torn last line (a crash mid-write)", path)
                    break
                raise
            record = self._decode(line, tail)
            tail.advance(record)
            records.append(record)
        return records

    @staticmethod
    def _decode(line: dict[str, Any], tail: _Tail) -> CallRecord:
        if line.get("v") != FORMAT_VERSION:
            raise ValueError(f"unknown trajectory record version {line.get('v')!r}")
        delta = line["prompt_ids"]
        prompt_ids = tail.context_ids[: delta["base"]] + delta["ids"]
        request = dict(line["request"])
        if "messages" in line:
            m = line["messages"]
            request["messages"] = tail.messages[: m["base"]] + m["items"]
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
            response=_with_prompt_ids(endpoint, line["response"], prompt_ids),
            prompt_token_ids=prompt_ids,
            protocol=line.get("protocol", endpoint),
            exchange=line.get("exchange") or {},
        )

    # --- files and the tail cache --------------------------------------------------------

    def _tail(self, rollout_id: str, attempt: int) -> _Tail:
        key = (rollout_id, attempt)
        tail = self._tails.get(key)
        if tail is None:
            tail = self._tails[key] = _Tail()
            for old in list(self._tails):  # least recently used first
                if len(self._tails) <= self._cached_attempts:
                    break
                if old != key and self._tails[old].users == 0:
                    del self._tails[old]
        else:
            self._tails.move_to_end(key)
        return tail

    def _reload(self, rollout_id: str, attempt: int, tail: _Tail) -> None:
        """After a restart (or eviction) the tail is rebuilt from the file itself. A torn last
        line (a crash mid-write: its call was never signalled nor answered) is cut off, so the
        next record starts on a line of its own."""
        path = self.path(rollout_id, attempt)
        if path.exists():
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):
                log.warning("%s: cutting off a torn last line", path)
                os.truncate(path, data.rfind(b"\n") + 1)
        records = self._decode_file(path)
        if records:
            tail.advance(records[-1])
        tail.loaded = True

    def _write(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)


def _ends_torn(path: Path) -> bool:
    """Whether the file's last line has no newline (an append cut short)."""
    try:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except (FileNotFoundError, OSError):
        return False


def _without_prompt_ids(endpoint: Endpoint, response: dict[str, Any]) -> dict[str, Any]:
    if endpoint == CHAT:
        return {k: v for k, v in response.items() if k != "prompt_token_ids"}
    choices = [
        {k: v for k, v in choice.items() if k != "prompt_token_ids"}
        for choice in response.get("choices") or []
    ]
    return {**response, "choices": choices}


def _with_prompt_ids(
    endpoint: Endpoint, response: dict[str, Any], ids: list[int]
) -> dict[str, Any]:
    if endpoint == CHAT:
        return {**response, "prompt_token_ids": ids}
    choices = [{**choice, "prompt_token_ids": ids} for choice in response.get("choices") or []]
    return {**response, "choices": choices}
