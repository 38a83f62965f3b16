"""What a rollout reports: an agent's report of an attempt, each model call's event, what a
replay made of its record, a grader's verdict, and the rollout's result, the outcome its
trainer counts, and its progress; with the byte budgets that keep them within Temporal's."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from darl.workflows.contracts.base import Contract, RolloutMode
from darl.workflows.rollout_status import RolloutStatus

REPORT_MAX_BYTES = 64 * 1024
"""Bytes: the largest report of an agent, its answer and metadata as JSON (64 KiB). Each
report is a signal to the rollout's workflow and its fields reach the rollout's result:
Temporal payloads, 2 MB at most, in a history of 50 MB. Reports merged stay within one
report's budget (`rollout_inbox.merged`)."""
REPORTS_PER_ATTEMPT = 32
"""The most reports one attempt sends: a flood of signals would fill the history until
Temporal ended the rollout, a zero turned into an infra failure."""
MAX_CALLS_PER_ATTEMPT = 2048
"""The most model calls one attempt makes: each is an event of a few hundred bytes in its
rollout's history (and a call id in its result), across up to 20 attempts (the gateway
refuses the next call with a 400 `calls_exhausted`)."""


class AgentReport(Contract):
    """What an agent says about its own attempt (DARL_RESULT_URL, AGL reward event, HTTP reply)."""

    attempt: int = 0
    """The attempt the report is of (the gateway sets it from the agent's token)."""
    reward: float | None = None
    """The reward the agent reports, a finite number; None: none (the reward comes from
    elsewhere, or the rollout's `missing_reward`)."""
    answer: str | None = None
    """The agent's final answer, what a reward function compares; None: none."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Anything else the agent wants kept with its result (JSON). The answer and metadata
    hold at most 64 KiB as JSON (`REPORT_MAX_BYTES`)."""

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
    """The call's id, unique in its rollout: its record's key in the trajectory store."""
    rollout_id: str
    """The rollout that made the call."""
    attempt: int
    """The attempt that made the call (1 for the first)."""
    sequence: int
    """The call's place in its attempt, from 0, in the order the gateway took them."""
    endpoint: Literal["chat.completions", "completions"]
    """The OpenAI API the call was answered through (Anthropic Messages calls are
    `chat.completions` once translated)."""
    upstream: str
    """The policy server that answered it (its URL)."""
    policy_version: int
    """The policy version that answered it."""
    prompt_tokens: int
    """Tokens of the prompt."""
    completion_tokens: int
    """Tokens of the completion."""
    finish_reason: str | None = None
    """Why the completion ended (`stop`, `length`, `tool_calls`, `abort`); None: not said."""
    latency_ms: float
    """Milliseconds from the gateway taking the call to its answer."""
    http_status: int
    """The HTTP status the agent got (200 for a recorded call)."""
    retry_count: int = 0
    """How many times the gateway retried the call on the policy server (0: none)."""
    streamed: bool = False
    """Whether the agent asked for a streamed answer."""
    record_ref: str
    """Where the call's full record (prompt and completion token ids, logprobs) is in the
    trajectory store."""
    replayed_from: str | None = None
    """The call of an earlier attempt this one reproduces (answered from its record, rule
    10); None: answered by the policy."""


class ReplayOutcome(Contract):
    """What an attempt that resumed by replay made of the record it was handed: the gateway
    says it when the attempt is closed."""

    sources: list[int]
    """The attempts whose recorded calls were offered, newest first."""
    recorded: int
    """How many recorded calls were offered (with the prefix's, for a rollout that starts
    from one: `RolloutSpec.prefix`)."""
    replayed: int
    """Calls of this attempt answered from the record."""
    normalized: int = 0
    """Of the replayed calls, those that matched only under the rollout's normalizers."""
    diverged_at: int | None = None
    """The call of this attempt at which the replay ended with recorded calls left unused
    (the agent asked something the record does not hold: a clock, randomness, the network);
    None when the record was used up."""
    prefix_calls: int = 0
    """For a rollout that starts from a prefix (`RolloutSpec.prefix`): how many of this
    attempt's first calls, in order, reproduce the prefix's calls (directly, or through an
    earlier attempt of the rollout that replayed them); 0 otherwise."""


