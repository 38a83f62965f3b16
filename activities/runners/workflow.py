"""Workflow agent runner (`WorkflowAgentSpec`): the agent is a Temporal workflow that the
RolloutWorkflow runs as its child on the user's worker, so nothing here starts or watches a
process. Launching issues the attempt's contract (the gateway's base URL and the attempt's
token, which the workflow hands the child in its memo); awaiting returns the end the workflow
saw, for await_agent to close the attempt at the gateway and score it."""

from __future__ import annotations

import time

from darl.activities.agent_contract import AgentContract
from darl.activities.errors import agent_spec_error
from darl.activities.runners.base import AgentRunner
from darl.workflows.contracts import (
    AgentExit,
    AgentHandle,
    AwaitRequest,
    LaunchRequest,
    WorkflowAgentSpec,
)
from darl.workflows.heartbeats import Heartbeat


class WorkflowAgentRunner(AgentRunner):
    kind = "workflow"

    async def launch(self, request: LaunchRequest, contract: AgentContract) -> AgentHandle:
        """The attempt's handle, holding what the agent workflow's memo carries. Idempotent:
        a retry mints a token for the same attempt."""
        if not isinstance(request.spec.agent, WorkflowAgentSpec):
            raise agent_spec_error(f"not a workflow agent: {request.spec.agent.kind}")
        return AgentHandle(
            kind=self.kind,
            rollout_id=request.spec.rollout_id,
            attempt=request.attempt,
            started_at=time.time(),
            data={"base_url": contract.base_url, "token": contract.token},
        )

    async def wait(
        self, request: AwaitRequest, contract: AgentContract, heartbeat: Heartbeat
    ) -> AgentExit:
        """How the agent workflow ended, as the rollout's workflow awaited it."""
        if request.ended is None:
            raise agent_spec_error(
                "a workflow agent is awaited by its rollout's workflow: this rollout's "
                "workflow sent no end (a RolloutWorkflow older than workflow agents?)"
            )
        return request.ended

    async def kill(self, handle: AgentHandle) -> None:
        """Nothing to kill: the rollout's workflow cancels its child itself."""

    async def stop(self, request: LaunchRequest) -> None:
        """Nothing to stop: no child starts once the launch is cancelled."""
