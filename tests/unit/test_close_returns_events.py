"""The gateway's close of an attempt, asked to return its call events: they come from the store
in full (another replica's calls too, the in-memory outbox's as well), nothing is signalled,
the delivered mark stays, so a retried close answers the same; over the cap, the close signals
them as it always did."""

from __future__ import annotations

from pathlib import Path

from darl.gateway.calls.delivery import EventDelivery, event_of
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.workflows.contracts import ModelCallEvent

ROLLOUT = "close-r1"


class Registry:
    """Records what the gateway would signal."""

    def __init__(self) -> None:
        self.closed: list[tuple[str, int]] = []
        self.signalled: list[list[ModelCallEvent]] = []

    def close_attempt(self, rollout_id: str, attempt: int) -> None:
        self.closed.append((rollout_id, attempt))

    async def signal_calls(self, rollout_id: str, events: list[ModelCallEvent]) -> None:
        self.signalled.append(events)


def record(call: int) -> CallRecord:
    return CallRecord(
        call_id=f"c{call}",
        rollout_id=ROLLOUT,
        attempt=1,
        sequence=-1,
        endpoint="chat.completions",
        upstream="http://u",
        policy_version=1,
        created_at=1.0 + call,
        latency_ms=2.5,
        retry_count=0,
        streamed=False,
        request={"model": "m", "messages": [{"role": "user", "content": f"q{call}"}]},
        response={
            "id": f"x{call}",
            "prompt_token_ids": [1, 2, call],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "t"},
                    "token_ids": [3],
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        },
        prompt_token_ids=[1, 2, call],
    )


async def recorded(
    store: DirectoryTrajectoryStore, delivery: EventDelivery | None, call: int
) -> None:
    stored = await store.append(record(call))
    if delivery is not None:  # recorded through this replica; else through another
        delivery.enqueue(event_of(stored, store.ref(stored)))


async def test_a_close_returns_every_recorded_event_and_a_retry_returns_them_again(
    tmp_path: Path,
) -> None:
    store = DirectoryTrajectoryStore(tmp_path)
    registry = Registry()
    delivery = EventDelivery(registry, store, GatewayMetrics(), interval_seconds=3600)  # type: ignore[arg-type]
    await recorded(store, delivery, 0)
    await delivery.flush((ROLLOUT, 1))  # an interval flush: c0 is signalled, the mark is 0
    await recorded(store, delivery, 1)  # queued here
    await recorded(store, None, 2)  # recorded by another replica
    first = await delivery.close_attempt(ROLLOUT, 1, return_up_to=256)
    again = await delivery.close_attempt(ROLLOUT, 1, return_up_to=256)
    assert first.events is not None and again.events is not None
    assert [e.call_id for e in first.events] == ["c0", "c1", "c2"]
    assert again.events == first.events
    assert first.delivered == again.delivered == 0
    assert [[e.call_id for e in batch] for batch in registry.signalled] == [["c0"]]
    assert await store.delivered(ROLLOUT, 1) == 0
    assert delivery.pending() == 0


async def test_over_the_cap_the_close_signals_as_before(tmp_path: Path) -> None:
    store = DirectoryTrajectoryStore(tmp_path)
    registry = Registry()
    delivery = EventDelivery(registry, store, GatewayMetrics(), interval_seconds=3600)  # type: ignore[arg-type]
    for call in range(3):
        await recorded(store, delivery, call)
    closed = await delivery.close_attempt(ROLLOUT, 1, return_up_to=2)
    assert closed.events is None and closed.delivered == 3
    assert [[e.call_id for e in batch] for batch in registry.signalled] == [["c0", "c1", "c2"]]
    assert await store.delivered(ROLLOUT, 1) == 2


async def test_a_signalling_close_sends_calls_below_another_replicas_mark(tmp_path: Path) -> None:
    """With replicas the delivered mark is the highest sequence any of them signalled: a lower
    call queued at another replica (which signals nothing for an attempt closed elsewhere) is
    still sent by the close, and in batches a signal can carry."""
    store = DirectoryTrajectoryStore(tmp_path)
    registry = Registry()
    delivery = EventDelivery(registry, store, GatewayMetrics(), interval_seconds=3600)  # type: ignore[arg-type]
    for call in range(300):
        await recorded(store, None, call)  # all recorded by another replica, none signalled
    await store.mark_delivered(ROLLOUT, 1, 299)  # ...but a third replica signalled the last
    closed = await delivery.close_attempt(ROLLOUT, 1)
    assert closed.events is None and closed.delivered == 300
    assert [len(batch) for batch in registry.signalled] == [256, 44]
    signalled = [e.call_id for batch in registry.signalled for e in batch]
    assert signalled == [f"c{call}" for call in range(300)]
