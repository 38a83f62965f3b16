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
    """The `launch_agent` activity's input: start the agent of one attempt."""

    spec: RolloutSpec
    """The rollout."""
    attempt: int
    """The attempt to launch (1 for the first)."""
    traceparent: str | None = None
    """The W3C traceparent of the rollout's span, handed to the agent (TRACEPARENT); None
    without tracing."""
    replay_from: list[int] = Field(default_factory=list)
    """The earlier attempts whose recorded calls this one replays (rule 10), newest first:
    the last that recorded calls, then the ones its record continues. In the agent's token.
    Empty: no replay."""


class AgentHandle(Contract):
    """What `launch_agent` returns and `await_agent` re-attaches with; `data` is the runner's."""

    kind: str
    """The runner that launched it (`local`, `http`, `kubernetes`)."""
    rollout_id: str
    """The rollout."""
    attempt: int
    """The attempt."""
    started_at: float
    """When the agent started, in seconds since the Unix epoch (the rollout timeout counts
    from it)."""
    data: dict[str, Any] = Field(default_factory=dict)
    """What the runner needs to find the agent again (a process group, a Job's name)."""


class AgentScore(Contract):
    """A reward computed inside await_agent from what the attempt's close returned: the inputs
    it was computed from and the reward, or the reward function's error. The workflow takes it
    only when the inputs are exactly those it would score with."""

    answer: str | None
    """The answer it was computed from (None: the agent gave none)."""
    summary: TrajectorySummary
    """The trajectory it was computed from."""
    reward: float | None = None
    """The reward; None when the function failed."""
    error: str | None = None
    """The reward function's error; None when it returned a reward."""


CLOSE_LISTED = 16
"""The most failed calls, and incidents, an attempt's close hands its workflow (each a line
of up to a few KB; an agent can make thousands of calls that fail): AgentExit stays in
budget."""


class AgentExit(Contract):
    """How an attempt's agent ended. `exit_code` 0 means it finished its work."""

    exit_code: int | None
    """The agent's exit code; None when it had none (killed, an HTTP agent)."""
    timed_out: bool = False
    """Set when the runner's own deadline (the rollout timeout) killed the agent."""
    oom_killed: bool = False
    """Set when the agent was killed for running out of memory."""
    report: AgentReport | None = None
    """What the agent reported in its answer (an HTTP agent's response body); None: nothing
    (an agent's reports by DARL_RESULT_URL reach the workflow as signals)."""
    log_tail: str = ""
    """The end of the agent's output."""
    infra_incidents: list[str] = Field(default_factory=list)
    """What DARL's own infrastructure did to the attempt while its agent ran, as the gateway
    recorded it when the attempt was closed: a 5xx it answered the agent, an outage of the
    gateway. An agent that failed with any of these failed because of DARL (rule 7)."""
    failed_calls: list[str] = Field(default_factory=list)
    """The attempt's model calls that got no answer, as the gateway recorded them: the
    first 16 (`CLOSE_LISTED`)."""
    failed_call_count: int | None = None
    """How many calls got no answer; None when the worker that closed the attempt did not
    count them."""
    calls: list[ModelCallEvent] = Field(default_factory=list)
    """Every call event of the attempt the gateway had recorded when it closed it (rule 1:
    the close reads them from the store), unless there were too many: then the gateway
    signalled them and this is empty. The workflow merges them as it merges a `model_calls`
    signal."""
    score: AgentScore | None = None
    """A reward function's reward computed in the activity (revision 2 and later)."""
    replay: ReplayOutcome | None = None
    """What the attempt made of the record it replayed, when it was handed one."""
    grade: GradeReport | None = None
    """A grader's verdict (`RewardSpec.grader`)."""
    grade_error: str | None = None
    """Why there is no grade, when a grader was asked for and could not grade."""


class AwaitRequest(Contract):
    """The `await_agent` activity's input: wait for one attempt's agent to end."""

    spec: RolloutSpec
    """The rollout."""
    attempt: int
    """The attempt."""
    handle: AgentHandle
    """What `launch_agent` returned."""
    one_activity: bool = False
    """The attempt is this one activity (`RolloutSpec.revision` 2 and later, the table in
    `contracts/revisions.py`): the runner ends the agent at the rollout timeout itself (not
    a grace later), and a reward function or a grader is computed here."""
    replay_from: list[int] = Field(default_factory=list)
    """As `LaunchRequest.replay_from`: the agent's token says it, and the close reports on
    it."""
    ended: AgentExit | None = None
    """How an agent that has already ended ended: a workflow agent (`WorkflowAgentSpec`),
    whose child workflow the rollout awaited itself; await_agent then only closes the
    attempt and scores it. None (the default): await_agent awaits the agent."""


class RewardRequest(Contract):
    """The `compute_reward` activity's input (revision 1)."""

    spec: RolloutSpec
    """The rollout (its reward function and task)."""
    answer: str | None
    """The agent's answer (None: none)."""
    summary: TrajectorySummary
    """The final attempt's trajectory."""
