"""The gateway's view of rollouts in Temporal: is a rollout attempt still open, the spec its
workflow started with, and the signals that put its model calls and the agent's report into
its workflow.

A call for a rollout the gateway has not seen asks Temporal once (describe), unless the worker
running the rollout's activity said the workflow runs (`opened`: it opens attempt 1 through
the gateway before the agent starts, which saves the server a describe per rollout). The
worker tells the gateway when an attempt's agent ended (see `delivery`), which the store
remembers for a gateway that starts later and for the other replicas sharing the store; a
signal that finds the workflow closed marks the rollout closed. So a closed rollout's calls
are refused before any policy server is called, by whichever replica they reach: the store's
closed mark is looked at again on every call (a stat on the directory store, ~7 us), or once
per `closed_recheck_seconds` where looking costs a request; a call that looked before a close
and writes after it is refused by the store itself (`record_call`).

An attempt makes at most MAX_CALLS_PER_ATTEMPT model calls, replayed ones included: the store
refuses the append that would take the sequence past them, so the budget holds exactly across
replicas (`check_append`), and a gateway that has seen the store give out the last one (or
refuse the next) refuses the attempt's later calls before any policy server is asked
(`check_budget`). A replica whose view lags (new to the attempt, or behind another
replica's calls) finds out from the store: the calls it sent before that are generated and
then refused, one for an agent that waits for each answer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from darl.gateway.errors import (
    APIError,
    CallsExhaustedError,
    ReportTooLargeError,
    RolloutFinishedError,
    RolloutSpecUnreadableError,
    TemporalRefusedError,
    TemporalUnavailableError,
    TooManyReportsError,
    UnknownRolloutError,
)
from darl.gateway.lru import LRUCache
from darl.gateway.store.base import AttemptClosedError, CallBudgetSpentError, TrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.workflows import contracts
from darl.workflows.contracts import (
    REPORTS_PER_ATTEMPT,
    AgentReport,
    ModelCallEvent,
    RolloutSpec,
    rollout_workflow_id,
)
from darl.workflows.names import AGENT_RESULT_SIGNAL, MODEL_CALLS_SIGNAL

log = logging.getLogger(__name__)

Key = tuple[str, int]


def rollout_closed(rollout_id: str) -> APIError:
    return RolloutFinishedError(f"rollout {rollout_id} has finished; it takes no more calls")


def attempt_closed(rollout_id: str, attempt: int) -> APIError:
    return RolloutFinishedError(
        f"attempt {attempt} of rollout {rollout_id} has ended; it takes no more calls"
    )


def calls_exhausted(rollout_id: str, attempt: int) -> APIError:
    return CallsExhaustedError(
        f"attempt {attempt} of rollout {rollout_id} made its "
        f"{contracts.MAX_CALLS_PER_ATTEMPT:,} model calls, the most an attempt may make"
    )


def unknown_rollout(rollout_id: str) -> APIError:
    return UnknownRolloutError(f"unknown rollout {rollout_id}")


def temporal_unavailable(err: RPCError) -> APIError:
    return TemporalUnavailableError(
        f"could not record the call in Temporal ({err.status.name}); retry"
    )


# How many rollouts' specs a gateway keeps (a spec holds its task: a SWE instance is ~10 KB).
SPECS_REMEMBERED = 1024


@dataclass(frozen=True)
class StartedRollout:
    """A rollout as its workflow started: its spec, and when (epoch seconds)."""

    spec: RolloutSpec
    started_at: float


class RolloutRegistry:
    def __init__(
        self,
        client: Client,
        store: TrajectoryStore,
        remembered: int = 100_000,
        closed_recheck_seconds: float = 0.0,
    ) -> None:
        self._client = client
        self._store = store
        # Rollouts whose workflow runs, as Temporal or the worker said.
        self._open: LRUCache[str, bool] = LRUCache(remembered)
        # Rollouts found finished, and attempts closed: rollout id or (rollout id, attempt).
        self._closed: LRUCache[str | Key, bool] = LRUCache(remembered)
        # Attempts whose closed mark in the store was looked at and not found, and when
        # (monotonic): another replica (or an earlier gateway) may close them at any time.
        self._unmarked: LRUCache[Key, float] = LRUCache(remembered)
        # Attempts closed through another process (a replica): it handed their events over.
        self._closed_elsewhere: LRUCache[Key, bool] = LRUCache(remembered)
        self._recheck = closed_recheck_seconds
        self._started: LRUCache[str, StartedRollout] = LRUCache(SPECS_REMEMBERED)
        # Reports signalled per attempt ((rollout id, attempt) -> count).
        self._reports_sent: LRUCache[Key, int] = LRUCache(remembered)
        # The sequence the store gives the attempt's next call, as this process last saw it.
        self._next_sequence: LRUCache[Key, int] = LRUCache(remembered)

    async def check_open(self, rollout_id: str, attempt: int) -> None:
        """Raise 404/409 unless the rollout's workflow runs and this attempt has not ended."""
        if await self.ended(rollout_id, attempt):
            raise attempt_closed(rollout_id, attempt)
        if rollout_id in self._open:
            return
        handle = self._client.get_workflow_handle(rollout_workflow_id(rollout_id))
        try:
            description = await handle.describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                raise unknown_rollout(rollout_id) from err
            raise temporal_unavailable(err) from err
        if description.status != WorkflowExecutionStatus.RUNNING:
            self._closed.put(rollout_id, True)
            raise rollout_closed(rollout_id)
        self._open.put(rollout_id, True)

    async def opened(self, rollout_id: str, attempt: int) -> bool:
        """The worker's word that the rollout's workflow runs: it is running the attempt's
        activity, and its agent is about to start. Returns whether the attempt had ended
        already (then nothing is opened: its calls stay refused). Otherwise the attempt's
        first call asks Temporal nothing, as if this gateway had described the workflow now;
        a workflow that ends later is found as it is after a describe, by the attempt's close
        or by a signal that finds it closed."""
        # The store itself, not a recent look at it (`closed_recheck_seconds`): the answer
        # decides whether the worker asks Temporal about an earlier run (rule 7).
        if await self.was_closed(rollout_id, attempt):
            return True
        self._open.put(rollout_id, True)
        return False

    async def was_closed(self, rollout_id: str, attempt: int) -> bool:
        """Whether the attempt was closed, through this process or in the store (by another
        replica or an earlier gateway): the store is looked at now, whatever the recheck."""
        return self.is_closed(rollout_id, attempt) or await self._store.is_closed(
            rollout_id, attempt
        )

    async def started(self, rollout_id: str) -> StartedRollout:
        """The spec the rollout's workflow started with: the input of its history's first
        event, decoded by the client's data converter (any revision's workflow; nothing asked
        of the workflow itself), remembered for the last SPECS_REMEMBERED rollouts. Raises
        404 for a rollout without a workflow, 503 when Temporal cannot be reached."""
        known: StartedRollout | None = self._started.get(rollout_id)
        if known is not None:
            return known
        workflow_id = rollout_workflow_id(rollout_id)
        history = self._client.get_workflow_handle(workflow_id).fetch_history_events(page_size=1)
        try:
            first = await anext(history, None)
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                raise unknown_rollout(rollout_id) from err
            raise TemporalUnavailableError(
                f"could not read the spec of rollout {rollout_id} in Temporal "
                f"({err.status.name}); retry"
            ) from err
        if first is None or first.event_type != EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            raise RolloutSpecUnreadableError(f"workflow {workflow_id} has no start event")
        payloads = first.workflow_execution_started_event_attributes.input.payloads
        try:
            [spec] = await self._client.data_converter.decode(payloads, [RolloutSpec])
        except ValueError as err:  # pydantic's ValidationError among them
            raise RolloutSpecUnreadableError(
                f"workflow {workflow_id} started with an input that is not a RolloutSpec of "
                f"this DARL: {err}"
            ) from err
        started = StartedRollout(spec, first.event_time.ToMicroseconds() / 1e6)
        self._started.put(rollout_id, started)
        return started

    def close_attempt(self, rollout_id: str, attempt: int) -> None:
        """The attempt was closed through this process (it hands over the attempt's events)."""
        self._closed.put((rollout_id, attempt), True)
        self._unmarked.pop((rollout_id, attempt), None)
        self._closed_elsewhere.pop((rollout_id, attempt), None)
        self._next_sequence.pop((rollout_id, attempt), None)

    def is_closed(self, rollout_id: str, attempt: int) -> bool:
        """Whether this process knows the attempt ended (no look at the store)."""
        return self._closed.get(rollout_id) is True or (rollout_id, attempt) in self._closed

    async def ended(self, rollout_id: str, attempt: int) -> bool:
        """Whether the attempt ended, closed through this process or any other sharing the
        store (a replica, or a gateway before a restart)."""
        if self.is_closed(rollout_id, attempt):
            return True
        key = (rollout_id, attempt)
        looked = self._unmarked.get(key)
        if looked is not None and time.monotonic() - looked < self._recheck:
            return False
        if await self._store.is_closed(rollout_id, attempt):
            self._found_closed(key)
            return True
        self._unmarked.put(key, time.monotonic())
        return False

    def _found_closed(self, key: tuple[str, int]) -> None:
        """The store says the attempt was closed, through another process."""
        self._closed.put(key, True)
        self._unmarked.pop(key, None)
        self._closed_elsewhere.put(key, True)

    async def record_call(self, record: CallRecord) -> CallRecord:
        """Append a call of its attempt to the store, unless the attempt ended: 409 when this
        gateway knows it, or when the store finds the close under the append's own lock (a
        close that came while the call was on its way; `ended` alone cannot tell, as the
        close may land between its look and the write); 400 `calls_exhausted` when the
        attempt holds MAX_CALLS_PER_ATTEMPT calls. An answer its agent never received
        (`unreceived`) is kept whether or not the attempt ended: it is no part of the
        trajectory a close hands over, and the next attempt may replay it."""
        key = (record.rollout_id, record.attempt)
        if not record.unreceived and await self.ended(*key):
            raise attempt_closed(*key)
        try:
            stored = await self._store.append(record)
        except AttemptClosedError as err:
            if key not in self._closed:
                self._found_closed(key)
            raise attempt_closed(*key) from err
        except CallBudgetSpentError as err:
            self._next_sequence.put(key, contracts.MAX_CALLS_PER_ATTEMPT)
            raise calls_exhausted(*key) from err
        self._next_sequence.put(key, max(stored.sequence + 1, self._next_sequence.get(key, 0)))
        return stored

    def check_budget(self, rollout_id: str, attempt: int) -> None:
        """Raise 400 `calls_exhausted` when the store has given out the attempt's last call
        as far as this process saw (no look at the store: its append decides, see the
        module's docstring)."""
        if self._next_sequence.get((rollout_id, attempt), 0) >= contracts.MAX_CALLS_PER_ATTEMPT:
            raise calls_exhausted(rollout_id, attempt)

    async def _handed_over(self, rollout_id: str, attempt: int) -> bool:
        """Whether another process closed the attempt: its close read the attempt's events
        from the store and handed them to the workflow, which may have finished since."""
        key = (rollout_id, attempt)
        if key in self._closed_elsewhere:
            return True
        return key not in self._closed and await self.ended(rollout_id, attempt)

    async def signal_calls(self, rollout_id: str, events: list[ModelCallEvent]) -> None:
        """Signal the events to the workflow, unless another replica closed their attempt in
        the meantime: its close delivered them, and a late signal would only wake a workflow
        that has scored (a signal that arrives as a workflow completes makes Temporal run its
        last task again)."""
        attempts = {event.attempt for event in events}
        if all([await self._handed_over(rollout_id, attempt) for attempt in attempts]):
            log.info(
                "%d call event(s) of %s: its attempt was closed by another replica, which "
                "delivered them",
                len(events),
                rollout_id,
            )
            return
        await self._signal(rollout_id, MODEL_CALLS_SIGNAL, events)

    async def signal_report(self, rollout_id: str, report: AgentReport) -> None:
        """Signal an agent's report to its workflow: refused (413) over its budget, and (400)
        past the attempt's REPORTS_PER_ATTEMPT, counted by this gateway (each replica counts
        its own)."""
        too_large = report.over_budget()
        if too_large is not None:
            raise ReportTooLargeError(too_large)
        key = (rollout_id, report.attempt)
        sent = self._reports_sent.get(key, 0)
        if sent >= REPORTS_PER_ATTEMPT:
            raise TooManyReportsError(
                f"attempt {report.attempt} of rollout {rollout_id} has reported "
                f"{REPORTS_PER_ATTEMPT} times, the most an attempt may; a later report "
                "overrides the fields it sets, so send one when the attempt is done"
            )
        # Counted before the signal is awaited, so concurrent reports cannot all pass.
        self._reports_sent.put(key, sent + 1)
        try:
            await self._signal(rollout_id, AGENT_RESULT_SIGNAL, report)
        except APIError:
            self._reports_sent.put(key, self._reports_sent.get(key, 1) - 1)
            raise

    async def _signal(self, rollout_id: str, name: str, payload: object) -> None:
        handle = self._client.get_workflow_handle(rollout_workflow_id(rollout_id))
        try:
            await handle.signal(name, payload)
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                self._open.pop(rollout_id, None)
                self._closed.put(rollout_id, True)
                raise rollout_closed(rollout_id) from err
            log.warning("signal %s to %s failed: %s", name, rollout_id, err)
            if err.status == RPCStatusCode.INVALID_ARGUMENT:
                # Refused for what it holds (a payload over Temporal's limits): DARL's to
                # bound, and no retry would pass.
                raise TemporalRefusedError(
                    f"Temporal refused the {name} signal: {err.message}"
                ) from err
            raise temporal_unavailable(err) from err
