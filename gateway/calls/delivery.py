"""Delivery of captured calls to their rollout workflows (rule 1 of docs/architecture.md, made
cheap).

The trajectory store is the write-ahead log: a call counts as recorded once its full record is
in the store, and only then does the agent get its answer. Its small `ModelCallEvent` then goes
to the rollout's workflow in a batched `model_calls` signal, at most every `interval` seconds per
rollout attempt, so Temporal sees one signal per batch instead of one per call.

Nothing is lost between the two: the store remembers up to which sequence the workflow has been
told; a gateway that restarts sends the rest (its first flush of an attempt reads the store);
and the rollout worker closes every attempt through the gateway before it reports the agent's
end, so the workflow has every call before it scores. The close either answers with every call
event of the attempt, read from the store (what the worker asks for: the events then reach the
workflow in await_agent's result, at no signal's cost), or signals them all. The
workflow drops duplicates by call id.

An answer its agent never received (`CallRecord.unreceived`) has no event: it is no part of
the attempt's trajectory, neither signalled nor returned by the close (see `recording`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

from darl.gateway.calls.rollouts import RolloutRegistry
from darl.gateway.errors import APIError
from darl.gateway.lru import LRUCache
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.protocols.chat.capture import count_tokens, finish_reason
from darl.gateway.store.base import TrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.workflows.contracts import ModelCallEvent

log = logging.getLogger(__name__)

Key = tuple[str, int]
# The most call events one signal carries (a signal's payload is bounded, ~2 MB).
SIGNAL_BATCH = 256
# How many attempts' recovery the process remembers (see EventDelivery._recovered).
RECOVERED_REMEMBERED = 100_000


def committed(records: list[CallRecord]) -> list[CallRecord]:
    """The records of the attempt's trajectory: every one but the answers their agents never
    received."""
    return [r for r in records if not r.unreceived]


def event_of(record: CallRecord, ref: str) -> ModelCallEvent:
    prompt_tokens, completion_tokens = count_tokens(record.endpoint, record.response)
    return ModelCallEvent(
        call_id=record.call_id,
        rollout_id=record.rollout_id,
        attempt=record.attempt,
        sequence=record.sequence,
        endpoint=record.endpoint,
        upstream=record.upstream,
        policy_version=record.policy_version,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        finish_reason=finish_reason(record.response),
        latency_ms=record.latency_ms,
        http_status=200,
        retry_count=record.retry_count,
        streamed=record.streamed,
        record_ref=ref,
        replayed_from=record.replayed_from,
    )


@dataclass(frozen=True)
class ClosedAttempt:
    """What closing an attempt did: how many events it signalled, or the events it returns
    instead (None: it signalled them); and the attempt's calls it read from the store."""

    delivered: int
    events: list[ModelCallEvent] | None
    records: list[CallRecord] = field(default_factory=list)


@dataclass
class _EventQueue:
    """One attempt's call events waiting for their signal, and the flush that sends them."""

    pending: list[ModelCallEvent] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    timer: asyncio.Task[None] | None = None
    # Whether this process has looked in the store for events an earlier process left.
    recovered: bool = False


