"""What a rollout is asked to do: `RolloutSpec`, its task and byte budgets, and the parts it
holds besides the agent (reward, grader, timeouts, replay matching, a prefix to start from).
Sent as JSON: `temporal workflow start --type RolloutWorkflow --task-queue darl-rollouts
--workflow-id rollout/<rollout_id> --input-file rollout.json` starts one."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, JsonValue, field_validator, model_validator

from darl.workflows.contracts.agent_specs import (
    AgentSpec,
    KubernetesAgentSpec,
    LocalAgentSpec,
    WorkflowAgentSpec,
)
from darl.workflows.contracts.base import ROLLOUT_ID_PATTERN, Contract, RolloutMode
from darl.workflows.contracts.revisions import CURRENT_REVISION, ONE_ACTIVITY_REVISION
from darl.workflows.json_paths import value_at
from darl.workflows.replay_normalizers import check_patterns, check_presets


def _present(task: JsonValue) -> JsonValue:
    if task is None:
        raise ValueError("a task must be a JSON value other than null (a missing task?)")
    return task


Task = Annotated[JsonValue, AfterValidator(_present)]
"""A task is any JSON value, as Agent Lightning's rollout `input` is: an object, a list, a
string, a number or a boolean. Null is refused: it is far more often a missing task."""


TASK_MAX_BYTES = 768 * 1024
"""Bytes: the largest task, as compact JSON (768 KiB). A task travels whole only to its own
rollout: in its workflow's start and in each attempt's launch (Temporal payloads of 2 MB at
most), to a Kubernetes agent in a Secret (1 MiB). The trainer's workflow holds tasks by
reference (`TaskRow`), never the rows themselves."""
SPEC_MAX_BYTES = 1024 * 1024
"""Bytes: the largest rollout spec as JSON (1 MiB): its task and what the run sets (an
agent, a reward; a training config holds at most 128 KiB), the largest input of a rollout's
workflow and its activities."""


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
    """`swe_tests` (the default) runs the task's SWE-bench tests; `command` runs `command`."""
    command: list[str] | None = None
    """The grading command as an argv list, for `kind: command` only (required there); it
    grades 1 when it exits 0, else 0. None for `swe_tests`."""
    env_map: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the grading command, as `LocalAgentSpec.env_map` maps them
    (`"input.<path>"` a task field, anything else itself). Empty by default."""
    partial_credit: float = Field(default=0.0, ge=0.0, le=1.0)
    """From 0 to 1: the reward when not every test passes is this times the share of tests
    that passed. 0 (the default): all or nothing."""
    hidden_fields: list[str] = Field(
        default_factory=lambda: ["patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS"]
    )
    """Task fields the agent never sees (left out of DARL_TASK, the task file, `env_map` and
    the Agent Lightning rollout route); by default SWE-bench's gold patch and its tests."""

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
    """`exact_match`, `numeric_match` or `module:function`, computed after the agent exits.
    None (the default): the agent reports its reward itself (or a `grader` computes it)."""
    answer_key: str = "answer"
    """The task field holding the reference answer a reward function compares with
    (`task[answer_key]`); `answer` by default."""
    missing_reward: float | None = None
    """The reward of an agent that exits 0 without one. None (the default): such a rollout
    fails."""
    grader: GraderSpec | None = None
    """A reward DARL computes in the attempt's sandbox after the agent exits (`GraderSpec`);
    None (the default): none. Not together with `function`."""

    @model_validator(mode="after")
    def _one_source(self) -> RewardSpec:
        if self.grader is not None and self.function is not None:
            raise ValueError("give a reward 'function' or a 'grader', not both")
        return self


class RolloutTimeouts(Contract):
    """How long each part of a rollout's attempt may take, in seconds."""

    agent_seconds: float = Field(default=600.0, gt=0)
    """Seconds: the rollout timeout, the longest one attempt's agent may run (from its
    launch); past it the agent is killed and the attempt times out. 600 by default."""
    heartbeat_seconds: float = Field(default=30.0, gt=0)
    """Seconds: a worker waiting on the agent that has not heartbeat for this long is taken
    as lost; the wait is retried and re-attaches to the running agent (an agent gone without
    an exit status fails the attempt as infra, and a new attempt starts). 30 by default."""
    launch_seconds: float = Field(default=60.0, gt=0)
    """Seconds: the longest the `launch_agent` activity may take to start the agent (its
    start-to-close timeout). 60 by default."""
    reward_seconds: float = Field(default=60.0, gt=0)
    """Seconds: the longest a reward function or a grader's tests may take. 60 by default."""
    retry_backoff_seconds: float = Field(default=5.0, ge=0)
    """Seconds the rollout waits between a failed attempt and the next. 5 by default."""


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
    """Preset normalizers: `durations`, `iso_timestamps`, `temp_paths`, `hex_ids`, `pids`.
    Empty (the default): strict matching."""
    patterns: list[str] = Field(default_factory=list)
    """The rollout's own regular expressions (Python `re` syntax): spans they match are
    ignored when requests are compared. Empty by default."""

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
    """The rollout whose recorded calls are the prefix (another rollout than this one)."""
    attempt: int = Field(default=1, ge=1, le=20)
    """Which attempt of that rollout recorded them (1 to 20; 1 by default)."""
    calls: int = Field(ge=1, le=100_000)
    """How many of that attempt's first calls, in order, the prefix is (1 to 100,000)."""


