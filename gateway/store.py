"""The trajectory store: where the full record of every model call lives (request, response,
token ids, logprobs), so that none of it has to go through workflow history.

`TrajectoryStore` is the interface; `DirectoryTrajectoryStore` keeps one append-only JSONL file
per rollout attempt, `S3TrajectoryStore` (`gateway/s3_store.py`) one object per call. Both store
prompts as deltas (`gateway/store_codec.py`), and both let several gateway replicas append to
one attempt: sequences stay unique and gap-free. `open_store` (`gateway/store_url.py`) picks one
from a URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Protocol

from darl.gateway.call_record import CallRecord, FailedCall
from darl.gateway.store_codec import Tail, TailCache, decode_into, encode_line, select_calls

__all__ = [
    "CallRecord",
    "DirectoryTrajectoryStore",
    "FailedCall",
    "StoreUnavailable",
    "TrajectoryStore",
]

log = logging.getLogger(__name__)


class StoreUnavailable(RuntimeError):
    """The store cannot be used at all (a bucket that does not exist, no credentials)."""


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
        """Remember that events up to `sequence` reached the workflow. The mark never moves
        back: a replica that marks an older sequence after another marked a newer one keeps
        the newer."""

    def read_sync(
        self, rollout_id: str, attempt: int | None = None, call_ids: list[str] | None = None
    ) -> list[CallRecord]:
        """`read` for a caller on a thread of its own (never on an event loop's thread)."""

    async def attempts(self, rollout_id: str) -> list[int]:
        """The attempts of the rollout that have calls in the store, in order."""

    def where(self, rollout_id: str) -> str:
        """Where the rollout's records live, for a message to a person."""

    async def check(self) -> None:
        """Raise `StoreUnavailable` when the store cannot be used (a bucket that does not
        exist, no credentials): called once at start, so a bad store is not a 500 per call."""

    async def aclose(self) -> None:
        """Let go of connections (the store stays usable; it reconnects when used)."""

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


class DirectoryTrajectoryStore:
    """`<root>/<rollout_id>/attempt-<n>.jsonl`, one line per call, written with one append.

    Processes sharing the directory (gateway replicas on one machine or a RWX volume) take an
    exclusive `flock` on the attempt's file around read-check-append; a writer that finds the
    file longer than it left it reads the other writers' lines first, so sequences and
    deltas continue theirs.

    `fsync=True` makes a record survive a machine crash, at the price of a disk flush per call;
    without it a record survives any process crash (it is in the page cache when append returns).
    """

    def __init__(self, root: Path, fsync: bool = False, cached_attempts: int = 4096) -> None:
        self.root = root
        self.fsync = fsync
        self._tails = TailCache(cached_attempts)

    def path(self, rollout_id: str, attempt: int) -> Path:
        return self.root / rollout_id / f"attempt-{attempt}.jsonl"

    def ref(self, record: CallRecord) -> str:
        return f"{self.path(record.rollout_id, record.attempt)}#{record.sequence}"

    def where(self, rollout_id: str) -> str:
        return str(self.root / rollout_id)

    async def check(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StoreUnavailable(f"{self.root} is not a directory")

    async def aclose(self) -> None:
        return None

    async def append(self, record: CallRecord) -> CallRecord:
        path = self.path(record.rollout_id, record.attempt)
        async with self._tails.hold(record.rollout_id, record.attempt) as tail:
            if self.fsync:
                return await asyncio.to_thread(self._append_blocking, path, tail, record)
            with _open_for_append(path) as fd:
                await _lock(fd)
                return self._append_locked(fd, path, tail, record)

    def _append_blocking(self, path: Path, tail: Tail, record: CallRecord) -> CallRecord:
        with _open_for_append(path) as fd:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return self._append_locked(fd, path, tail, record)

    def _append_locked(self, fd: int, path: Path, tail: Tail, record: CallRecord) -> CallRecord:
        self._catch_up(fd, path, tail)
        stored = replace(record, sequence=tail.next_sequence)
        line = encode_line(stored, tail)
        os.write(fd, line)
        if self.fsync:
            os.fsync(fd)
        tail.advance(stored)
        tail.position += len(line)
        return stored

    def _catch_up(self, fd: int, path: Path, tail: Tail) -> None:
        """Bring the tail to the end of the file (the lock held): the whole file after a
        restart or an eviction, else the lines other processes appended since this one last
        wrote. A torn last line (a crash mid-write: its call was never signalled nor
        answered) is cut off, so the next record starts on a line of its own."""
        size = os.fstat(fd).st_size
        if tail.loaded and size == tail.position:
            return
        if not tail.loaded or size < tail.position:
            tail.reset()
        start = tail.position
        data = os.pread(fd, size - start, start)
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning("%s: cutting off a torn last line", path)
            os.ftruncate(fd, start + end)
        for raw in data[:end].splitlines():
            if raw.strip():
                decode_into(tail, json.loads(raw))
        tail.position = start + end
        tail.loaded = True

    async def read(
        self, rollout_id: str, attempt: int | None = None, call_ids: list[str] | None = None
    ) -> list[CallRecord]:
        return await asyncio.to_thread(self.read_sync, rollout_id, attempt, call_ids)

    def read_sync(
        self, rollout_id: str, attempt: int | None = None, call_ids: list[str] | None = None
    ) -> list[CallRecord]:
        attempts = self._attempts(rollout_id) if attempt is None else [attempt]
        records = [r for a in attempts for r in _decode_file(self.path(rollout_id, a))]
        return select_calls(records, rollout_id, call_ids)

    async def attempts(self, rollout_id: str) -> list[int]:
        return self._attempts(rollout_id)

    def _attempts(self, rollout_id: str) -> list[int]:
        numbers = []
        for path in (self.root / rollout_id).glob("attempt-*.jsonl"):
            suffix = path.stem.removeprefix("attempt-")
            if suffix.isdigit():
                numbers.append(int(suffix))
        return sorted(numbers)

    async def delivered(self, rollout_id: str, attempt: int) -> int:
        return _read_delivered(self._delivered_path(rollout_id, attempt))

    async def mark_delivered(self, rollout_id: str, attempt: int, sequence: int) -> None:
        path = self._delivered_path(rollout_id, attempt)
        # Under the attempt file's lock, so two replicas' marks cannot interleave their
        # read-compare-replace and move the mark back.
        with _open_for_append(self.path(rollout_id, attempt)) as fd:
            await _lock(fd)
            if sequence <= _read_delivered(path):
                return
            tmp = path.with_suffix(".tmp")
            tmp.write_text(str(sequence))
            os.replace(tmp, path)

    def _delivered_path(self, rollout_id: str, attempt: int) -> Path:
        return self.root / rollout_id / f"attempt-{attempt}.delivered"

    # Beside each attempt's calls, append-only JSON-lines files of what else it needs kept:
    # its incidents, its agent's events, its failed calls. Not `.jsonl`: `read` takes every
    # `attempt-*.jsonl` for a file of calls. One small O_APPEND write per line, so lines of
    # several processes never interleave.

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
        self._tails.forget(rollout_id, attempt)

    def _write(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _open_for_append(path: Path) -> Iterator[int]:
    """The attempt's file for reading and appending (closing it releases its lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        yield fd
    finally:
        os.close(fd)


async def _lock(fd: int) -> None:
    """An exclusive flock on `fd`; waits for another process's off the event loop."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)


def _read_delivered(path: Path) -> int:
    try:
        return int(path.read_text())
    except FileNotFoundError:
        return -1


def _decode_file(path: Path) -> list[CallRecord]:
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return []
    tail = Tail()
    records = []
    for number, raw in enumerate(lines, 1):
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            if number == len(lines):
                log.warning("%s: ignoring a torn last line (a crash mid-write)", path)
                break
            raise
        records.append(decode_into(tail, line))
    return records


def _ends_torn(path: Path) -> bool:
    """Whether the file's last line has no newline (an append cut short)."""
    try:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except (FileNotFoundError, OSError):
        return False
