"""What a rollout reports: an agent's report of an attempt, each model call's event, what a
replay made of its record, a grader's verdict, and the rollout's result, the outcome its
trainer counts, and its progress; with the byte budgets that keep them within Temporal's."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from darl.workflows.contracts.base import Contract, RolloutMode
from darl.workflows.rollout_status import RolloutStatus

# What an agent may report of one attempt. Each report is a signal to the rollout's workflow
# and its fields reach the rollout's result: Temporal payloads, 2 MB at most, in a history of
# 50 MB. So a report (its answer and metadata, as JSON) is at most REPORT_MAX_BYTES, an
# attempt sends at most REPORTS_PER_ATTEMPT of them (a flood of signals would fill the history
# until Temporal ended the rollout, a zero turned into an infra failure), and reports merged
# stay within one report's budget (`rollout_inbox.merged`).
REPORT_MAX_BYTES = 64 * 1024
REPORTS_PER_ATTEMPT = 32
# The most model calls one attempt makes: each is an event of a few hundred bytes in its
# rollout's history (and a call id in its result), across up to 20 attempts (the gateway
# refuses the next call with a 400 `calls_exhausted`).
MAX_CALLS_PER_ATTEMPT = 2048


class AgentReport(Contract):
    """What an agent says about its own attempt (DARL_RESULT_URL, AGL reward event, HTTP reply)."""

    attempt: int = 0
    reward: float | None = None
    answer: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    def size_bytes(self) -> int:
        """The size its budget counts (REPORT_MAX_BYTES): its answer and metadata as JSON."""
        return len(self.model_dump_json(include={"answer", "metadata"}).encode())

    def over_budget(self) -> str | None:
        """What is wrong with its size, or None within REPORT_MAX_BYTES."""
        size = self.size_bytes()
        if size <= REPORT_MAX_BYTES:
            return None
        return (
            f"the report's answer and metadata are {size:,} bytes as JSON; a report holds at "
            f"most {REPORT_MAX_BYTES:,}: report what the reward needs"
        )

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("reward must be a finite number")
        return value


class ModelCallEvent(Contract):
    """One captured model call, small enough for workflow history (rule 1: no token data)."""

    call_id: str
    rollout_id: str
    attempt: int
    sequence: int
    endpoint: Literal["chat.completions", "completions"]
    upstream: str
    policy_version: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    latency_ms: float
    http_status: int
    retry_count: int = 0
    streamed: bool = False
    record_ref: str
    # The call of an earlier attempt this one reproduces (answered from its record, rule 10).
    replayed_from: str | None = None


class ReplayOutcome(Contract):
    """What an attempt that resumed by replay made of the record it was handed: the gateway
    says it when the attempt is closed."""

    # The attempts whose recorded calls were offered (newest first), and how many there were
    # (with the prefix's, for a rollout that starts from one: RolloutSpec.prefix).
    sources: list[int]
    recorded: int
    # Calls of this attempt answered from the record; of them, those that matched only under
    # the rollout's normalizers.
    replayed: int
    normalized: int = 0
    # The call of this attempt at which the replay ended with recorded calls left unused (the
    # agent asked something the record does not hold: a clock, randomness, the network);
    # None when the record was used up.
    diverged_at: int | None = None
    # For a rollout that starts from a prefix (RolloutSpec.prefix): how many of this
    # attempt's first calls, in order, reproduce the prefix's calls (directly, or through an
    # earlier attempt of the rollout that replayed them).
    prefix_calls: int = 0


class TrajectorySummary(Contract):
    """What a reward function sees of the trajectory (the full records are in the store)."""

    rollout_id: str
    attempt: int
    calls: int
    prompt_tokens: int
    completion_tokens: int
    call_ids: list[str]
    exit_code: int | None = None
    reported_reward: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of_calls(
        cls,
        rollout_id: str,
        attempt: int,
        calls: list[ModelCallEvent],
        exit_code: int | None,
        report: AgentReport | None,
        metadata: dict[str, Any],
    ) -> TrajectorySummary:
        """The one way to summarize an attempt, so that await_agent and the workflow agree."""
        return cls(
            rollout_id=rollout_id,
            attempt=attempt,
            calls=len(calls),
            prompt_tokens=sum(c.prompt_tokens for c in calls),
            completion_tokens=sum(c.completion_tokens for c in calls),
            call_ids=[c.call_id for c in sorted(calls, key=lambda c: c.sequence)],
            exit_code=exit_code,
            reported_reward=report.reward if report is not None else None,
            metadata=metadata,
        )


class GradeReport(Contract):
    """What a grader (GraderSpec) found in an attempt's workspace: kept with the rollout and
    shown in the viewer. `reason` says in a sentence why the reward is what it is: how many
    tests passed, or why none counts (the workspace could not be graded, the run was
    tampered with or cut short)."""

    reward: float
    reason: str | None = None
    tests: int = 0
    passed: int = 0
    # The tests that should pass and did not (the first few), and what the grader had to
    # restore or remove before running them: the agent's edits to tests and configuration.
    failed_tests: list[str] = Field(default_factory=list)
    restored: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)
    exit_code: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    # The agent's change to its workspace (a unified diff, cut at a size), and the end of
    # the grading log.
    diff: str = ""
    diff_truncated: bool = False
    log_tail: str = ""


class RolloutResult(Contract):
    run_id: str
    rollout_id: str
    group_id: str
    mode: RolloutMode
    status: RolloutStatus
    reward: float | None = None
    answer: str | None = None
    attempts: int
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    policy_versions: list[int] = Field(default_factory=list)
    # The committed calls of the final attempt, in order: a reader of the trajectory store
    # takes exactly these records.
    call_ids: list[str] = Field(default_factory=list)
    events_digest: str = ""
    exit_code: int | None = None
    error: str | None = None
    duration_seconds: float = 0.0
    duplicate_signals: int = 0
    stale_signals: int = 0
    metadata: dict[str, Any] = Field(default_factory=dict)
    # Model calls of the final attempt that got no answer (never trained on), and the first
    # few of them said: status, protocol, error.
    failed_calls: int = 0
    failed_call_errors: list[str] = Field(default_factory=list)
    # Calls of the final attempt answered from an earlier attempt's record (rule 10), and
    # where its replay ended early, if it did (ReplayOutcome.diverged_at).
    replayed_calls: int = 0
    replay_diverged_at: int | None = None
    # For a rollout that starts from a prefix (RolloutSpec.prefix): how many of the final
    # attempt's first calls reproduce it (the trainer masks them out of its rows), and, when
    # that is fewer than the prefix holds, the call at which the agent left it (it asked
    # something the prefix does not hold, or ended first).
    prefix_calls: int = 0
    prefix_diverged_at: int | None = None
    # The grader's verdict, when the reward came from one (RewardSpec.grader).
    grade: GradeReport | None = None
    # What the agent reported of itself (its reward, answer and metadata) when DARL decided
    # the reward without it (a grader): its claim, kept apart and never used; `answer` and
    # `metadata` are then empty.
    agent_claim: AgentReport | None = None

    def outcome(self) -> RolloutOutcome:
        """What its trainer decides with: this result without what is only shown."""
        return RolloutOutcome.model_validate(self.model_dump())


# The most of a rollout's error its outcome carries (the full error is in its result).
OUTCOME_ERROR_CHARS = 1000


class RolloutOutcome(Contract):
    """A finished rollout as its trainer sees it: what the TrainingWorkflow counts, groups
    and trains with, a few hundred bytes whatever the rollout did. The answer, metadata,
    grade, agent claim and call ids stay in the rollout's own result (its workflow's result:
    `temporal workflow result`, the viewer) and the store; the trainer reads the calls from
    the store, checked against `calls` and `events_digest`. A full `RolloutResult` reads as
    its outcome (unknown fields are dropped), so a signal that carries a whole result (as
    recorded histories hold) still counts."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    run_id: str
    rollout_id: str
    group_id: str
    mode: RolloutMode
    status: RolloutStatus
    reward: float | None = None
    attempts: int
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # The SHA-256 of the final attempt's committed call ids, in order, one per line.
    events_digest: str = ""
    error: str | None = None
    duration_seconds: float = 0.0
    failed_calls: int = 0
    replayed_calls: int = 0
    replay_diverged_at: int | None = None
    prefix_calls: int = 0
    prefix_diverged_at: int | None = None

    @field_validator("error", mode="before")
    @classmethod
    def _error_cut(cls, error: Any) -> Any:
        if isinstance(error, str) and len(error) > OUTCOME_ERROR_CHARS:
            return error[:OUTCOME_ERROR_CHARS] + " [...]"
        return error


class RolloutReport(Contract):
    """The `report_rollout` local activity's input: a finished rollout's outcome for the
    workflow `report_to` (its trainer)."""

    report_to: str
    result: RolloutOutcome


class RolloutProgress(Contract):
    """The answer of the `status` query."""

    rollout_id: str
    status: RolloutStatus
    attempt: int
    calls: int
    prompt_tokens: int
    completion_tokens: int
    reward: float | None = None
    error: str | None = None
    replayed_calls: int = 0
