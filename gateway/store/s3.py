"""The trajectory store in an S3-compatible object store, shared by any number of gateway
replicas: one object per call under a per-sequence key written with `If-None-Match: *`, so two
replicas can never take the same sequence, and one object per side entry.

Keys, under `<prefix>`:
    <rollout>/calls/attempt-<n>/<sequence, 10 digits>.json      a call (its stored form), or
                                                                 empty: the attempt's close
    <rollout>/attempt-<n>/<incidents|events|failed>/<ns>-<id>.json   one side entry each
    <rollout>/attempt-<n>/delivered/<9999999999 - sequence>      the first key is the mark
    <rollout>/attempt-<n>/closed
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import time
import uuid
from dataclasses import asdict, replace
from typing import Any

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, PreconditionError
from obstore.store import S3Store

from darl.gateway.store.base import StoreUnavailableError
from darl.gateway.store.codec import (
    Tail,
    TailCache,
    check_append,
    decode_into,
    encode_line,
    select_calls,
)
from darl.gateway.store.record import CallRecord, FailedCall

MAX_SEQUENCE = 9_999_999_999
# GETs in flight at once when an attempt's calls or side entries are read.
READ_CONCURRENCY = 32
# After a conditional write lost to one still in flight (its object not readable yet), wait
# this long before the next try, doubled each time.
CONFLICT_BACKOFF_SECONDS = 0.005


def s3_object_store(bucket: str, prefix: str, endpoint_url: str | None = None) -> S3Store:
    """An obstore S3Store over `s3://bucket/prefix`: region, credentials and endpoint from the
    usual `AWS_*` variables (`AWS_ENDPOINT_URL` for an S3-compatible server) unless
    `endpoint_url` is given. Plain HTTP is allowed only to an `http://` endpoint named so."""
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
    config: dict[str, Any] = {"endpoint": endpoint} if endpoint_url else {}
    allow_http = bool(endpoint and endpoint.startswith("http://"))
    return S3Store(
        bucket,
        prefix=prefix.strip("/") or None,
        client_options={"allow_http": allow_http},
        **config,
    )


class S3TrajectoryStore:
    """`s3://<bucket>/<prefix>` (see `s3_object_store` for where its settings come from).
    `append` returns once the call's PUT succeeded, so a record is as durable as the object
    store makes it. No group commit: one PUT per call.

    The client is obstore's (Rust's object_store): its requests cost about a fifth of the CPU
    of botocore's, and it serves any event loop and plain threads alike."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        cached_attempts: int = 4096,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self._s3 = s3_object_store(bucket, prefix, endpoint_url)
        self._tails = TailCache(cached_attempts)

    # --- keys (relative to the prefix) ---------------------------------------------------

    @staticmethod
    def _calls_prefix(rollout_id: str, attempt: int) -> str:
        return f"{rollout_id}/calls/attempt-{attempt}/"

    def _call_key(self, rollout_id: str, attempt: int, sequence: int) -> str:
        return f"{self._calls_prefix(rollout_id, attempt)}{sequence:010d}.json"

    @staticmethod
    def _attempt_prefix(rollout_id: str, attempt: int) -> str:
        return f"{rollout_id}/attempt-{attempt}/"

    def _url(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix + '/' if self.prefix else ''}{key}"

    def ref(self, record: CallRecord) -> str:
        return self._url(self._call_key(record.rollout_id, record.attempt, record.sequence))

    def where(self, rollout_id: str) -> str:
        return self._url(f"{rollout_id}/")

    async def check(self) -> None:
        try:
            await obstore.list_with_delimiter_async(self._s3, None)
        except BaseError as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise StoreUnavailableError(
                f"cannot list {self._url('')} (does the bucket exist, and may these "
                f"credentials list it?): {first}"
            ) from err

    async def aclose(self) -> None:
        return None  # obstore's connections close with the store object

    # --- objects -------------------------------------------------------------------------

    async def _get(self, key: str) -> bytes | None:
        try:
            found = await obstore.get_async(self._s3, key)
        except FileNotFoundError:
            return None
        return bytes(await found.bytes_async())

    async def _get_many(self, keys: list[str]) -> list[bytes]:
        """The objects, in the order of `keys` (skipping any deleted since listed)."""
        limit = asyncio.Semaphore(READ_CONCURRENCY)

        async def one(key: str) -> bytes | None:
            async with limit:
                return await self._get(key)

        found = await asyncio.gather(*(one(k) for k in keys))
        return [data for data in found if data is not None]

    async def _keys(self, prefix: str) -> list[str]:
        """The keys under `prefix` (ending in "/"), in key order."""
        listed = await obstore.list(self._s3, prefix, chunk_size=1000).collect_async()
        return sorted(item["path"] for item in listed)

    async def _put(self, key: str, body: bytes) -> None:
        await obstore.put_async(self._s3, key, body)

    # --- calls ---------------------------------------------------------------------------

    async def append(self, record: CallRecord) -> CallRecord:
        async with self._tails.hold(record.rollout_id, record.attempt) as tail:
            if not tail.loaded:
                await self._load(tail, record.rollout_id, record.attempt)
            backoff = CONFLICT_BACKOFF_SECONDS
            while True:
                # The tail has read every sequence below the one this PUT takes, so what it
                # says (a close among them) holds for the record written there.
                check_append(tail, record)
                stored = replace(record, sequence=tail.next_sequence)
                key = self._call_key(record.rollout_id, record.attempt, stored.sequence)
                try:
                    # If-None-Match: *, so only one writer ever takes a sequence.
                    await obstore.put_async(self._s3, key, encode_line(stored, tail), mode="create")
                except (AlreadyExistsError, PreconditionError):
                    # Another replica took the sequence: read what it wrote, then try the next.
                    before = tail.next_sequence
                    mine = await self._catch_up(tail, record.rollout_id, record.attempt, record)
                    if mine is not None:
                        return mine
                    if tail.next_sequence == before:  # its write is not readable yet
                        await asyncio.sleep(backoff)
                        backoff *= 2
                    continue
                tail.advance(stored)
                return stored

    async def _load(self, tail: Tail, rollout_id: str, attempt: int) -> None:
        """Rebuild a cold tail (a restart, an eviction, a replica new to the attempt) from
        every call of the attempt: each prompt is a delta against the one before."""
        tail.reset()
        keys = await self._keys(self._calls_prefix(rollout_id, attempt))
        for data in await self._get_many(keys):
            _read_into(tail, data)
        tail.loaded = True

    async def _catch_up(
        self, tail: Tail, rollout_id: str, attempt: int, record: CallRecord | None
    ) -> CallRecord | None:
        """Read the calls other replicas wrote past the tail, one key at a time. Returns the
        stored form of `record` when one of them is it (a PUT that succeeded but whose answer
        was lost, then retried by the client into a 412)."""
        while True:
            data = await self._get(self._call_key(rollout_id, attempt, tail.next_sequence))
            if data is None:
                return None
            found = _read_into(tail, data)
            if found is None:  # the close: only answers their agents never received follow
                return None
            if record is not None and found.call_id == record.call_id:
                return found

    async def read(
        self, rollout_id: str, attempt: int | None = None, call_ids: list[str] | None = None
    ) -> list[CallRecord]:
        attempts = await self._listed_attempts(rollout_id) if attempt is None else [attempt]
        records: list[CallRecord] = []
        for number in attempts:
            keys = await self._keys(self._calls_prefix(rollout_id, number))
            tail = Tail()
            for data in await self._get_many(keys):
                found = _read_into(tail, data)
                if found is not None:
                    records.append(found)
        return select_calls(records, rollout_id, call_ids)

    def read_sync(
        self, rollout_id: str, attempt: int | None = None, call_ids: list[str] | None = None
    ) -> list[CallRecord]:
        # obstore's futures need no particular loop: a loop of this call's own, on a thread
        # of its own when this thread runs one already (a test's, say).
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.read(rollout_id, attempt, call_ids))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, self.read(rollout_id, attempt, call_ids)).result()

    async def attempts(self, rollout_id: str) -> list[int]:
        listed = await self._listed_attempts(rollout_id)
        # An attempt closed before any call holds only the close, an empty first object, and
        # maybe answers its agent never received after it.
        sizes = await asyncio.gather(*(self._holds_calls(rollout_id, n) for n in listed))
        return [n for n, size in zip(listed, sizes, strict=True) if size]

    async def _holds_calls(self, rollout_id: str, attempt: int) -> bool:
        return any([await self._size(self._call_key(rollout_id, attempt, n)) for n in (0, 1)])

    async def _listed_attempts(self, rollout_id: str) -> list[int]:
        """The attempts with objects under `calls/`, a close's alone among them."""
        prefix = f"{rollout_id}/calls/"
        listed = await obstore.list_with_delimiter_async(self._s3, prefix)
        numbers = []
        for common in listed["common_prefixes"]:
            suffix = common.rstrip("/").rsplit("/", 1)[-1].removeprefix("attempt-")
            if suffix.isdigit():
                numbers.append(int(suffix))
        return sorted(numbers)

    async def _size(self, key: str) -> int:
        """The object's size in bytes; 0 for none."""
        try:
            meta = await obstore.head_async(self._s3, key)
        except FileNotFoundError:
            return 0
        return int(meta["size"])

    def forget(self, rollout_id: str, attempt: int) -> None:
        """Drop the cached tail of a finished attempt (the objects stay)."""
        self._tails.forget(rollout_id, attempt)

    # --- delivery and closing ------------------------------------------------------------

    async def delivered(self, rollout_id: str, attempt: int) -> int:
        # One object per mark, named so the highest sorts first: a mark never goes back,
        # whichever replica writes which mark when.
        keys = await self._keys(self._attempt_prefix(rollout_id, attempt) + "delivered/")
        if not keys:
            return -1
        return MAX_SEQUENCE - int(keys[0].rsplit("/", 1)[1])

    async def mark_delivered(self, rollout_id: str, attempt: int, sequence: int) -> None:
        name = f"{MAX_SEQUENCE - sequence:010d}"
        await self._put(f"{self._attempt_prefix(rollout_id, attempt)}delivered/{name}", b"")

    async def mark_closed(self, rollout_id: str, attempt: int) -> None:
        """The close takes the attempt's next sequence, as a call does (If-None-Match: *),
        with an empty object: an append either took a sequence below it, and is in what a
        read after this returns, or meets it where it would write, and is refused. Then the
        `closed` object, which `is_closed` looks at with one HEAD. The calls are listed, not
        read: the close's read of them follows."""
        listed = await obstore.list(
            self._s3, self._calls_prefix(rollout_id, attempt), chunk_size=1000
        ).collect_async()
        if not any(item["size"] == 0 for item in listed):
            names = (item["path"].rsplit("/", 1)[1] for item in listed)
            last = max((int(name.removesuffix(".json")) for name in names), default=-1)
            await self._close_at(rollout_id, attempt, last + 1)
        await self._put(self._attempt_prefix(rollout_id, attempt) + "closed", b"")

    async def _close_at(self, rollout_id: str, attempt: int, sequence: int) -> None:
        """Write the close's empty object at `sequence`, or past the calls written there
        since; done when a close (another replica's) is found first."""
        backoff = CONFLICT_BACKOFF_SECONDS
        while True:
            key = self._call_key(rollout_id, attempt, sequence)
            try:
                await obstore.put_async(self._s3, key, b"", mode="create")
                return
            except (AlreadyExistsError, PreconditionError):
                found = await self._get(key)
            if found is None:  # its write is not readable yet
                await asyncio.sleep(backoff)
                backoff *= 2
            elif not found:
                return
            else:
                sequence += 1

    async def is_closed(self, rollout_id: str, attempt: int) -> bool:
        try:
            await obstore.head_async(self._s3, self._attempt_prefix(rollout_id, attempt) + "closed")
        except FileNotFoundError:
            return False
        return True

    # --- side entries: one object each, in the order their keys sort (time, then id) ------

    async def _add_entry(self, rollout_id: str, attempt: int, kind: str, value: Any) -> None:
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.json"
        key = f"{self._attempt_prefix(rollout_id, attempt)}{kind}/{name}"
        await self._put(key, json.dumps(value, separators=(",", ":")).encode())

    async def _entries(self, rollout_id: str, attempt: int, kind: str) -> list[dict[str, Any]]:
        keys = await self._keys(f"{self._attempt_prefix(rollout_id, attempt)}{kind}/")
        return [json.loads(data) for data in await self._get_many(keys)]

    async def record_incident(self, rollout_id: str, attempt: int, what: str) -> None:
        await self._add_entry(rollout_id, attempt, "incidents", {"at": time.time(), "what": what})

    async def incidents(self, rollout_id: str, attempt: int) -> list[str]:
        entries = await self._entries(rollout_id, attempt, "incidents")
        return [str(entry["what"]) for entry in entries if "what" in entry]

    async def record_event(
        self, rollout_id: str, attempt: int, event: dict[str, Any]
    ) -> dict[str, Any]:
        stored = {**event, "timestamp": time.time()}
        await self._add_entry(rollout_id, attempt, "events", stored)
        return stored

    async def events(self, rollout_id: str, attempt: int) -> list[dict[str, Any]]:
        return await self._entries(rollout_id, attempt, "events")

    async def record_failed_call(self, failure: FailedCall) -> None:
        await self._add_entry(failure.rollout_id, failure.attempt, "failed", asdict(failure))

    async def failed_calls(self, rollout_id: str, attempt: int) -> list[FailedCall]:
        entries = await self._entries(rollout_id, attempt, "failed")
        return [FailedCall(**entry) for entry in entries]


def _read_into(tail: Tail, data: bytes) -> CallRecord | None:
    """Advance `tail` past one object of the attempt's sequences: a call (returned), or the
    empty object of its close (None)."""
    if not data:
        tail.close_at_next_sequence()
        return None
    return decode_into(tail, json.loads(data))
