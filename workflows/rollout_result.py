"""What a rollout's workflow says of it: the facts its attempts found (reward, answer, exit code,
error, failed calls, replay, grade), kept as they come, and, assembled from them and the final
attempt's calls, the RolloutResult it returns and the `status` query's answer."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from darl.workflows.contracts import (
    AgentExit,
    AgentReport,
    GradeReport,
    ReplayOutcome,
    RolloutProgress,
    RolloutResult,
    RolloutSpec,
)
from darl.workflows.rollout_inbox import RolloutInbox
from darl.workflows.rollout_replay import prefix_calls, prefix_diverged_at
from darl.workflows.rollout_status import RolloutStatus

# How many failed model calls a RolloutResult says in words (it counts them all).
FAILED_CALLS_SHOWN = 5


@dataclass
class RolloutFindings:
    """What the rollout's attempts found, the latest of each, for its result. What belongs to
    one attempt alone (its error, its replay, its grade, its agent's claim) is cleared when the
    next starts; the rest stands until a later attempt says otherwise."""

    reward: float | None = None
    answer: str | None = None
    exit_code: int | None = None
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    # The final attempt's model calls that got no answer (status, protocol, error; the first
    # few) and how many there were.
    failed_calls: list[str] = field(default_factory=list)
    failed_call_count: int = 0
    # What the current attempt made of the record it was handed.
    replay: ReplayOutcome | None = None
    # The grader's verdict on the final attempt (RewardSpec.grader), and what its agent
    # claimed meanwhile.
    grade: GradeReport | None = None
    agent_claim: AgentReport | None = None

    def start_attempt(self) -> None:
        self.error = None
        self.replay = None
        self.grade = None
        self.agent_claim = None

    def take_exit(self, agent_exit: AgentExit, report: AgentReport | None, graded: bool) -> None:
        """How the attempt's agent ended, as its close said, and what it reported (by signal
        and in the close, merged). A `graded` rollout's reward is DARL's to decide: what the
        agent says of itself is its claim, kept apart."""
        self.exit_code = agent_exit.exit_code
        self.failed_calls = list(agent_exit.failed_calls)
        count = agent_exit.failed_call_count
        self.failed_call_count = len(self.failed_calls) if count is None else count
        if graded:
            self.agent_claim = report
        elif report is not None:
            self.answer = report.answer
            self.metadata = dict(report.metadata)


def rollout_result(
    spec: RolloutSpec,
    *,
    status: RolloutStatus,
    attempts: int,
    inbox: RolloutInbox,
    findings: RolloutFindings,
    duration_seconds: float,
) -> RolloutResult:
    """The rollout's one result: what it found, and the final attempt's calls."""
    calls = inbox.calls
    call_ids = [c.call_id for c in sorted(calls, key=lambda c: c.sequence)]
    return RolloutResult(
        run_id=spec.run_id,
        rollout_id=spec.rollout_id,
        group_id=spec.group_id,
        mode=spec.mode,
        status=status,
        reward=findings.reward,
        answer=findings.answer,
        attempts=attempts,
        calls=len(calls),
        prompt_tokens=sum(c.prompt_tokens for c in calls),
        completion_tokens=sum(c.completion_tokens for c in calls),
        policy_versions=sorted({c.policy_version for c in calls}),
        call_ids=call_ids,
        events_digest=hashlib.sha256("\n".join(call_ids).encode()).hexdigest(),
        exit_code=findings.exit_code,
        error=findings.error,
        duration_seconds=duration_seconds,
        duplicate_signals=inbox.duplicate_signals,
        stale_signals=inbox.stale_signals,
        metadata=findings.metadata,
        failed_calls=findings.failed_call_count,
        failed_call_errors=findings.failed_calls[:FAILED_CALLS_SHOWN],
        replayed_calls=inbox.replayed_calls(),
        replay_diverged_at=findings.replay.diverged_at if findings.replay is not None else None,
        prefix_calls=prefix_calls(findings.replay, inbox.prefix_replays()),
        prefix_diverged_at=prefix_diverged_at(spec.prefix, findings.replay),
        grade=findings.grade,
        agent_claim=findings.agent_claim,
    )


def rollout_progress(
    spec: RolloutSpec,
    *,
    status: RolloutStatus,
    attempt: int,
    inbox: RolloutInbox,
    findings: RolloutFindings,
) -> RolloutProgress:
    """Where the rollout stands: the `status` query's answer."""
    calls = inbox.calls
    return RolloutProgress(
        rollout_id=spec.rollout_id,
        status=status,
        attempt=attempt,
        calls=len(calls),
        prompt_tokens=sum(c.prompt_tokens for c in calls),
        completion_tokens=sum(c.completion_tokens for c in calls),
        reward=findings.reward,
        error=findings.error,
        replayed_calls=inbox.replayed_calls(),
    )
