"""Replay decided by the store, not by one replica's memory (rule 10), in both stores: a
recorded call is served at most once and none after the attempt holds a live call, whichever
replica (a store and a replayer of its own, sharing the store's place) serves what, with
their in-memory sessions stale, evicted or rebuilt."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from darl.gateway.calls.delivery import EventDelivery
from darl.gateway.calls.replay import ReplayBook
from darl.gateway.calls.replayer import Replayer
from darl.gateway.calls.rollouts import RolloutRegistry
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.store.base import AlreadyReplayedError, ReplayOverError, TrajectoryStore
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.gateway.store.s3 import S3TrajectoryStore
from darl.workflows.rollout_token import ReplayClaim, TokenClaims
from tests.unit.test_replay import CHAT, record, request, session

ROLLOUT = "r"
REPLAYING = TokenClaims(ROLLOUT, 2, "train", 2**31, replay=ReplayClaim(sources=(1,)))


@pytest.fixture(params=["directory", "s3"])
def replica_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """Opens another replica's store over one place."""
    if request.param == "directory":
        return lambda: DirectoryTrajectoryStore(tmp_path)
    bucket = request.getfixturevalue("s3_bucket")
    return lambda: S3TrajectoryStore(bucket, "replay")


def replica(store: TrajectoryStore, bound: int = 1024) -> Replayer:
    """One gateway's replayer (strict matches only: no policy server to tokenize)."""
    registry = RolloutRegistry(None, store)  # type: ignore[arg-type]
    metrics = GatewayMetrics()
    delivery = EventDelivery(registry, store, metrics, interval_seconds=3600)

    async def no_tokenizer(*_: Any) -> list[int]:
        raise AssertionError("a strict match needs no tokenizer")

    return Replayer(ReplayBook(store, bound), store, registry, delivery, metrics, no_tokenizer)


def reproducing(call_id: str, replayed_from: str | None) -> CallRecord:
    return record(call_id, request(call_id), attempt=2, replayed_from=replayed_from)


async def served(replayer: Replayer, prompt: str) -> str | None:
    """The recorded call the replica served the request from; None: it goes live."""
    answer = await replayer.answer(
        CHAT, REPLAYING, request(prompt), None, stream=False, prompt_ids_asked=False
    )
    return None if answer is None else answer.headers["x-darl-replayed-from"]


def check_store(records: list[CallRecord]) -> None:
    """Counting from the store: each recorded call reproduced at most once, none after the
    attempt's first live call."""
    reproduced = Counter(r.replayed_from for r in records if r.replayed_from is not None)
    assert [c for c, n in reproduced.items() if n > 1] == []
    live = [r.sequence for r in records if r.replayed_from is None]
    if live:
        assert [r.sequence for r in records if r.replayed_from and r.sequence > min(live)] == []


def test_a_session_told_what_the_store_saw_served_offers_none_of_it() -> None:
    same = request("same")
    replay = session(
        [record("a", same), record("b", same, sequence=1), record("c", request("c"), sequence=2)]
    )
    replay.served_elsewhere(frozenset({"a", "c", "of-another-rollout"}))
    assert replay.left == 1
    assert replay.take(CHAT, CHAT, same).recorded.record.call_id == "b"
    assert replay.take(CHAT, CHAT, request("c")) is None


async def test_the_store_refuses_a_second_reproduction_and_any_after_a_live_call(
    replica_store: Any,
) -> None:
    a, b = replica_store(), replica_store()
    await b.append(reproducing("first", "p"))  # b's tail: one call, then left stale
    await a.append(reproducing("from-a", "a"))
    with pytest.raises(AlreadyReplayedError):
        await b.append(reproducing("again", "a"))
    await b.append(reproducing("live", None))
    with pytest.raises(ReplayOverError):
        await a.append(reproducing("late", "b"))
    kept = await replica_store().read(ROLLOUT, 2)
    assert [r.call_id for r in kept] == ["first", "from-a", "live"]
    # A live call after a live call, and calls of other attempts, are nothing to replay.
    await a.append(reproducing("live-2", None))
    await a.append(replace(reproducing("other", "a"), attempt=3))


async def test_two_replicas_serve_each_recorded_call_once_through_evictions_and_a_restart(
    replica_store: Any,
) -> None:
    store = replica_store()
    for i, prompt in enumerate(["same", "same", "same", "same", "x", "y", "z"]):
        await store.append(record(f"rec-{i}", request(prompt), sequence=i))
    a, b = replica(replica_store(), bound=1), replica(replica_store())
    # Concurrent identical requests through both replicas, each with a session of its own.
    first = await asyncio.gather(*(served(r, "same") for r in (a, b, a, b, a, b)))
    assert sorted(c for c in first if c) == ["rec-0", "rec-1", "rec-2", "rec-3"]
    assert first.count(None) == 2
    # a's session evicted (its bound is one session) by another attempt's; b restarted.
    other = TokenClaims(ROLLOUT, 3, "train", 2**31, replay=ReplayClaim(sources=(1,)))
    await a.book.session(other)
    b = replica(replica_store())
    assert await served(a, "x") == "rec-4"
    assert await served(b, "x") is None  # used: goes live
    # A live call recorded through a third replica; a's session has not heard of it.
    await replica_store().append(reproducing("live", None))
    assert await served(a, "y") is None
    assert await served(b, "z") is None
    check_store(await replica_store().read(ROLLOUT, 2))
    assert len([r for r in await store.read(ROLLOUT, 2) if r.replayed_from]) == 5
