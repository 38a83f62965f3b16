"""The gateway's view of rollouts in Temporal: is a rollout attempt still open, and the signals
that put its model calls and the agent's report into its workflow.

A call for a rollout the gateway has not seen asks Temporal once (describe); the worker tells
the gateway when an attempt's agent ended (see `delivery`), which the store remembers for a
gateway that starts later; a signal that finds the workflow closed marks the rollout closed.
So a closed rollout's calls are refused before any policy server is called.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from darl.gateway.errors import GatewayError
from darl.gateway.store import TrajectoryStore
from darl.workflows.contracts import AgentReport, ModelCallEvent, rollout_workflow_id
from darl.workflows.names import AGENT_RESULT_SIGNAL, MODEL_CALLS_SIGNAL

log = logging.getLogger(__name__)


def rollout_closed(rollout_id: str) -> GatewayError:
    return GatewayError(
        409, f"rollout {rollout_id} has finished; it takes no more calls", code="rollout_finished"
    )


def attempt_closed(rollout_id: str, attempt: int) -> GatewayError:
    return GatewayError(
        409,
        f"attempt {attempt} of rollout {rollout_id} has ended; it takes no more calls",
        code="rollout_finished",
    )


def unknown_rollout(rollout_id: str) -> GatewayError:
    return GatewayError(404, f"unknown rollout {rollout_id}", code="unknown_rollout")


def temporal_unavailable(err: RPCError) -> GatewayError:
    return GatewayError(
        503,
        f"could not record the call in Temporal ({err.status.name}); retry",
        type="server_error",
        code="temporal_unavailable",
        headers={"Retry-After": "1"},
    )


class _Bounded(OrderedDict[Hashable, Any]):
    """An insertion-ordered dict that forgets its oldest entries past `limit`."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: Hashable, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class RolloutRegistry:
    def __init__(self, client: Client, store: TrajectoryStore, remembered: int = 100_000) -> None:
        self._client = client
        self._store = store
        self._open: _Bounded = _Bounded(remembered)
        self._closed: _Bounded = _Bounded(remembered)
        # Attempts whose closed mark in the store was looked at (and not found).
        self._unmarked: _Bounded = _Bounded(remembered)

    async def check_open(self, rollout_id: str, attempt: int) -> None:
        """Raise 404/409 unless the rollout's workflow runs and this attempt has not ended."""
        if self.is_closed(rollout_id, attempt):
            raise attempt_closed(rollout_id, attempt)
        key = (rollout_id, attempt)
        if key not in self._unmarked:
            # Closed before this gateway started (a restart): the store remembers.
            if await self._store.is_closed(rollout_id, attempt):
                self.close_attempt(rollout_id, attempt)
                raise attempt_closed(rollout_id, attempt)
            self._unmarked.put(key, True)
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

    def close_attempt(self, rollout_id: str, attempt: int) -> None:
        self._closed.put((rollout_id, attempt), True)
        self._unmarked.pop((rollout_id, attempt), None)

    def is_closed(self, rollout_id: str, attempt: int) -> bool:
        return self._closed.get(rollout_id) is True or (rollout_id, attempt) in self._closed

    async def signal_calls(self, rollout_id: str, events: list[ModelCallEvent]) -> None:
        await self._signal(rollout_id, MODEL_CALLS_SIGNAL, events)

    async def signal_report(self, rollout_id: str, report: AgentReport) -> None:
        await self._signal(rollout_id, AGENT_RESULT_SIGNAL, report)

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
            raise temporal_unavailable(err) from err
