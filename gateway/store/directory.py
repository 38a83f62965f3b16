"""`DirectoryTrajectoryStore`: the trajectory store as one append-only JSONL file per rollout
attempt, safe for several gateway replicas sharing the directory."""

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
from typing import Any

from darl.files import write_atomically
from darl.gateway import json_codec
from darl.gateway.store.base import AppendRefusedError, StoreUnavailableError
from darl.gateway.store.codec import (
    Tail,
    TailCache,
    check_append,
    decode_into,
    encode_line,
    select_calls,
)
from darl.gateway.store.record import CallRecord, FailedCall

log = logging.getLogger(__name__)


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
        # The root as a string: the paths every call touches are joined as strings (a pathlib
        # join costs more than the system call it names).
        self._prefix = str(root)

    def path(self, rollout_id: str, attempt: int) -> Path:
        return Path(self._file(rollout_id, attempt, "jsonl"))

    def _file(self, rollout_id: str, attempt: int, kind: str) -> str:
        return f"{self._prefix}/{rollout_id}/attempt-{attempt}.{kind}"

    def ref(self, record: CallRecord) -> str:
        return f"{self._file(record.rollout_id, record.attempt, 'jsonl')}#{record.sequence}"

    def where(self, rollout_id: str) -> str:
        return str(self.root / rollout_id)

    async def check(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StoreUnavailableError(f"{self.root} is not a directory")

    async def aclose(self) -> None:
        return None

    async def append(self, record: CallRecord) -> CallRecord:
        path = self._file(record.rollout_id, record.attempt, "jsonl")
        async with self._tails.hold(record.rollout_id, record.attempt) as tail:
            while True:
                if self.fsync:
                    stored = await asyncio.to_thread(self._append_blocking, path, tail, record)
                else:
                    with _open_for_append(path) as fd:
                        await _lock(fd)
                        stored = self._append_locked(fd, path, tail, record)
                if stored is not None:
                    return stored

    def _append_blocking(self, path: str, tail: Tail, record: CallRecord) -> CallRecord | None:
        with _open_for_append(path) as fd:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return self._append_locked(fd, path, tail, record)

    def _append_locked(
        self, fd: int, path: str, tail: Tail, record: CallRecord
    ) -> CallRecord | None:
        """The record as written; None when the empty file this append opened was removed
        while it waited for the lock (by a close, or a refused append: `_unlink_if_empty`),
        so the caller opens the attempt's file again: a call written there would be lost."""
        if os.fstat(fd).st_size == 0 and not _still_at(fd, path):
            return None
        self._catch_up(fd, path, tail)
        # Looked at under the lock `mark_closed` takes: a close either waits for this append
        # (and reads its call) or has left its mark, and the call is refused (unless its agent
        # never received it: see `check_append`).
        if os.path.exists(self._file(record.rollout_id, record.attempt, "closed")):
            tail.closed = True
        try:
            check_append(tail, record)
        except AppendRefusedError:
            _unlink_if_empty(fd, path)
            raise
        stored = replace(record, sequence=tail.next_sequence)
        line = encode_line(stored, tail)
        os.write(fd, line)
        if self.fsync:
            os.fsync(fd)
        tail.advance(stored)
        tail.position += len(line)
        return stored

    def _catch_up(self, fd: int, path: str, tail: Tail) -> None:
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
                decode_into(tail, json_codec.loads(raw))
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
            write_atomically(path, str(sequence))

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
        # Under the attempt file's lock, which every append holds from its look at the mark
        # to its write: no call is written after the mark, none slips between a close's mark
        # and its read of the calls.
        calls = self._file(rollout_id, attempt, "jsonl")
        with _open_for_append(calls) as fd:
            await _lock(fd)
            closed = self._file(rollout_id, attempt, "closed")
            mark = os.open(closed, os.O_WRONLY | os.O_CREAT, 0o644)
            os.close(mark)
            _unlink_if_empty(fd, calls)

    async def is_closed(self, rollout_id: str, attempt: int) -> bool:
        # One stat (a few microseconds): cheaper than the hop to a thread that would hide it.
        return os.path.exists(self._file(rollout_id, attempt, "closed"))  # noqa: ASYNC240

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
def _open_for_append(path: str | Path) -> Iterator[int]:
    """The attempt's file for reading and appending (closing it releases its lock); its
    directory is made when the file's first open finds none."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, flags, 0o644)
    try:
        yield fd
    finally:
        os.close(fd)


def _unlink_if_empty(fd: int, path: str) -> None:
    """Remove the attempt's file of calls, locked through `fd`, if it holds none: made only to
    take its lock (a close, or an append refused), it is no attempt with calls. A process
    that opened it meanwhile finds it gone once it has the lock, and opens the attempt's file
    again (`_append_locked`)."""
    held = os.fstat(fd)
    if held.st_size:
        return
    try:
        if os.stat(path).st_ino == held.st_ino:
            os.unlink(path)
    except FileNotFoundError:  # another refused append removed it first
        return


def _still_at(fd: int, path: str) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


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
            line = json_codec.loads(raw)
        except ValueError:  # not JSON, or cut inside a UTF-8 character
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
