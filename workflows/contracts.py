"""Contracts of the rollout path: what a rollout is asked to do and what it reports.

JSON-friendly pydantic models (sent through Temporal with `temporalio.contrib.pydantic`), so
`temporal workflow start --type RolloutWorkflow --input @rollout.json` works with plain JSON.
"""

from __future__ import annotations

import json
import math
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    field_validator,
    model_validator,
)

from darl.workflows.replay_normalizers import check_patterns, check_presets
from darl.workflows.rollout_status import RolloutStatus

# Rollout ids travel in URL paths (/rollouts/<id>/v1) and file names, so they stay URL-safe.
ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"


def rollout_workflow_id(rollout_id: str) -> str:
    """The one workflow id of a rollout: a retried start can never make a second agent."""
    return f"rollout/{rollout_id}"


def _present(task: JsonValue) -> JsonValue:
    if task is None:
        raise ValueError("a task must be a JSON value other than null (a missing task?)")
    return task


# A task is any JSON value, as Agent Lightning's rollout `input` is: an object, a list, a
# string, a number or a boolean. Null is refused: it is far more often a missing task.
Task = Annotated[JsonValue, AfterValidator(_present)]


class Contract(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# A task travels whole only to its own rollout: in its workflow's start and in each attempt's
# launch (Temporal payloads of 2 MB at most), to a Kubernetes agent in a Secret (1 MiB). The
# trainer's workflow holds tasks by reference (`TaskRow`), never the rows themselves.
TASK_MAX_BYTES = 768 * 1024
# A whole rollout spec: its task and what the run sets (an agent, a reward; a training config
# holds at most 128 KiB): the largest input of a rollout's workflow and its activities.
SPEC_MAX_BYTES = 1024 * 1024


def task_size(task: JsonValue) -> int:
    """A task's size as its budget counts it (TASK_MAX_BYTES): its JSON, in bytes."""
    return len(json.dumps(task, ensure_ascii=False, separators=(",", ":")).encode())


def task_over_budget(task: JsonValue) -> str | None:
    """What is wrong with a task's size, naming its largest field, or None within
    TASK_MAX_BYTES."""
    size = task_size(task)
    if size <= TASK_MAX_BYTES:
        return None
    largest = ""
    if isinstance(task, dict) and task:
        name = max(task, key=lambda k: task_size(task[k]))
        largest = f" (the largest field, {name!r}, is {task_size(task[name]):,})"
    return (
        f"the task is {size:,} bytes as JSON{largest}; a task holds at most "
        f"{TASK_MAX_BYTES:,}: keep large files out of the row (a path or URL the agent reads)"
    )


class RolloutMode(StrEnum):
    TRAIN = "train"
    VAL = "val"


class SandboxLimits(Contract):
    """What one attempt's sandbox may use, the agent's and its grading's alike. Each process
    gets `memory_mb` of address space, `cpu_seconds` of CPU and writes files of at most
    `file_size_mb`; the sandbox runs at most `processes` processes and threads at once, its
    private /tmp holds `tmp_mb`; the grader copies a workspace of at most `workspace_mb`
    (each file once however many links it has, by its full size even where it is sparse) and
    `workspace_files` entries. Hitting one is the agent's outcome, never DARL's failure: the
    process that hit it is refused or killed, and a workspace over its limit grades 0."""

    memory_mb: int = Field(default=8192, ge=64)
    processes: int = Field(default=512, ge=16)
    cpu_seconds: int = Field(default=3600, ge=1)
    file_size_mb: int = Field(default=1024, ge=1)
    tmp_mb: int = Field(default=1024, ge=1)
    workspace_mb: int = Field(default=2048, ge=1)
    workspace_files: int = Field(default=200_000, ge=100)


class SandboxSpec(Contract):
    """A fresh workspace per attempt, isolated, for agents that change files (coding agents).

    The workspace is the task's repository at its commit: `repo` and `commit` name task
    fields (`input.<path>`, as `env_map` does; SWE-bench's `repo` and `base_commit` by
    default), and `<repos_dir>/<repo with "/" as "__">` is a git repository holding that
    commit (SWE-smith's mirror naming). Each attempt gets its own copy, the agent's working
    directory, seen by the agent at `workdir`; its git directory stays outside, so the agent
    cannot rewrite what it started from. `isolation` `bubblewrap` runs the agent (and a
    grader's tests) in Debian's `bwrap`: nothing writable but the workspace and a private
    `/tmp`, nothing readable but the system directories and `read_only`, no network but the
    gateway. `none` runs it in the workspace without isolation (for machines without
    bubblewrap; the agent can then reach anything the worker can). A relative `repos_dir` or
    `read_only` path is the worker's working directory's; `{prefix}` (the worker's Python
    environment) and `{cwd}` work in them as in `command` and `env`.
    """

    repos_dir: str
    repo: str = "input.repo"
    commit: str = "input.base_commit"
    workdir: str = "/testbed"
    isolation: Literal["bubblewrap", "none"] = "bubblewrap"
    # Paths the agent sees read-only, at the same place, besides the system directories
    # (/usr, the /etc files programs need): its harness's virtual environment, its own code.
    read_only: list[str] = Field(default_factory=list)
    limits: SandboxLimits = Field(default_factory=SandboxLimits)

    @field_validator("repo", "commit")
    @classmethod
    def _task_path(cls, value: str) -> str:
        if not value.startswith("input."):
            raise ValueError(f"{value!r} must name a task field as 'input.<path>'")
        return value


class LocalAgentSpec(Contract):
    """An agent run as a local process in its own process group.

    `command` is an argv list; in it and in `env` values, `{python}` is the worker's Python,
    `{prefix}` its environment (`sys.prefix`) and `{cwd}` the directory the worker runs in.
    `entrypoint` (`module:Class` or `module.Class`) runs an Agent Lightning style agent:
    `Class().run()`, awaited if it is a coroutine. Exactly one of the two is given.
    `env_map` sets variables as Agent Lightning does: `"input"` is the task (as JSON unless it
    is a string), `"input.<path>"` a value in it (`input.question`, `input.items.0`; a path
    the task lacks is an error), any other value is itself (`{"MODEL": "Qwen/Qwen2.5-1.5B"}`).
    """

    kind: Literal["local"] = "local"
    command: list[str] | None = None
    entrypoint: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    env_map: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    # A fresh, isolated workspace per attempt (the agent's working directory; `cwd` unset).
    sandbox: SandboxSpec | None = None

    @model_validator(mode="after")
    def _one_way_to_start(self) -> LocalAgentSpec:
        if (self.command is None) == (self.entrypoint is None):
            raise ValueError("give exactly one of 'command' and 'entrypoint'")
        if self.command is not None and not self.command:
            raise ValueError("'command' must not be empty")
        if self.sandbox is not None and self.cwd is not None:
            raise ValueError("a sandboxed agent runs in its workspace: leave 'cwd' unset")
        return self


class HttpAgentSpec(Contract):
    """An agent that already runs as an HTTP service: DARL POSTs the rollout to `url` and the
    response body is the agent's report. The request carries `Idempotency-Key:
    <rollout>/<attempt>`; a service that honours it never runs an attempt twice."""

    kind: Literal["http"] = "http"
    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    env_map: dict[str, str] = Field(default_factory=dict)


class KubernetesAgentSpec(Contract):
    """An agent run as a Kubernetes Job, one per attempt.

    `job_template` is a Job manifest (YAML, Jinja placeholders over `task`, `rollout_id`,
    `attempt`, `run_id`, `mode`, and Agent Lightning's `input` (the task), `job_name` and
    `yaml_escape` filter) on the worker's disk; without one, `image` and `command`
    make a one-container Job. DARL fills in the name, labels, the agent contract in the
    environment (the token from a Secret owned by the Job) and enforces what makes an attempt
    durable and contained: `backoffLimit: 0`, `restartPolicy: Never`, the rollout timeout as
    `activeDeadlineSeconds`, no service account token, non-root (a template that asks for
    root, `runAsUser: 0`, runs only in the worker's sandbox namespace under its RuntimeClass,
    and is refused without one).

    With a reward `grader`, the repository the agent works on is the image's `workdir`, put
    on a volume of the attempt before the agent starts (with a copy of it as the image had
    it, which the agent never sees); after the agent, DARL grades it in a second Job on that
    volume, in the same image, with `test_python` (the image's Python that has pytest)
    running the tests, within `limits` (memory, /tmp, what the grader copies).
    """

    kind: Literal["kubernetes"] = "kubernetes"
    job_template: str | None = None
    image: str | None = None
    command: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    env_map: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/testbed"
    test_python: str = "python"
    limits: SandboxLimits = Field(default_factory=SandboxLimits)

    @model_validator(mode="after")
    def _one_way_to_start(self) -> KubernetesAgentSpec:
        if (self.job_template is None) == (self.image is None):
            raise ValueError("give exactly one of 'job_template' and 'image'")
        return self


AgentSpec = Annotated[
    LocalAgentSpec | HttpAgentSpec | KubernetesAgentSpec, Field(discriminator="kind")
]


class GraderSpec(Contract):
    """A reward DARL computes itself after the agent exits, by running a command in a copy
    of the attempt's sandbox (its workspace as the agent left it), so the agent can neither
    report nor fake it: a report from the agent never overrides a grade.

    `swe_tests` grades a SWE-bench/SWE-smith task: it restores every file the agent changed
    that the tests read (test files, conftest.py, pytest and packaging configuration),
    removes what the agent added that pytest or Python would load (conftest.py, plugins,
    sitecustomize, .pth files, caches), applies the task's hidden `test_patch`, and runs
    its `FAIL_TO_PASS` and `PASS_TO_PASS` tests with pytest. `command` runs `command` (an
    argv list, `env_map` as an agent's) and grades 1 when it exits 0. Either way the reward
    is 1 when everything passes and otherwise `partial_credit` times the share of tests that
    passed (0 for a failed `command`). `hidden_fields` are task fields the agent never sees
    (its DARL_TASK, task file, `env_map` and the Agent Lightning rollout route).
    """

    kind: Literal["swe_tests", "command"] = "swe_tests"
    command: list[str] | None = None
    env_map: dict[str, str] = Field(default_factory=dict)
    partial_credit: float = Field(default=0.0, ge=0.0, le=1.0)
    hidden_fields: list[str] = Field(
        default_factory=lambda: ["patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS"]
    )

    @model_validator(mode="after")
    def _command_for_command(self) -> GraderSpec:
        if (self.kind == "command") != bool(self.command):
            raise ValueError("a 'command' grader needs a non-empty 'command'; only it takes one")
        return self


class RewardSpec(Contract):
    """Where the reward comes from.

    `function` None: the agent reports it (DARL_RESULT_URL or the Agent Lightning reward event).
    Otherwise `exact_match`, `numeric_match` or `module:function`, called with the task, the
    agent's answer and a `TrajectorySummary`; the reference answer is `task[answer_key]` (the
    built-ins need an object task; a function of your own takes any task).
    `grader` is a reward DARL computes in the attempt's sandbox after the agent (GraderSpec).
    `missing_reward` is used when the agent succeeds without a reward; None makes that a failure.
    """

    function: str | None = None
    answer_key: str = "answer"
    missing_reward: float | None = None
    grader: GraderSpec | None = None

    @model_validator(mode="after")
    def _one_source(self) -> RewardSpec:
        if self.grader is not None and self.function is not None:
            raise ValueError("give a reward 'function' or a 'grader', not both")
        return self


class RolloutTimeouts(Contract):
    agent_seconds: float = Field(default=600.0, gt=0)
    heartbeat_seconds: float = Field(default=30.0, gt=0)
    launch_seconds: float = Field(default=60.0, gt=0)
    reward_seconds: float = Field(default=60.0, gt=0)
    retry_backoff_seconds: float = Field(default=5.0, ge=0)


class ReplaySpec(Contract):
    """How a new attempt's requests are matched against the calls the attempt before it
    recorded (`RolloutSpec.resume` `replay`, docs/architecture.md rule 10). Strict by default:
    a request matches a recorded call only when its canonical form is equal. `normalize`
    names presets (`durations`, `iso_timestamps`, `temp_paths`, `hex_ids`, `pids`) and
    `patterns` the rollout's own regular expressions: spans they match in message text are
    ignored by the comparison. A call replayed that way is stored with the prompt the agent
    sent and the recorded completion, marked `replay_normalized` (a completion sampled from a
    prompt that differed in those spans: slightly off-policy, as a stale call is)."""

    normalize: list[str] = Field(default_factory=list)
    patterns: list[str] = Field(default_factory=list)

    @field_validator("normalize")
    @classmethod
    def _known_presets(cls, value: list[str]) -> list[str]:
        check_presets(value)
        return value

    @field_validator("patterns")
    @classmethod
    def _compiling(cls, value: list[str]) -> list[str]:
        check_patterns(value)
        return value


def check_grader_agent(agent: AgentSpec, reward: RewardSpec) -> None:
    """Raise ValueError unless the reward's grader, if any, can reach the agent's sandbox:
    a local agent's, or the volume a Kubernetes agent's attempt works on."""
    if reward.grader is None or isinstance(agent, KubernetesAgentSpec):
        return
    if not isinstance(agent, LocalAgentSpec) or agent.sandbox is None:
        raise ValueError(
            "a reward 'grader' runs in the attempt's sandbox: give a local agent a "
            "'sandbox', or run the agent as a Kubernetes Job (an HTTP agent's workspace is "
            "out of DARL's reach)"
        )


class PrefixSpec(Contract):
    """A recorded prefix a rollout starts from (a branch of a GRPO group, docs/branching.md):
    the first `calls` calls, in order, of attempt `attempt` of rollout `rollout_id` (the
    attempt its result names: the trajectory that was trained). The rollout's agent runs from
    its start, unchanged; the gateway answers its requests that equal those calls from their
    record (rule 10's matching), so the agent rebuilds the state it had at that point itself,
    and the calls after them go to the policy. The first request that equals none ends the
    prefix early: the rollout goes on live and its result says where
    (`RolloutResult.prefix_diverged_at`)."""

    rollout_id: str = Field(pattern=ROLLOUT_ID_PATTERN)
    attempt: int = Field(default=1, ge=1, le=20)
    calls: int = Field(ge=1, le=100_000)


# `RolloutSpec.revision` is the command sequence a RolloutWorkflow runs; a history replays only
# under the sequence that recorded it. This table is the one place that says what each is:
#
#   revision  what the workflow does                           what branches on it
#   1         a deadline timer beside await_agent (whose own    -
#             deadline is RUNNER_DEADLINE_GRACE later), RUNNING
#             upserted, compute_reward an activity of its
#             own, the report a `rollout_finished`
#             signal-external
#   2         an attempt is one activity: no timer (the runner  RolloutWorkflow._one_activity:
#             ends the agent at the rollout timeout), a         _await_agent, _transition;
#             function reward or a grade comes back in          AwaitRequest.one_activity:
#             await_agent's result, RUNNING left to the status  RolloutActivities._closed,
#             query on a first attempt                          _graded, agent_deadline
#
# In every revision the close's call events come back in await_agent's result (up to
# RETURNED_EVENTS_CAP; more are signalled).
#   3         the report to `report_to` is a local activity     RolloutWorkflow._local_report:
#             in the last workflow task, which the worker       _report; activities/
#             batches into one `rollouts_finished` signal       trainer_reports.py
#
# The starter says the revision: DARL's trainer starts CURRENT_REVISION (training_groups.py);
# `darl rollout` starts what the spec file says, CURRENT_REVISION if it says none; the
# temporal CLI starts what the file says (the rollout files under examples/ say 3). The
# field's default is 1, what a spec without it meant to the releases before, so their
# histories replay as 1 (tests/workflow/histories). A field rather than `workflow.patched`,
# whose marker and TemporalChangeVersion upsert would cost every rollout two history events;
# the TrainingWorkflow, one per run, uses `workflow.patched`, and its markers are listed in
# its module docstring (training_workflow.py).
ONE_ACTIVITY_REVISION = 2
LOCAL_REPORT_REVISION = 3
CURRENT_REVISION = LOCAL_REPORT_REVISION


class RolloutSpec(Contract):
    run_id: str = Field(pattern=ROLLOUT_ID_PATTERN)
    rollout_id: str = Field(pattern=ROLLOUT_ID_PATTERN)
    group_id: str = ""
    task: Task
    mode: RolloutMode = RolloutMode.TRAIN
    agent: AgentSpec
    reward: RewardSpec = Field(default_factory=RewardSpec)
    timeouts: RolloutTimeouts = Field(default_factory=RolloutTimeouts)
    policy_version: int = 0
    max_attempts: int = Field(default=3, ge=1, le=20)
    # A workflow id told the RolloutResult (the trainer), as the revision says (the table
    # above CURRENT_REVISION).
    report_to: str | None = None
    # The command sequence the rollout's workflow runs: the table above CURRENT_REVISION.
    revision: int = Field(default=1, ge=1, le=CURRENT_REVISION)
    # What an attempt after an infrastructure failure does with the calls the attempt before
    # recorded: `replay` answers the agent's requests that equal them from the record, so it
    # is back where it was lost without asking the policy again (rule 10); `restart` starts
    # the episode over.
    resume: Literal["replay", "restart"] = "replay"
    replay: ReplaySpec = Field(default_factory=ReplaySpec)
    # Start from another rollout's recorded calls (a branch): PrefixSpec. Every attempt
    # replays it, `resume: restart` included.
    prefix: PrefixSpec | None = None

    @field_validator("task")
    @classmethod
    def _task_within_budget(cls, task: JsonValue) -> JsonValue:
        over = task_over_budget(task)
        if over is not None:
            raise ValueError(over)
        return task

    @model_validator(mode="after")
    def _within_budget(self) -> RolloutSpec:
        size = len(self.model_dump_json().encode())
        if size > SPEC_MAX_BYTES:
            raise ValueError(
                f"the rollout spec is {size:,} bytes as JSON; a spec holds at most "
                f"{SPEC_MAX_BYTES:,} (its task at most {TASK_MAX_BYTES:,})"
            )
        return self

    @model_validator(mode="after")
    def _prefix_is_another_rollouts(self) -> RolloutSpec:
        if self.prefix is not None and self.prefix.rollout_id == self.rollout_id:
            raise ValueError(
                f"rollout {self.rollout_id!r} cannot start from its own prefix: name the "
                "rollout it branches from (a retry replays its own attempts anyway)"
            )
        return self

    @model_validator(mode="after")
    def _grader_has_a_sandbox(self) -> RolloutSpec:
        grader = self.reward.grader
        if grader is None:
            return self
        check_grader_agent(self.agent, self.reward)
        if self.revision < ONE_ACTIVITY_REVISION:
            raise ValueError(
                f"a reward 'grader' needs revision {ONE_ACTIVITY_REVISION} or later (the "
                f'attempt\'s await_agent grades it); say "revision": {CURRENT_REVISION}'
            )
        if not isinstance(self.task, dict):
            raise ValueError("a reward 'grader' needs an object task (a SWE-bench instance)")
        if grader.kind == "swe_tests":
            for name in ("FAIL_TO_PASS", "PASS_TO_PASS"):
                if name not in self.task:
                    raise ValueError(f"a 'swe_tests' grader needs the task field {name!r}")
        return self

    def agent_task(self) -> JsonValue:
        """The task as the agent sees it: without the grader's hidden fields."""
        grader = self.reward.grader
        if grader is None or not isinstance(self.task, dict):
            return self.task
        return {k: v for k, v in self.task.items() if k not in grader.hidden_fields}


# What an agent may report of one attempt. Each report is a signal to the rollout's workflow
# and its fields reach the rollout's result: Temporal payloads, 2 MB at most, in a history of
# 50 MB. So a report (its answer and metadata, as JSON) is at most REPORT_MAX_BYTES, an
# attempt sends at most REPORTS_PER_ATTEMPT of them (a flood of signals would fill the history
# until Temporal ended the rollout, a zero turned into an infra failure), and reports merged
# stay within one report's budget (`rollout_outcomes.merged`).
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
    its outcome (unknown fields are dropped), so reports of earlier releases still count."""

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


# Activity inputs and outputs.


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
    # The attempt is this one activity (RolloutSpec.revision, the table above
    # CURRENT_REVISION): the runner ends the agent at the rollout timeout itself (not a grace
    # later), the close's call events come back in the result, a reward function is computed
    # here.
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
    # CLOSE_LISTED of them, and how many there were (None from workers before the count).
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
