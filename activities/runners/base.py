"""The agent runner interface: launch an attempt's agent, await it, kill it.

Every runner keeps rule 3 of docs/architecture.md: `launch` is idempotent for a (rollout,
attempt) — a retried launch returns the agent already started — and `wait` re-attaches from the
handle alone, so a new worker can await an agent that an earlier, crashed worker launched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from darl.activities.agent_contract import AgentContract
from darl.activities.sandbox.errors import SandboxSpecError
from darl.workflows.contracts import (
    AgentExit,
    AgentHandle,
    AwaitRequest,
    GradeReport,
    LaunchRequest,
)
from darl.workflows.heartbeats import Heartbeat, heartbeat_interval
from darl.workflows.rollout_activity_options import RUNNER_DEADLINE_GRACE

LOG_TAIL_BYTES = 4096


# An agent's await heartbeats at least this often (its heartbeat timeout is the RolloutSpec's).
AGENT_HEARTBEAT_SECONDS = 10.0


def agent_heartbeat_interval(heartbeat_seconds: float) -> float:
    """How often an agent's await heartbeats (the one rule, `heartbeat_interval`)."""
    return heartbeat_interval(heartbeat_seconds, AGENT_HEARTBEAT_SECONDS)


def agent_deadline(request: AwaitRequest) -> float:
    """When the runner ends the agent as timed out (epoch seconds): at the rollout timeout
    when the workflow set no timer of its own, else a grace after it (the workflow's timer
    normally acts first)."""
    deadline = request.handle.started_at + request.spec.timeouts.agent_seconds
    return deadline if request.one_activity else deadline + RUNNER_DEADLINE_GRACE.total_seconds()


class AgentRunner(ABC):
    kind: ClassVar[str]

    @abstractmethod
    async def launch(self, request: LaunchRequest, contract: AgentContract) -> AgentHandle:
        """Start the attempt's agent, or return the handle of the one already started."""

    @abstractmethod
    async def wait(
        self, request: AwaitRequest, contract: AgentContract, heartbeat: Heartbeat
    ) -> AgentExit:
        """Await the agent's end, calling `heartbeat` at least every `agent_heartbeat_interval`.

        Enforces the rollout timeout itself (`agent_deadline`): returns `timed_out` once the
        agent is killed. Raises `agent_lost_error` when the agent is gone without an exit
        status.
        """

    @abstractmethod
    async def kill(self, handle: AgentHandle) -> None:
        """Stop the agent and everything it started; idempotent."""

    @abstractmethod
    async def stop(self, request: LaunchRequest) -> None:
        """Stop the attempt's agent knowing only the rollout and attempt (its launch was
        cancelled, so there may be no handle), and refuse any later launch of the attempt."""

    async def grade(self, request: AwaitRequest, heartbeat: Heartbeat) -> GradeReport:
        """Grade the ended attempt in its sandbox (RewardSpec.grader), calling `heartbeat`
        meanwhile. Idempotent: a retry grades the same agent state again. Raises
        SandboxSpecError for a grader that cannot work here, GradingError when grading could
        not run."""
        raise SandboxSpecError(
            f"the {self.kind!r} runner cannot grade an attempt: a reward 'grader' needs a "
            "local agent with a 'sandbox'"
        )

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release what the runner holds (clients, watchers)."""
