"""An attempt's close against its appends, in both stores: a replica that had not seen the close
cannot append after it, a close before any call leaves no attempt of calls, and under appends
racing a close every call is either in what the close reads or refused, never written after
it. On a directory, an append that holds the attempt's lock when the close comes finishes
first and is in the close's read."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from darl.gateway.store import directory
from darl.gateway.store.base import AttemptClosedError, TrajectoryStore
from darl.gateway.store.codec import Tail
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.gateway.store.s3 import S3TrajectoryStore
from tests.unit.test_trajectory_store import Backend, conversation

HOLD_SECONDS = 30


@pytest.fixture(params=["directory", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A place in one store (a directory, a prefix of a bucket) and replicas' stores over it."""
    if request.param == "directory":
        return Backend("directory", lambda: tmp_path, DirectoryTrajectoryStore)
    bucket = request.getfixturevalue("s3_bucket")
    return Backend("s3", lambda: "close", lambda prefix: S3TrajectoryStore(bucket, prefix))


def calls(n: int, attempt: int = 1, writer: str = "w") -> list[CallRecord]:
    return [
        replace(r, call_id=f"{writer}-{r.call_id}", attempt=attempt)
        for r in conversation([(True, [1, 2], [3])] * n)
    ]


async def test_a_replica_that_had_not_seen_the_close_cannot_append_after_it(
    backend: Backend,
) -> None:
    place = backend.fresh()
    a, b = backend.open(place), backend.open(place)
    first, late = calls(2)
    await a.append(first)  # a's tail now says the next sequence is 1
    await b.mark_closed("r1", 1)
    with pytest.raises(AttemptClosedError):
        await a.append(late)
    with pytest.raises(AttemptClosedError):
        await backend.open(place).append(late)  # a gateway started later
    assert [r.call_id for r in await b.read("r1", 1)] == [first.call_id]
    assert await a.is_closed("r1", 1) and await a.attempts("r1") == [1]


async def test_a_close_before_any_call_is_kept_and_leaves_no_attempt_of_calls(
    backend: Backend,
) -> None:
    place = backend.fresh()
    store = backend.open(place)
    await store.mark_closed("r1", 1)
    await backend.open(place).mark_closed("r1", 1)  # a retried close, on another replica
    (call,) = calls(1)
    with pytest.raises(AttemptClosedError):
        await store.append(call)
    assert await store.read("r1") == [] and await store.attempts("r1") == []
    assert await backend.open(place).is_closed("r1", 1)
    later = await store.append(replace(call, attempt=2))
    assert later.sequence == 0 and await store.attempts("r1") == [2]


async def test_appends_racing_a_close_are_in_its_read_or_refused(backend: Backend) -> None:
    """Three replicas append while a fourth closes: what the close reads is what the store
    keeps, every call it lacks was refused, every refusal is a call it lacks."""
    place = backend.fresh()
    writers = [backend.open(place) for _ in range(3)]
    closer = backend.open(place)
    await writers[0].append(calls(1, writer="before")[0])

    async def append_all(store: TrajectoryStore, records: list[CallRecord]) -> list[str]:
        refused = []
        for record in records:
            try:
                await store.append(record)
            except AttemptClosedError:
                refused.append(record.call_id)
        return refused

    async def close_and_read() -> list[CallRecord]:
        await closer.mark_closed("r1", 1)
        return await closer.read("r1", 1)

    appending = [append_all(store, calls(8, writer=f"w{i}")) for i, store in enumerate(writers)]
    *refusals, closed_read = await asyncio.gather(*appending, close_and_read())
    kept = await backend.open(place).read("r1", 1)
    assert [r.call_id for r in kept] == [r.call_id for r in closed_read]
    refused = {call_id for each in refusals for call_id in each}
    sent = {r.call_id for i in range(3) for r in calls(8, writer=f"w{i}")}
    assert refused == sent - {r.call_id for r in kept}
    assert [r.sequence for r in kept] == list(range(len(kept)))


async def test_an_append_holding_the_lock_when_the_close_comes_is_in_its_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The append (fsync: on a thread) holds the attempt file's lock until the close starts
    to take it; the close then waits for it, so its read has the call."""
    close_locking = threading.Event()
    appending_locked = threading.Event()

    class HeldUnderLock(DirectoryTrajectoryStore):
        def _catch_up(self, fd: int, path: str, tail: Tail) -> None:
            appending_locked.set()
            if not close_locking.wait(HOLD_SECONDS):
                raise TimeoutError("the close never came for the lock")
            super()._catch_up(fd, path, tail)

    take_lock = directory._lock

    async def the_close_takes_the_lock(fd: int) -> None:
        close_locking.set()
        await take_lock(fd)

    writer = HeldUnderLock(tmp_path, fsync=True)
    closer = DirectoryTrajectoryStore(tmp_path)
    await closer.append(calls(1, writer="first")[0])
    (held,) = calls(1, writer="held")
    appending = asyncio.create_task(writer.append(held))
    await asyncio.wait_for(asyncio.to_thread(appending_locked.wait, HOLD_SECONDS), HOLD_SECONDS)
    monkeypatch.setattr(directory, "_lock", the_close_takes_the_lock)
    await asyncio.wait_for(closer.mark_closed("r1", 1), HOLD_SECONDS)
    closed_read = await closer.read("r1", 1)
    stored = await asyncio.wait_for(appending, HOLD_SECONDS)
    assert [r.call_id for r in closed_read] == ["first-c0", held.call_id]
    assert stored.sequence == 1
