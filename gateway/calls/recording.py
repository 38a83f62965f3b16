"""What a model call leaves in the trajectory store (rule 1): its answer, then its event for the
rollout's workflow; a call that got no answer, as a failed call; what DARL did to the attempt,
as an incident (rule 7).

An answer its agent never received (it went away, or its attempt ended, while the call was at
the policy server) is recorded too, marked `unreceived`: it sends no event, so it is no part
of the attempt's trajectory and never trained, and the next attempt's identical request
replays it instead of asking the policy again (rule 10); trained only as the call of the
attempt that received it by replay.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import replace
from typing import Any

from darl.gateway.calls.delivery import EventDelivery, event_of
from darl.gateway.calls.model_call import ModelCall
from darl.gateway.calls.replay import ReplayBook
from darl.gateway.calls.rollouts import RolloutRegistry
from darl.gateway.errors import APIError, RolloutFinishedError, UpstreamError
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.protocols.chat.capture import CaptureError, require_token_ids
from darl.gateway.store.base import TrajectoryStore
from darl.gateway.store.record import CallRecord, FailedCall
from darl.workflows.rollout_token import TokenClaims

log = logging.getLogger(__name__)


class CallRecorder:
    def __init__(
        self,
        *,
        store: TrajectoryStore,
        registry: RolloutRegistry,
        delivery: EventDelivery,
        metrics: GatewayMetrics,
        replays: ReplayBook,
    ) -> None:
        self._store = store
        self._registry = registry
        self._delivery = delivery
        self._metrics = metrics
        self._replays = replays

    async def answered(
        self, call: ModelCall, response: dict[str, Any], latency_ms: float, streamed: bool
    ) -> CallRecord:
        """Record the policy server's answer to `call`: received (its event queued for the
        workflow), or unreceived when its agent left (`call.unreceived`). Raises 409 when
        the attempt ended while the call was at the policy server, through this replica or
        another: the agent is told, and the answer is kept unreceived."""
        try:
            prompt_ids = require_token_ids(call.endpoint, response)
        except (CaptureError, KeyError, TypeError) as err:
            raise UpstreamError(
                f"policy server answer cannot be captured ({err}); DARL needs a vLLM-compatible "
                "server that honours return_token_ids"
            ) from err
        record = call.record(response, prompt_ids, latency_ms, streamed)
        started = time.monotonic()
        try:
            stored = await self._append(call, record)
        except RolloutFinishedError:
            call.unreceived = True
            try:
                await self._append(call, replace(record, unreceived=True))
            except APIError as err:
                log.warning("the answer to call %s was not kept: %s", call.call_id, err.message)
            else:
                self._metrics.unreceived_calls.inc()
            raise
        self._metrics.store_write_seconds.observe(time.monotonic() - started)
        self._metrics.captured_calls.labels(call.protocol, str(streamed).lower()).inc()
        if stored.unreceived:
            self._metrics.unreceived_calls.inc()
            return stored
        if call.claims.replay is not None:
            # The agent is about to see an answer the record never gave: its replay is over.
            self._replays.end_replay(call.claims.rollout_id, call.claims.attempt)
        self._delivery.enqueue(event_of(stored, self._store.ref(stored)))
        return stored

    async def _append(self, call: ModelCall, record: CallRecord) -> CallRecord:
        try:
            stored = await self._registry.record_call(record)
        except CaptureError as err:  # prompt ids kept as bytes, found malformed when read
            raise UpstreamError(f"policy server {call.upstream} answered non-JSON") from err
        call.settled = True
        return stored

    async def failed(
        self,
        claims: TokenClaims,
        protocol: str,
        call: ModelCall | None,
        started: float,
        status: int,
        error: str,
    ) -> None:
        """Remember a call that got no answer, so a user sees why; never trained on."""
        if call is not None:
            call.settled = True
        await self._store.record_failed_call(
            FailedCall(
                call_id=call.call_id if call is not None else uuid.uuid4().hex,
                rollout_id=claims.rollout_id,
                attempt=claims.attempt,
                protocol=protocol,
                status=status,
                error=error[:4000],
                latency_ms=(time.monotonic() - started) * 1000,
                retry_count=call.retries if call is not None else 0,
                upstream=call.upstream if call is not None else None,
                created_at=time.time(),
            )
        )
        self._metrics.failed_calls.labels(str(status)).inc()

    async def incident(self, claims: TokenClaims, error: str) -> None:
        """DARL failed this attempt's agent (a 5xx answer or a broken stream): remember it
        durably, so the attempt's failure is not blamed on the agent (rule 7)."""
        log.warning("rollout %s attempt %d: %s", claims.rollout_id, claims.attempt, error)
        await self._store.record_incident(claims.rollout_id, claims.attempt, error)
