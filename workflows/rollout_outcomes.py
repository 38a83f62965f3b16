"""What RolloutWorkflow makes of how an attempt ended: an activity's failure (its cause in words,
the rollout's cancellation, a reward that cannot work, an earlier run's result), the agent's
exit in words, and the reward await_agent computed. Deterministic: used in the workflow."""

from __future__ import annotations

import asyncio

from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

from darl.workflows.contracts import (
    AgentExit,
    AgentScore,
    RolloutResult,
    RolloutSpec,
    TrajectorySummary,
)
from darl.workflows.errors import WorkflowsError
from darl.workflows.names import REWARD_SPEC_ERROR, ROLLOUT_ALREADY_RAN_ERROR
from darl.workflows.rollout_identity import EarlierRunError

# How much of each incident an infra failure's error quotes, and how many incidents.
INCIDENT_CHARS = 500
INCIDENTS_SHOWN = 3


def cause_of(err: ActivityError) -> str:
    cause = err.cause
    return str(cause) if cause is not None else str(err)


def raise_if_cancelled(err: ActivityError) -> None:
    """A cancelled workflow cancels the activity it awaits, which then fails with a
    CancelledError cause: that is the rollout's cancellation, not the activity's failure."""
    if isinstance(err.cause, CancelledError):
        raise asyncio.CancelledError from err


def error_type(err: ActivityError) -> str | None:
    cause = err.cause
    return cause.type if isinstance(cause, ApplicationError) else None


def raise_if_the_rollout_ends(err: ActivityError) -> None:
    """An attempt's activity failed in a way that ends the rollout, not the attempt: the
    rollout was cancelled, it already ran to a result (EarlierRunError), or its reward cannot
    work. A reward that cannot work is bad input (rule 9): the workflow fails at once with the
    reason, before any agent ran, as a run's start check fails a training run."""
    raise_if_cancelled(err)
    if error_type(err) == ROLLOUT_ALREADY_RAN_ERROR:
        raise earlier_run(err) from err
    if error_type(err) == REWARD_SPEC_ERROR:
        raise ApplicationError(cause_of(err), type=REWARD_SPEC_ERROR, non_retryable=True)


def timeout_message(spec: RolloutSpec) -> str:
    return f"agent did not finish within {spec.timeouts.agent_seconds:g}s"


def exit_message(agent_exit: AgentExit) -> str:
    why = "was OOM-killed" if agent_exit.oom_killed else f"exited with {agent_exit.exit_code}"
    tail = agent_exit.log_tail.strip()
    return f"agent {why}" + (f"; log tail:\n{tail}" if tail else "")


def incidents_message(incidents: list[str]) -> str:
    """The first few of DARL's incidents during an attempt, each cut, for its error."""
    shown = "; ".join(i[:INCIDENT_CHARS] for i in incidents[:INCIDENTS_SHOWN])
    return shown + ("; ..." if len(incidents) > INCIDENTS_SHOWN else "")


class RewardFailedError(WorkflowsError):
    """The reward function failed in await_agent (its message)."""


def reward_computed_at_close(
    score: AgentScore | None, summary: TrajectorySummary, answer: str | None
) -> float | None:
    """The reward await_agent computed, when it had exactly the inputs the workflow scores
    with (the same calls, answer, report and metadata); None when it had other inputs or
    computed none. Raises RewardFailedError with the reward function's error."""
    if score is None or score.summary != summary or score.answer != answer:
        return None
    if score.reward is None:
        raise RewardFailedError(score.error or "the reward function gave no reward")
    return score.reward


def earlier_run(err: ActivityError) -> EarlierRunError:
    """The earlier execution's result carried by a RolloutAlreadyRan error, or, when it left
    none (terminated, failed), a failure of this execution naming it (rule 7: a rollout id has
    one result, and no workflow reports what it did not see)."""
    cause = err.cause
    details = cause.details if isinstance(cause, ApplicationError) else ()
    if details and isinstance(details[0], dict):
        return EarlierRunError(RolloutResult.model_validate(details[0]))
    raise ApplicationError(cause_of(err), type=ROLLOUT_ALREADY_RAN_ERROR, non_retryable=True)
