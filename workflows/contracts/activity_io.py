"""The inputs and outputs of a rollout's activities: what launch_agent is given and returns,
what await_agent is given and how it says the attempt's agent ended, and compute_reward's
input."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from darl.workflows.contracts.base import Contract
from darl.workflows.contracts.results import (
    AgentReport,
    GradeReport,
    ModelCallEvent,
    ReplayOutcome,
    TrajectorySummary,
)
from darl.workflows.contracts.rollout_spec import RolloutSpec


class LaunchRequest(Contract):
    spec: RolloutSpec
    attempt: int
    # The W3C traceparent of the rollout's span, handed to the agent (TRACEPARENT).
    traceparent: str | None = None
    # The earlier attempts whose recorded calls this one replays (rule 10), newest first: the
    # last that recorded calls, then the ones its record continues. In the agent's token.
    replay_from: list[int] = Field(default_factory=list)


class AgentHandle(Contract):
    """What `launch_agent` returns and `await_agent` re-attaches with; `data` is the runner's."""

    kind: str
    rollout_id: str
    attempt: int
    started_at: float
    data: dict[str, Any] = Field(default_factory=dict)


class AwaitRequest(Contract):
    spec: RolloutSpec
    attempt: int
    handle: AgentHandle
    # The attempt is this one activity (RolloutSpec.revision 2 and later, the table in
    # contracts/revisions.py): the runner ends the agent at the rollout timeout itself (not a
    # grace later), and a reward function or a grader is computed here.
    one_activity: bool = False
    # As LaunchRequest.replay_from: the agent's token says it, and the close reports on it.
    replay_from: list[int] = Field(default_factory=list)


class AgentScore(Contract):
    """A reward computed inside await_agent from what the attempt's close returned: the inputs
    it was computed from and the reward, or the reward function's error. The workflow takes it
    only when the inputs are exactly those it would score with."""

    answer: str | None
    summary: TrajectorySummary
    reward: float | None = None
    error: str | None = None


# The most failed calls, and incidents, an attempt's close hands its workflow (each a line of
# up to a few KB; an agent can make thousands of calls that fail): AgentExit stays in budget.
CLOSE_LISTED = 16


class AgentExit(Contract):
    """How an attempt's agent ended. `exit_code` 0 means it finished its work."""

    exit_code: int | None
    # Set when the runner's own deadline killed the agent.
    timed_out: bool = False
    oom_killed: bool = False
    report: AgentReport | None = None
    log_tail: str = ""
    # What DARL's own infrastructure did to the attempt while its agent ran, as the gateway
    # recorded it when the attempt was closed: a 5xx it answered the agent, an outage of the
    # gateway. An agent that failed with any of these failed because of DARL (rule 7).
    infra_incidents: list[str] = Field(default_factory=list)
    # The attempt's model calls that got no answer, as the gateway recorded them: the first
    # CLOSE_LISTED of them, and how many there were (None when the worker that closed the
    # attempt did not count them).
    failed_calls: list[str] = Field(default_factory=list)
    failed_call_count: int | None = None
    # Every call event of the attempt the gateway had recorded when it closed it (rule 1: the
    # close reads them from the store), unless there were too many: then the gateway signalled
    # them and this is empty. The workflow merges them as it merges a `model_calls` signal.
    calls: list[ModelCallEvent] = Field(default_factory=list)
    score: AgentScore | None = None
    # What the attempt made of the record it replayed, when it was handed one.
    replay: ReplayOutcome | None = None
    # A grader's verdict (RewardSpec.grader), or why there is none.
    grade: GradeReport | None = None
    grade_error: str | None = None


class RewardRequest(Contract):
    spec: RolloutSpec
    answer: str | None
    summary: TrajectorySummary