class RolloutSpec(Contract):
    """One rollout: a task, the agent that works on it and where its reward comes from. The
    input of a `RolloutWorkflow`, whose workflow id must be `rollout/<rollout_id>`."""

    run_id: str = Field(pattern=ROLLOUT_ID_PATTERN)
    """The run the rollout belongs to (the `DarlRun` search attribute). URL-safe: letters,
    digits, `.`, `_`, `-`; at most 200 characters."""
    rollout_id: str = Field(pattern=ROLLOUT_ID_PATTERN)
    """The rollout's id, unique on its Temporal namespace: the workflow id is
    `rollout/<rollout_id>`. URL-safe, at most 200 characters."""
    group_id: str = ""
    """The GRPO group the rollout belongs to (its rewards are compared within it), handed to
    the agent as DARL_GROUP_ID; empty (the default) for a rollout of its own."""
    task: Task
    """The task: any JSON value but null (an object, a list, a string, a number, a
    boolean), at most 768 KiB as JSON (`TASK_MAX_BYTES`)."""
    mode: RolloutMode = RolloutMode.TRAIN
    """`train` (the default) or `val`: a validation rollout is measured, never trained on."""
    agent: AgentSpec
    """How the agent runs: `kind` `local` (a process), `http` (a service) or `kubernetes`
    (a Job per attempt)."""
    reward: RewardSpec = Field(default_factory=RewardSpec)
    """Where the reward comes from; by default the agent reports it."""
    timeouts: RolloutTimeouts = Field(default_factory=RolloutTimeouts)
    """How long each part of an attempt may take (seconds)."""
    policy_version: int = 0
    """The policy version current when the rollout was started (the trainer's step; 0 by
    default); each call records the version that answered it."""
    max_attempts: int = Field(default=3, ge=1, le=20)
    """Attempts at most (1 to 20; 3 by default): an attempt that DARL's infrastructure lost
    or failed is retried, an agent's own failure is not."""
    report_to: str | None = None
    """The workflow id told the rollout's outcome when it finishes (its trainer's,
    `train/<run_id>`), in the way its `revision` says. None (the default): nobody."""
    revision: int = Field(default=1, ge=1, le=CURRENT_REVISION)
    """The command sequence the rollout's workflow runs (the table in
    `darl.workflows.contracts.revisions`). 1 by default, so that old histories replay; say
    3 (`CURRENT_REVISION`) in a spec of your own."""
    resume: Literal["replay", "restart"] = "replay"
    """What an attempt after an infrastructure failure does with the calls the attempt
    before recorded: `replay` (the default) answers the agent's requests that equal them
    from the record, so it is back where it was lost without asking the policy again;
    `restart` starts the episode over."""
    replay: ReplaySpec = Field(default_factory=ReplaySpec)
    """How `replay` matches requests against the record; strict by default."""
    prefix: PrefixSpec | None = None
    """Start from another rollout's recorded calls (a branch, `PrefixSpec`); every attempt
    replays it, `resume: restart` included. None (the default): start from the task."""

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

    @model_validator(mode="after")
    def _workflow_input_in_task(self) -> RolloutSpec:
        if isinstance(self.agent, WorkflowAgentSpec) and self.agent.input_field is not None:
            try:
                value_at(self.agent_task(), self.agent.input_field)
            except LookupError:
                raise ValueError(
                    f"the agent workflow's input_field {self.agent.input_field!r} is not in "
                    "the task (as the agent sees it)"
                ) from None
        return self

    def agent_task(self) -> JsonValue:
        """The task as the agent sees it: without the grader's hidden fields."""
        grader = self.reward.grader
        if grader is None or not isinstance(self.task, dict):
            return self.task
        return {k: v for k, v in self.task.items() if k not in grader.hidden_fields}

    def workflow_agent_input(self) -> JsonValue:
        """An agent workflow's one argument (`WorkflowAgentSpec.input_field`): the task as the
        agent sees it, or its value at that path (checked when the spec is made)."""
        task = self.agent_task()
        if isinstance(self.agent, WorkflowAgentSpec) and self.agent.input_field is not None:
            value: JsonValue = value_at(task, self.agent.input_field)
            return value
        return task