class EventDelivery:
    def __init__(
        self,
        registry: RolloutRegistry,
        store: TrajectoryStore,
        metrics: GatewayMetrics,
        interval_seconds: float = 1.0,
        retry_seconds: float = 2.0,
    ) -> None:
        self._registry = registry
        self._store = store
        self._metrics = metrics
        self._interval = interval_seconds
        self._retry = retry_seconds
        self._queues: dict[Key, _EventQueue] = {}
        # Attempts this process has looked in the store for (its first flush of each): what
        # another process left is looked for once. Again at every flush, a replica would read
        # the whole attempt each time another replica moved the delivered mark; what a replica
        # still holds is its own to send, or the close's, which reads the store in full.
        self._recovered: LRUCache[Key, bool] = LRUCache(RECOVERED_REMEMBERED)

    def enqueue(self, event: ModelCallEvent) -> None:
        """Queue a recorded call's event; a flush follows within the interval."""
        key = (event.rollout_id, event.attempt)
        queue = self._queues.setdefault(key, _EventQueue())
        queue.pending.append(event)
        if queue.timer is None:
            # Jitter keeps the rollouts' flushes from falling due together (a burst of signals
            # is a burst of Temporal CPU that the gateway's calls then wait behind).
            delay = self._interval * random.uniform(0.8, 1.2)
            queue.timer = asyncio.create_task(self._flush_later(key, delay))

    def pending(self) -> int:
        return sum(len(queue.pending) for queue in self._queues.values())

    async def close_attempt(
        self, rollout_id: str, attempt: int, return_up_to: int = 0
    ) -> ClosedAttempt:
        """The attempt's agent has ended: refuse its further calls and hand over every event it
        left. The store's closed mark is exclusive with its appends: a call is in what this
        close reads, or refused (409), never recorded after it. With `return_up_to` > 0, and
        no more calls recorded than that, the answer carries all of the attempt's events,
        read from the store in full (another replica may have recorded some), none is
        signalled and the delivered mark stays where it is, so a retried close returns them
        again. Otherwise all of them are signalled, read from the store (see
        `_signal_all`). Raises APIError 503 when Temporal cannot be reached, so the caller
        retries."""
        self._registry.close_attempt(rollout_id, attempt)
        await self._store.mark_closed(rollout_id, attempt)
        key = (rollout_id, attempt)
        queue = self._queues.setdefault(key, _EventQueue())
        if queue.timer is not None:
            queue.timer.cancel()
            queue.timer = None
        records: list[CallRecord] = []
        events = None
        if return_up_to > 0:
            records, events = await self._take_all(key, queue, return_up_to)
        delivered = 0
        if events is None:
            records, delivered = await self._signal_all(key, queue)
        self._queues.pop(key, None)
        self._recovered.pop(key, None)
        self._store.forget(rollout_id, attempt)
        return ClosedAttempt(delivered=delivered, events=events, records=records)

    async def _take_all(
        self, key: Key, queue: _EventQueue, most: int
    ) -> tuple[list[CallRecord], list[ModelCallEvent] | None]:
        """The attempt's records and every recorded event, the queued ones taken out of its
        queue; no events (nothing taken) when there are more than `most`."""
        rollout_id, attempt = key
        async with queue.lock:  # a flush under way finishes first
            records = await self._store.read(rollout_id, attempt)
            calls = committed(records)
            if len(calls) > most:
                return records, None
            # Queued events were recorded first: they are among the records.
            queue.pending = []
        return records, [event_of(r, self._store.ref(r)) for r in calls]

    async def _signal_all(self, key: Key, queue: _EventQueue) -> tuple[list[CallRecord], int]:
        """Signal every recorded event of the attempt, read from the store, in batches of
        SIGNAL_BATCH. Not only those past the delivered mark: with replicas the mark is the
        highest sequence any of them delivered, and a lower one may still have been queued at
        another replica (which sends nothing for an attempt closed elsewhere). The workflow
        drops the ones it has by call id."""
        rollout_id, attempt = key
        async with queue.lock:
            records = await self._store.read(rollout_id, attempt)
            queue.pending = []
            events = [event_of(r, self._store.ref(r)) for r in committed(records)]
            for start in range(0, len(events), SIGNAL_BATCH):
                if not await self._signal(rollout_id, events[start : start + SIGNAL_BATCH]):
                    return records, start
            if events:
                await self._store.mark_delivered(rollout_id, attempt, events[-1].sequence)
            return records, len(events)

    async def _signal(self, rollout_id: str, batch: list[ModelCallEvent]) -> bool:
        """Signal a batch; False when the rollout has finished (the events are dropped, and
        what is left of the attempt's with them). Raises APIError 503 otherwise."""
        try:
            await self._registry.signal_calls(rollout_id, batch)
        except APIError as err:
            if err.status != 409:
                raise
            log.warning("dropping call event(s) of %s: the rollout has finished", rollout_id)
            return False
        self._metrics.delivered_events.inc(len(batch))
        self._metrics.delivery_signals.inc()
        return True

    async def flush(self, key: Key) -> int:
        queue = self._queues.get(key)
        if queue is None:
            return 0
        async with queue.lock:
            if not queue.recovered and key not in self._recovered:
                queue.pending = await self._recover(key, queue.pending) + queue.pending
                self._recovered.put(key, True)
            queue.recovered = True
            batch, queue.pending = queue.pending, []
            if not batch:
                return 0
            rollout_id, attempt = key
            try:
                if not await self._signal(rollout_id, batch):
                    return 0
            except APIError:
                queue.pending = batch + queue.pending
                raise
            await self._store.mark_delivered(rollout_id, attempt, max(e.sequence for e in batch))
            if not queue.pending and queue.timer is None and self._queues.get(key) is queue:
                # Nothing left: forget the queue (a later call starts a new one; the delivered
                # mark tells it there is nothing to recover), so memory follows live attempts.
                del self._queues[key]
            return len(batch)

    async def aclose(self) -> None:
        """Deliver everything pending (a graceful shutdown); what fails stays in the store."""
        for key in list(self._queues):
            queue = self._queues[key]
            if queue.timer is not None:
                queue.timer.cancel()
                queue.timer = None
            try:
                await self.flush(key)
            except APIError as err:
                log.warning("events of %s stay in the store for later: %s", key[0], err.message)

    async def _flush_later(self, key: Key, delay: float) -> None:
        await asyncio.sleep(delay)
        queue = self._queues.get(key)
        if queue is None:
            return
        queue.timer = None
        try:
            await self.flush(key)
        except APIError as err:
            log.warning("delivering events of %s failed, retrying: %s", key[0], err.message)
            if key in self._queues and queue.timer is None:
                queue.timer = asyncio.create_task(self._flush_later(key, self._retry))

    async def _recover(self, key: Key, pending: list[ModelCallEvent]) -> list[ModelCallEvent]:
        """Events in the store past the delivered mark and not already queued. Reads the store
        only when the queue does not start right after the mark (after a restart, or a close
        with nothing queued): records are queued in sequence order as they are written."""
        rollout_id, attempt = key
        delivered = await self._store.delivered(rollout_id, attempt)
        if pending and min(e.sequence for e in pending) == delivered + 1:
            return []
        queued = {e.call_id for e in pending}
        records = await self._store.read(rollout_id, attempt)
        missing = [
            event_of(r, self._store.ref(r))
            for r in committed(records)
            if r.sequence > delivered and r.call_id not in queued
        ]
        if missing:
            log.info("recovered %d undelivered call event(s) of %s", len(missing), rollout_id)
        return missing
