"""What a TrainingWorkflow carries across continue-as-new: its groups, counters, step records
and knobs, as data (the GroupBook in training_groups.py works on it)."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from darl.workflows.contracts import Contract, RolloutMode, Task
from darl.workflows.rollout_status import RolloutStatus

# The most rollouts a run's state holds at once: running, booked (a branching group's
# branches) or back and waiting for their group's step. Each is a few hundred bytes of the
# state carried across continue-as-new, one Temporal payload of at most 2 MB (the budgets:
# docs/architecture.md; tests/unit/test_payload_budgets.py builds the worst case).
MAX_HELD = 2048
MAX_INFLIGHT = MAX_HELD
# The most rollouts a step's validation starts (a pending id each in the state, their
# rewards tallied: `ValTally`).
MAX_VALIDATION_TASKS = 1536


class Knobs(Contract):
    """What a running training can change through the `update_knobs` update."""

    learning_rate: float | None = Field(default=None, gt=0, le=1)
    max_inflight: int = Field(default=64, ge=1, le=MAX_INFLIGHT)
    max_staleness: int = Field(default=1, ge=0, le=1000)


# --- state carried across continue-as-new ---------------------------------------------------


class TaskRow(Contract):
    """A row the trainer starts a group for, at `position` of its epoch's order. The task goes
    by reference, row `index` of the run's dataset (its validation dataset for a validation
    group), so that no task enters the trainer's history (a row can be hundreds of KB, a step
    hundreds of rows): the rollouts' start reads it and checks its `digest` (a file rewritten
    under a run is refused, never read as other tasks). A row with the `task` itself, as
    carried state and recorded histories may hold, still reads; the trainer writes none."""

    epoch: int
    position: int
    index: int | None = Field(default=None, ge=0)
    digest: str | None = None
    task: Task | None = None

    @model_validator(mode="after")
    def _one_task(self) -> TaskRow:
        by_reference = self.index is not None and self.digest is not None
        if by_reference == (self.task is not None):
            raise ValueError("a task row holds a task, or its index and digest")
        return self


class Member(Contract):
    """A group member that reported, as the run's state keeps it: what its group's
    completion, its batch and its step's figures need (its outcome as it came is told once,
    `TrainingWorkflow.rollouts_finished`). A whole `RolloutResult` in carried state reads
    as its member (what a member does not keep is ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rollout_id: str
    status: RolloutStatus
    reward: float | None = None
    attempts: int
    calls: int = 0
    completion_tokens: int = 0
    events_digest: str = ""
    prefix_calls: int = 0
    prefix_diverged_at: int | None = None


class State(BaseModel):
    """Workflow state: mutable, but as strict about its fields as a contract."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ValTally(State):
    """A step's validation rollouts that reported, as the figures its record gets: how many,
    how many with a reward, their sum, and how many reached `success_threshold`."""

    results: int = 0
    rewarded: int = 0
    reward_sum: float = 0.0
    successes: int = 0


class GroupState(State):
    """A GRPO group: its task, the version it was started at, who is still out, who came back."""

    group_id: str
    mode: RolloutMode = RolloutMode.TRAIN
    step: int = 0  # for validation groups: the step they validate
    policy_version: int
    pending: list[str]
    results: list[Member] = Field(default_factory=list)
    started_at: float
    # A branching group (`groups.mode: branch`): its seed rollout, the members booked to
    # start once the seed has reported (not yet started, so not `pending`), the row of the
    # task they run, and the call they branch at (the prefix length k: None until the seed
    # reported, and for good when it could not branch, its members then starting whole).
    seed: str | None = None
    unopened: list[str] = Field(default_factory=list)
    row: TaskRow | None = None
    branch_point: int | None = None
    # Read, never written: a group carried with its task itself rather than its `row`, and
    # the per-call figures its branch point was chosen from.
    task: Task | None = None
    surprisal: list[float] = Field(default_factory=list)
    # A step's validation (`mode` val): one book group for all its rollouts, each a group of
    # its own for its workflow (`<run>.v<step>.t<position>`), which report into this tally
    # rather than as members (only what the step's record says of them is kept).
    tally: ValTally | None = None

    @model_serializer(mode="wrap")
    def _without_empty_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """What is unset stays out of the JSON (a group is one of thousands in the state)."""
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if k not in _OMITTED_WHEN_EMPTY or v}


# GroupState's optional fields, left out of its JSON when unset or empty.
_OMITTED_WHEN_EMPTY = frozenset(
    {"seed", "unopened", "row", "branch_point", "task", "surprisal", "tally"}
)


class Counters(State):
    """Every rollout the run started ends in exactly one of the rollout buckets."""

    rollouts_started: int = 0
    rollouts_trained: int = 0
    rollouts_in_dropped_groups: int = 0
    rollouts_failed: int = 0  # finished without a reward (agent failure, timeout, infra)
    rollouts_cancelled: int = 0
    rollouts_validated: int = 0
    # Complete when the run ended, but no step was left to train them.
    rollouts_left_over: int = 0
    # Branches whose prefix could not be replayed, left out of their group
    # (`groups.broken_branches: drop`).
    rollouts_broken_branches: int = 0
    groups_trained: int = 0
    groups_dropped_stale: int = 0
    groups_dropped_small: int = 0
    groups_dropped_equal: int = 0
    duplicate_reports: int = 0
    unknown_reports: int = 0
    reconciled_rollouts: int = 0
    # Replay (rule 10): rollouts whose final attempt resumed a lost one from its record, the
    # calls it replayed, and the replays that ended before the record did (the agent asked
    # what the record does not hold).
    rollouts_resumed: int = 0
    calls_replayed: int = 0
    replays_diverged: int = 0
    # Branching groups (`groups.mode: branch`): groups whose members started from their
    # seed's prefix, branches that left the prefix early (dropped or kept), the calls the
    # branches replayed from their prefix, and seeds that could not branch (fewer than two
    # calls, or no reward) whose members started whole.
    groups_branched: int = 0
    branches_broken: int = 0
    branch_calls_replayed: int = 0
    seeds_not_branched: int = 0

    def ended(self) -> int:
        """Rollouts whose end is counted; equals `rollouts_started` once nothing is out."""
        return (
            self.rollouts_trained
            + self.rollouts_in_dropped_groups
            + self.rollouts_failed
            + self.rollouts_cancelled
            + self.rollouts_validated
            + self.rollouts_left_over
            + self.rollouts_broken_branches
        )


class StepRecord(Contract):
    """One training step as the `metrics` query and `metrics.jsonl` show it."""

    step: int
    policy_version: int
    time: float
    rollouts: int
    groups: int
    reward_mean: float
    reward_std: float
    success_rate: float
    response_tokens_mean: float
    staleness_mean: float
    paused_seconds: float
    # Over the last few steps (one step's own window can be a moment long in async mode).
    rollouts_per_minute: float
    # Rollouts ended so far in the run (any counter).
    rollouts_ended: int = 0
    train_seconds: float
    trainer: dict[str, float] = Field(default_factory=dict)
    val_reward_mean: float | None = None
    val_success_rate: float | None = None


class TrainingState(State):
    step: int = 0
    policy_version: int = 0
    # The checkpoint of `policy_version`, as the policy servers load it.
    policy_path: str | None = None
    initialized: bool = False
    epoch: int = 0
    cursor: int = 0
    dataset_exhausted: bool = False
    groups: dict[str, GroupState] = Field(default_factory=dict)
    # Complete train groups waiting for a step, oldest first.
    ready: list[str] = Field(default_factory=list)
    counters: Counters = Field(default_factory=Counters)
    knobs: Knobs = Field(default_factory=Knobs)
    recent_steps: list[StepRecord] = Field(default_factory=list)
    paused: bool = False
    stop_requested: bool = False
    stop_cancels_inflight: bool = True
    # How long a stop that lets rollouts finish waits for them (StopRequest.grace_seconds);
    # None: the config's stop_grace_seconds.
    stop_grace_seconds: float | None = None
    runs: int = 1
    started_at: float = 0.0
    # Step records (or their late validation results) not yet written to disk.
    unwritten_records: list[StepRecord] = Field(default_factory=list)
    # Rollouts that failed since the last one that succeeded, and the last one's error.
    failed_in_a_row: int = 0
    last_failure: str | None = None