class TrajectorySummary(Contract):
    """What a reward function sees of the trajectory (the full records are in the store)."""

    rollout_id: str
    """The rollout."""
    attempt: int
    """The attempt summarized (the final one)."""
    calls: int
    """Model calls the attempt made that were answered."""
    prompt_tokens: int
    """Prompt tokens of those calls, summed."""
    completion_tokens: int
    """Completion tokens of those calls, summed."""
    call_ids: list[str]
    """Their call ids, in order: their records in the trajectory store."""
    exit_code: int | None = None
    """The agent's exit code; None for an agent without one (an HTTP agent)."""
    reported_reward: float | None = None
    """The reward the agent reported itself, if it did."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """The metadata the agent reported."""

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
    """The reward the grader gave, from 0 to 1."""
    reason: str | None = None
    """Why the reward is what it is, in a sentence."""
    tests: int = 0
    """Tests run (`FAIL_TO_PASS` and `PASS_TO_PASS`; 1 for a `command` grader)."""
    passed: int = 0
    """Tests that passed."""
    failed_tests: list[str] = Field(default_factory=list)
    """The tests that should pass and did not (the first few)."""
    restored: list[str] = Field(default_factory=list)
    """Files the agent changed that the grader restored before running the tests (test
    files, conftest.py, pytest and packaging configuration)."""
    removed: list[str] = Field(default_factory=list)
    """Files the agent added that the grader removed before running the tests (conftest.py,
    plugins, sitecustomize, .pth files, caches)."""
    exit_code: int | None = None
    """The test command's exit code; None when it did not run to an exit."""
    timed_out: bool = False
    """Whether the tests ran past `RolloutTimeouts.reward_seconds` and were killed."""
    seconds: float = 0.0
    """Seconds the grading took."""
    diff: str = ""
    """The agent's change to its workspace, a unified diff (cut at a size)."""
    diff_truncated: bool = False
    """Whether `diff` was cut."""
    log_tail: str = ""
    """The end of the grading log."""


class RolloutResult(Contract):
    """A finished rollout: the result of its `RolloutWorkflow` (`temporal workflow result`,
    `darl rollout`, the viewer). Its calls' token data are in the trajectory store, named by
    `call_ids`."""

    run_id: str
    """The run the rollout belongs to (`RolloutSpec.run_id`)."""
    rollout_id: str
    """The rollout (its workflow id is `rollout/<rollout_id>`)."""
    group_id: str
    """Its GRPO group (`RolloutSpec.group_id`; empty for none)."""
    mode: RolloutMode
    """`train` or `val`, as the spec said."""
    status: RolloutStatus
    """How it ended: `succeeded`, `failed_agent`, `failed_infra`, `timed_out` or
    `cancelled` (the rollout status reference)."""
    reward: float | None = None
    """The reward; None unless it succeeded."""
    answer: str | None = None
    """The agent's answer, as it reported it; None: none."""
    attempts: int
    """Attempts made (1 when the first one ended the rollout)."""
    calls: int = 0
    """Answered model calls of the final attempt (what is trained on)."""
    prompt_tokens: int = 0
    """Prompt tokens of those calls, summed."""
    completion_tokens: int = 0
    """Completion tokens of those calls, summed."""
    policy_versions: list[int] = Field(default_factory=list)
    """The policy versions that answered those calls, ascending (more than one when a
    weight sync happened during the attempt)."""
    call_ids: list[str] = Field(default_factory=list)
    """The committed calls of the final attempt, in order: a reader of the trajectory store
    takes exactly these records."""
    events_digest: str = ""
    """The SHA-256 (hex) of `call_ids`, one per line: the trainer checks the store's calls
    against it."""
    exit_code: int | None = None
    """The final attempt's agent exit code; None: it had none (killed, an HTTP agent)."""
    error: str | None = None
    """Why the rollout did not succeed, in a sentence or a few; None when it succeeded."""
    duration_seconds: float = 0.0
    """Seconds from the workflow's start to its end, in workflow time."""
    duplicate_signals: int = 0
    """Call events signalled more than once (taken once)."""
    stale_signals: int = 0
    """Call events and reports that arrived for an attempt already over (not used)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """The metadata the agent reported (empty when a grader decided the reward)."""
    failed_calls: int = 0
    """Model calls of the final attempt that got no answer (never trained on)."""
    failed_call_errors: list[str] = Field(default_factory=list)
    """The first few of those failed calls: status, protocol, error."""
    replayed_calls: int = 0
    """Calls of the final attempt answered from an earlier attempt's record (rule 10)."""
    replay_diverged_at: int | None = None
    """The call at which the final attempt's replay ended early (`ReplayOutcome.diverged_at`);
    None when it did not (or there was no replay)."""
    prefix_calls: int = 0
    """For a rollout that starts from a prefix (`RolloutSpec.prefix`): how many of the final
    attempt's first calls reproduce it (the trainer masks them out of its rows); 0
    otherwise."""
    prefix_diverged_at: int | None = None
    """When `prefix_calls` is fewer than the prefix holds, the call at which the agent left
    it (it asked something the prefix does not hold, or ended first); None otherwise."""
    grade: GradeReport | None = None
    """The grader's verdict, when the reward came from one (`RewardSpec.grader`)."""
    agent_claim: AgentReport | None = None
    """What the agent reported of itself (its reward, answer and metadata) when DARL decided
    the reward without it (a grader): its claim, kept apart and never used; `answer` and
    `metadata` are then empty. None otherwise."""

    def outcome(self) -> RolloutOutcome:
        """What its trainer decides with: this result without what is only shown."""
        return RolloutOutcome.model_validate(self.model_dump())


