"""The rollout activities: `launch_agent`, `await_agent`, `compute_reward`.

They pick the runner by the agent spec's kind, issue the attempt's agent contract, and keep the
gateway told when an attempt's agent has ended (so a straggler's call is refused before it
reaches a policy server).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import httpx
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import rewards
from activities.agent_contract import AgentContract, ContractIssuer, TaskPathError
from activities.errors import agent_spec_error
from activities.runners.base import AgentRunner
from workflows.contracts import (
    AgentExit,
    AgentHandle,
    AwaitRequest,
    LaunchRequest,
    RewardRequest,
    RolloutSpec,
)
from workflows.rollout_workflow import AWAIT_AGENT, COMPUTE_REWARD, LAUNCH_AGENT

log = logging.getLogger(__name__)


def current_traceparent() -> str | None:
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent")


class GatewayNotifier:
    """Tells the gateway's admin API that an attempt is over. Advisory: the gateway also learns
    it from Temporal when a signal to a closed rollout fails, so a failure here is logged."""

    def __init__(self, admin_url: str, admin_key: str, client: httpx.AsyncClient) -> None:
        self._admin_url = admin_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {admin_key}"}
        self._client = client

    async def attempt_ended(self, rollout_id: str, attempt: int) -> None:
        url = f"{self._admin_url}/admin/rollouts/{rollout_id}/attempts/{attempt}/close"
        try:
            response = await self._client.post(url, headers=self._headers, timeout=5.0)
            response.raise_for_status()
        except httpx.HTTPError as err:
            log.warning("could not tell the gateway that %s/%d ended: %r", rollout_id, attempt, err)


class RolloutActivities:
    def __init__(
        self,
        runners: Mapping[str, AgentRunner],
        issuer: ContractIssuer,
        notifier: GatewayNotifier | None = None,
    ) -> None:
        self._runners = dict(runners)
        self._issuer = issuer
        self._notifier = notifier

    def activities(self) -> list:
        return [self.launch_agent, self.await_agent, self.compute_reward]

    @activity.defn(name=LAUNCH_AGENT)
    async def launch_agent(self, request: LaunchRequest) -> AgentHandle:
        """Idempotent per (rollout, attempt): a retry returns the agent already started."""
        runner = self._runner(request.spec)
        contract = self._contract(request.spec, request.attempt, current_traceparent())
        return await runner.launch(request, contract)

    @activity.defn(name=AWAIT_AGENT)
    async def await_agent(self, request: AwaitRequest) -> AgentExit:
        """Heartbeats while the agent runs; a retry after a worker crash re-attaches to it.
        Cancellation kills the agent before the cancellation completes."""
        runner = self._runner(request.spec)
        contract = self._contract(request.spec, request.attempt, current_traceparent())
        try:
            agent_exit = await runner.wait(request, contract, activity.heartbeat)
        except asyncio.CancelledError:
            if activity.is_worker_shutdown():
                # The worker is stopping, not the rollout: leave the agent running for the
                # retry on another worker to re-attach to.
                raise
            await asyncio.shield(runner.kill(request.handle))
            await asyncio.shield(self._attempt_ended(request))
            raise
        except ApplicationError as err:
            # A retryable failure leaves the agent running for the retry to re-attach to.
            if err.non_retryable:
                await self._attempt_ended(request)
            raise
        await self._attempt_ended(request)
        return agent_exit

    @activity.defn(name=COMPUTE_REWARD)
    async def compute_reward(self, request: RewardRequest) -> float:
        try:
            return await rewards.score(
                request.spec.reward, request.spec.task, request.answer, request.summary
            )
        except rewards.RewardFunctionError as err:
            raise ApplicationError(
                str(err), type="RewardFunctionError", non_retryable=True
            ) from err

    async def _attempt_ended(self, request: AwaitRequest) -> None:
        if self._notifier is not None:
            await self._notifier.attempt_ended(request.spec.rollout_id, request.attempt)

    def _runner(self, spec: RolloutSpec) -> AgentRunner:
        runner = self._runners.get(spec.agent.kind)
        if runner is None:
            raise agent_spec_error(f"this worker has no {spec.agent.kind!r} agent runner")
        return runner

    def _contract(self, spec: RolloutSpec, attempt: int, traceparent: str | None) -> AgentContract:
        try:
            return self._issuer.issue(spec, attempt, traceparent, spec.agent.env_map)
        except TaskPathError as err:
            raise agent_spec_error(str(err)) from err
