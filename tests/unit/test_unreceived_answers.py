"""Answers their agents never received (issue 45, part 4; rule 10): the store keeps them marked
`unreceived`, past the attempt's close too (both backends); they are no part of the attempt's
trajectory (no event, no close's event, not among the trainer's committed calls) and end no
replay; the next attempt is offered them after the received calls of their form, and a request
of a replaying attempt waits for the calls its record's attempts still have at a policy server
before it goes live."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from darl.activities.policy_steps import committed_calls
from darl.gateway.calls.delivery import EventDelivery, event_of
from darl.gateway.calls.in_flight import CallsInFlight
from darl.gateway.calls.model_call import to_the_end
from darl.gateway.calls.replay import ReplayBook, ReplaySession, offered_calls, replay_outcome
from darl.gateway.calls.replayer import Replayer
from darl.gateway.calls.rollouts import RolloutRegistry
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.store.base import AttemptClosedError, TrajectoryStore
from darl.gateway.store.codec import Tail, check_append, decode_record, encode_record
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.gateway.store.s3 import S3TrajectoryStore
from darl.workflows.rollout_token import ReplayClaim, TokenClaims
from tests.unit.test_client_watch import Connection
from tests.unit.test_replay import CHAT, record, request

WAIT = 30


def unreceived(call_id: str, req: dict[str, Any], attempt: int = 1, **fields: Any) -> CallRecord:
    return record(call_id, req, attempt, unreceived=True, **fields)


@pytest.fixture(params=["directory", "s3"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], TrajectoryStore]:
    """Opens a store over one place; each call is another replica (or a restart)."""
    if request.param == "directory":
        return lambda: DirectoryTrajectoryStore(tmp_path)
    bucket = request.getfixturevalue("s3_emulator").new_bucket()
    return lambda: S3TrajectoryStore(bucket, "unreceived")


def test_an_unreceived_answer_reads_back_marked_and_an_old_record_reads_received() -> None:
    kept = unreceived("u", request("a"))
    line = encode_record(kept, Tail())
    assert line["unreceived"] is True
    assert decode_record(line, Tail()) == kept
    old = encode_record(record("a", request("a")), Tail())
    assert "unreceived" not in old
    assert decode_record(old, Tail()).unreceived is False


async def test_an_unreceived_answer_is_kept_past_the_close_a_received_one_is_refused(
    open_store: Callable[[], TrajectoryStore],
) -> None:
    store = open_store()
    await store.append(record("a", request("a")))
    await store.mark_closed("r", 1)
    with pytest.raises(AttemptClosedError):
        await store.append(record("b", request("a", "b")))
    kept = await store.append(unreceived("u", request("a", "b")))
    assert kept.sequence > 0
    for reader in (store, open_store()):  # this replica, and another
        calls = await reader.read("r", 1)
        assert [(r.call_id, r.unreceived) for r in calls] == [("a", False), ("u", True)]
        assert calls[1].request["messages"] == request("a", "b")["messages"]
    # An attempt closed before any call keeps one too.
    await store.mark_closed("r", 2)
    await open_store().append(unreceived("v", request("v"), 2))
    assert [r.call_id for r in await open_store().read("r", 2)] == ["v"]
    assert await open_store().attempts("r") == [1, 2]


def test_an_append_whose_empty_file_was_removed_while_it_waited_opens_it_again(
    tmp_path: Path,
) -> None:
    """A close (or a refused append) removes the attempt's file it made empty; an append that
    opened that file meanwhile must not write into it, now linked nowhere."""
    store = DirectoryTrajectoryStore(tmp_path)
    path = store.path("r", 1)
    path.parent.mkdir(parents=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        path.unlink()  # as `_unlink_if_empty` does while this append waits for the lock
        assert store._append_locked(fd, str(path), Tail(), unreceived("u", request("u"))) is None
    finally:
        os.close(fd)
    asyncio.run(store.mark_closed("r", 1))
    asyncio.run(store.append(unreceived("u", request("u"))))
    assert [r.call_id for r in store.read_sync("r", 1)] == ["u"]


def test_an_unreceived_answer_ends_no_replay() -> None:
    tail = Tail()
    tail.advance(replace(unreceived("u", request("a")), sequence=0))
    check_append(tail, record("x", request("b"), 2, replayed_from="b"))  # not refused
    tail.advance(replace(record("live", request("c")), sequence=1))
    assert tail.live


class Registry:
    def close_attempt(self, rollout_id: str, attempt: int) -> None:
        return None

    async def signal_calls(self, rollout_id: str, events: list[Any]) -> None:
        self.signalled = events


async def test_no_close_hands_over_an_unreceived_answer(tmp_path: Path) -> None:
    store = DirectoryTrajectoryStore(tmp_path)
    registry = Registry()
    delivery = EventDelivery(registry, store, GatewayMetrics(), interval_seconds=3600)  # type: ignore[arg-type]
    for stored in [
        await store.append(record("a", request("a"))),
        await store.append(unreceived("u", request("a", "b"))),
        await store.append(record("c", request("a", "c"), sequence=2)),
    ]:
        if not stored.unreceived:
            delivery.enqueue(event_of(stored, store.ref(stored)))
    returned = await delivery.close_attempt("r", 1, return_up_to=2)
    assert returned.events is not None and [e.call_id for e in returned.events] == ["a", "c"]
    assert [r.call_id for r in returned.records] == ["a", "u", "c"]
    signalled = await delivery.close_attempt("r", 1)
    assert signalled.delivered == 2 and [e.call_id for e in registry.signalled] == ["a", "c"]


def test_the_trainer_reads_the_received_calls_only() -> None:
    records = [
        replace(record("a", request("a")), sequence=0),
        replace(unreceived("u", request("a", "b")), sequence=1),
        replace(record("c", request("a", "c")), sequence=2),
    ]
    digest = hashlib.sha256(b"a\nc").hexdigest()
    assert [r.call_id for r in committed_calls(records, "r", 2, digest)] == ["a", "c"]


def test_an_unreceived_answer_is_offered_after_the_received_ones_of_its_form() -> None:
    """The agent that asked again after leaving a call got the second answer, and went on
    from it: that one replays first."""
    same = request("a")
    source = [unreceived("u", same), record("r", same, sequence=1)]
    replay = ReplaySession(ReplayClaim(sources=(1,)), source, [])
    assert replay.take(CHAT, CHAT, same).recorded.record.call_id == "r"
    assert replay.take(CHAT, CHAT, same).recorded.record.call_id == "u"
    # An attempt whose only live call went unreceived has not gone live.
    done = [unreceived("v", request("z"), 2)]
    assert not ReplaySession(ReplayClaim(sources=(1,)), source, done).live


async def test_unreceived_answers_continue_a_lineage_and_leave_no_divergence(
    tmp_path: Path,
) -> None:
    store = DirectoryTrajectoryStore(tmp_path)
    await store.append(record("a", request("a")))
    await store.append(unreceived("u", request("a", "b")))
    # Attempt 2 replayed `a` and was lost with a call in flight again.
    await store.append(record("x", request("a"), 2, replayed_from="a"))
    await store.append(unreceived("v", request("a", "q"), 2))
    offered = await offered_calls(store, "r", [2, 1])
    assert [r.call_id for r in offered] == ["x", "v", "u"]
    # Attempt 3 replays what attempt 1 recorded and received; `u` and `v` left unused.
    done = [
        record("y", request("a"), 3, sequence=0, replayed_from="x"),
        record("live", request("a", "c"), 3, sequence=1),
    ]
    outcome = await replay_outcome(store, "r", [2, 1], done)
    assert (outcome.recorded, outcome.replayed, outcome.diverged_at) == (3, 1, None)


async def test_calls_in_flight_settle() -> None:
    calls = CallsInFlight()
    assert not await calls.settled("r", [1], timeout=WAIT)
    release = asyncio.Event()

    async def at_the_policy() -> None:
        with calls.holding("r", 1):
            await release.wait()

    held = asyncio.create_task(at_the_policy())
    await asyncio.wait_for(_until(lambda: len(calls) == 1), WAIT)
    assert not await calls.settled("r", [2], timeout=WAIT)  # another attempt's: none
    assert await calls.settled("r", [1], timeout=0.01)  # waited, and gave up
    waiting = asyncio.create_task(calls.settled("r", [2, 1], timeout=WAIT))
    release.set()
    assert await asyncio.wait_for(waiting, WAIT)
    await held
    assert len(calls) == 0


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


async def test_a_replaying_request_waits_for_its_records_call_in_flight(tmp_path: Path) -> None:
    """The agent of attempt 1 was lost while its call was at the policy server; attempt 2
    asks the same before the answer came: it waits, and is answered from the answer attempt
    1 records unreceived, not by a second generation."""
    store = DirectoryTrajectoryStore(tmp_path)
    await store.append(record("a", request("a")))
    registry = RolloutRegistry(None, store)  # type: ignore[arg-type]
    metrics = GatewayMetrics()
    delivery = EventDelivery(registry, store, metrics, interval_seconds=3600)
    in_flight = CallsInFlight()

    async def no_tokenizer(*_: Any) -> list[int]:
        raise AssertionError("a strict match needs no tokenizer")

    replayer = Replayer(
        ReplayBook(store),
        store,
        registry,
        delivery,
        metrics,
        no_tokenizer,
        in_flight=in_flight,
        wait_seconds=WAIT,
    )
    answered = asyncio.Event()

    async def attempt_1s_call() -> None:
        with in_flight.holding("r", 1):
            await answered.wait()
            await store.append(unreceived("u", request("a", "b"), sequence=1))

    at_the_policy = asyncio.create_task(attempt_1s_call())
    claims = TokenClaims("r", 2, "train", 2**31, replay=ReplayClaim(sources=(1,)))
    ids = itertools.count()

    async def ask(*turns: str) -> str | None:
        answer = await replayer.answer(
            CHAT, claims, request(*turns), None, stream=False, prompt_ids_asked=False
        )
        next(ids)
        return None if answer is None else answer.headers["x-darl-replayed-from"]

    assert await ask("a") == "a"
    asking = asyncio.create_task(ask("a", "b"))
    await asyncio.wait_for(_until(lambda: metrics.replay_waiting._value.get() == 1), WAIT)
    answered.set()
    assert await asyncio.wait_for(asking, WAIT) == "u"
    await at_the_policy
    assert metrics.unreceived_replayed._value.get() == 1
    # A request the record does not hold, nothing in flight: it goes live at once.
    assert await asyncio.wait_for(ask("a", "b", "c"), WAIT) is None
    calls = await store.read("r", 2)
    assert [(r.replayed_from, r.unreceived) for r in calls] == [("a", False), ("u", False)]


async def test_the_policy_servers_answer_comes_whatever_the_agent_does() -> None:
    """`to_the_end`: the agent hanging up cancels nothing; the answer comes, and it says that
    the agent left (the answer is then recorded unreceived)."""
    connection = Connection()
    asked, answered = asyncio.Event(), asyncio.Event()

    async def upstream_call() -> str:
        asked.set()
        await answered.wait()
        return "answer"

    task = asyncio.create_task(to_the_end(connection.request, upstream_call()))
    await asyncio.wait_for(asked.wait(), WAIT)
    connection.hang_up()  # its watcher wakes before the work's answer below
    answered.set()
    assert await asyncio.wait_for(task, WAIT) == ("answer", True)
    assert await to_the_end(Connection().request, asyncio.sleep(0, "kept")) == ("kept", False)
