"""The rollout status model: every status a rollout can hold and the legal moves between them.

One table, consulted by every writer (the workflow) and readable by every reader (CLI, trainer).
"""

from __future__ import annotations

from enum import StrEnum

from darl.workflows.errors import WorkflowsError


class RolloutStatus(StrEnum):
    PENDING = "pending"
    LAUNCHING = "launching"
    RUNNING = "running"
    SCORING = "scoring"
    SUCCEEDED = "succeeded"
    FAILED_AGENT = "failed_agent"
    FAILED_INFRA = "failed_infra"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"


S = RolloutStatus

# FAILED_INFRA -> LAUNCHING is the retry of a rollout attempt (rule 4): the agent never
# got a fair run, so it gets another one. Every other failure is the agent's result, including
# LAUNCHING -> FAILED_AGENT: an agent spec that cannot start (no such command) fails the same way
# on every attempt, so it is not retried.
TRANSITIONS: dict[RolloutStatus, frozenset[RolloutStatus]] = {
    S.PENDING: frozenset({S.LAUNCHING, S.CANCELLED}),
    S.LAUNCHING: frozenset({S.RUNNING, S.FAILED_INFRA, S.FAILED_AGENT, S.CANCELLED}),
    S.RUNNING: frozenset({S.SCORING, S.FAILED_AGENT, S.FAILED_INFRA, S.TIMED_OUT, S.CANCELLED}),
    S.SCORING: frozenset({S.SUCCEEDED, S.FAILED_AGENT, S.FAILED_INFRA, S.CANCELLED}),
    S.FAILED_INFRA: frozenset({S.LAUNCHING, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED_AGENT: frozenset(),
    S.TIMED_OUT: frozenset(),
    S.CANCELLED: frozenset(),
}

FINAL_STATUSES = frozenset({S.SUCCEEDED, S.FAILED_AGENT, S.FAILED_INFRA, S.TIMED_OUT, S.CANCELLED})


class IllegalTransitionError(WorkflowsError, ValueError):
    """A writer tried a move the table does not allow: a bug in DARL, never bad user input."""


def check_transition(current: RolloutStatus, new: RolloutStatus) -> RolloutStatus:
    """Return `new` if the table allows `current -> new`, else raise IllegalTransitionError."""
    if new not in TRANSITIONS[current]:
        raise IllegalTransitionError(f"rollout status cannot go from {current} to {new}")
    return new
