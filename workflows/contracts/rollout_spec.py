"""What a rollout is asked to do: `RolloutSpec`, its task and byte budgets, and the parts it
holds besides the agent (reward, grader, timeouts, replay matching, a prefix to start from).
Sent as JSON, so `temporal workflow start --type RolloutWorkflow --input @rollout.json` works."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, JsonValue, field_validator, model_validator

from darl.workflows.contracts.agent_specs import AgentSpec, KubernetesAgentSpec, LocalAgentSpec
from darl.workflows.contracts.base import ROLLOUT_ID_PATTERN, Contract, RolloutMode
from darl.workflows.contracts.revisions import CURRENT_REVISION, ONE_ACTIVITY_REVISION
from darl.workflows.replay_normalizers import check_patterns, check_presets


def _present(task: JsonValue) -> JsonValue:
    if task is None:
        raise ValueError("a task must be a JSON value other than null (a missing task?)")
    return task


# A task is any JSON value, as Agent Lightning's rollout `input` is: an object, a list, a
# string, a number or a boolean. Null is refused: it is far more often a missing task.
Task = Annotated[JsonValue, AfterValidator(_present)]


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
    # The workflow (the trainer) told the rollout's outcome, in the way its revision says
    # (contracts/revisions.py).
    report_to: str | None = None
    # The command sequence the rollout's workflow runs: the table in contracts/revisions.py.
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