OUTCOME_ERROR_CHARS = 1000
"""Characters: the most of a rollout's error its outcome carries (the full error is in its
result)."""


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
    """As `RolloutResult.run_id`."""
    rollout_id: str
    """As `RolloutResult.rollout_id`."""
    group_id: str
    """As `RolloutResult.group_id`."""
    mode: RolloutMode
    """As `RolloutResult.mode`."""
    status: RolloutStatus
    """As `RolloutResult.status`."""
    reward: float | None = None
    """As `RolloutResult.reward`."""
    attempts: int
    """As `RolloutResult.attempts`."""
    calls: int = 0
    """As `RolloutResult.calls`: the trainer reads that many calls of the final attempt."""
    prompt_tokens: int = 0
    """As `RolloutResult.prompt_tokens`."""
    completion_tokens: int = 0
    """As `RolloutResult.completion_tokens`."""
    events_digest: str = ""
    """The SHA-256 of the final attempt's committed call ids, in order, one per line."""
    error: str | None = None
    """As `RolloutResult.error`, cut at 1000 characters (`OUTCOME_ERROR_CHARS`)."""
    duration_seconds: float = 0.0
    """As `RolloutResult.duration_seconds`."""
    failed_calls: int = 0
    """As `RolloutResult.failed_calls`."""
    replayed_calls: int = 0
    """As `RolloutResult.replayed_calls`."""
    replay_diverged_at: int | None = None
    """As `RolloutResult.replay_diverged_at`."""
    prefix_calls: int = 0
    """As `RolloutResult.prefix_calls`."""
    prefix_diverged_at: int | None = None
    """As `RolloutResult.prefix_diverged_at`."""

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
    """The workflow id to tell (`RolloutSpec.report_to`)."""
    result: RolloutOutcome
    """The finished rollout's outcome."""


class RolloutProgress(Contract):
    """The answer of the `status` query."""

    rollout_id: str
    """The rollout."""
    status: RolloutStatus
    """Where it is now (`launching`, `running`, `scoring`, or how it ended)."""
    attempt: int
    """The attempt running now (or the last one)."""
    calls: int
    """Answered model calls of the current attempt so far."""
    prompt_tokens: int
    """Their prompt tokens, summed."""
    completion_tokens: int
    """Their completion tokens, summed."""
    reward: float | None = None
    """The reward, once there is one."""
    error: str | None = None
    """Why the rollout failed, once it has; None otherwise."""
    replayed_calls: int = 0
    """Calls of the current attempt answered from an earlier attempt's record."""
