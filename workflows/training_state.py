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

MAX_HELD = 2048
"""The most rollouts a run's state holds at once: running, booked (a branching group's
branches) or back and waiting for their group's step. Each is a few hundred bytes of the
state carried across continue-as-new, one Temporal payload of at most 2 MB (the budgets:
docs/architecture.md; tests/unit/test_payload_budgets.py builds the worst case)."""
MAX_INFLIGHT = MAX_HELD
"""The largest `knobs.max_inflight`."""
MAX_VALIDATION_TASKS = 1536
"""The most rollouts a step's validation starts (a pending id each in the state, their
rewards tallied: `ValTally`)."""


class Knobs(Contract):
    """What a running training can change through the `update_knobs` update."""

    learning_rate: float | None = Field(default=None, gt=0, le=1)
    """The learning rate of the next steps (above 0, at most 1); None (the default): the
    backend's own setting."""
    max_inflight: int = Field(default=64, ge=1, le=MAX_INFLIGHT)
    """`async` mode: train rollouts out at once, at most (64 by default, 2048 at most); at
    least one group's worth."""
    max_staleness: int = Field(default=1, ge=0, le=1000)
    """`async` mode: a group rolled out by weights more than this many versions behind is
    dropped, not trained (1 by default). `sync` mode trains on-policy only."""


# --- state carried across continue-as-new ---------------------------------------------------


class TaskRow(Contract):
    """A row the trainer starts a group for, at `position` of its epoch's order. The task goes
    by reference, row `index` of the run's dataset (its validation dataset for a validation
    group), so that no task enters the trainer's history (a row can be hundreds of KB, a step
    hundreds of rows): the rollouts' start reads it and checks its `digest` (a file rewritten
    under a run is refused, never read as other tasks). A row with the `task` itself, as
    carried state and recorded histories may hold, still reads; the trainer writes none."""

    epoch: int
    """The epoch the row is read in (from 0)."""
    position: int
    """The row's place in its epoch's order (from 0)."""
    index: int | None = Field(default=None, ge=0)
    """The row's index in the dataset file (from 0); None when the row carries its task."""
    digest: str | None = None
    """A digest of the row as read, checked when the rollouts' start reads it again; None
    when the row carries its task."""
    task: Task | None = None
    """The task itself (older carried state and recorded histories); None: by reference."""

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
    """As `RolloutResult.rollout_id`."""
    status: RolloutStatus
    """As `RolloutResult.status`."""
    reward: float | None = None
    """As `RolloutResult.reward`."""
    attempts: int
    """As `RolloutResult.attempts`: its final attempt is the one trained."""
    calls: int = 0
    """As `RolloutResult.calls`."""
    completion_tokens: int = 0
    """As `RolloutResult.completion_tokens`."""
    events_digest: str = ""
    """As `RolloutResult.events_digest`."""
    prefix_calls: int = 0
    """As `RolloutResult.prefix_calls`."""
    prefix_diverged_at: int | None = None
    """As `RolloutResult.prefix_diverged_at`."""


class State(BaseModel):
    """Workflow state: mutable, but as strict about its fields as a contract (and, like one,
    described by the attribute docstrings under its fields)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


class ValTally(State):
    """A step's validation rollouts that reported, as the figures its record gets: how many,
    how many with a reward, their sum, and how many reached `success_threshold`."""

    results: int = 0
    """Validation rollouts that reported."""
    rewarded: int = 0
    """Of them, those with a reward."""
    reward_sum: float = 0.0
    """Their rewards, summed."""
    successes: int = 0
    """Those whose reward reached `success_threshold`."""


class GroupState(State):
    """A GRPO group: its task, the version it was started at, who is still out, who came back."""

    group_id: str
    """The group's id (its rollouts' ids extend it)."""
    mode: RolloutMode = RolloutMode.TRAIN
    """`train` (the default) or `val`."""
    step: int = 0
    """For validation groups: the step they validate (0 otherwise)."""
    policy_version: int
    """The policy version the group was started at."""
    pending: list[str]
    """Its rollouts started and not yet reported."""
    results: list[Member] = Field(default_factory=list)
    """Its rollouts that reported."""
    started_at: float
    """When it was started, in workflow time (seconds since the Unix epoch)."""
    seed: str | None = None
    """A branching group (`groups.mode: branch`): its seed rollout; None otherwise."""
    unopened: list[str] = Field(default_factory=list)
    """A branching group: the members booked to start once the seed has reported (not yet
    started, so not `pending`)."""
    row: TaskRow | None = None
    """A branching group: the row of the task its members run."""
    branch_point: int | None = None
    """A branching group: the call its branches start at (the prefix length k). None until
    the seed reported, and for good when it could not branch (its members then start
    whole)."""
    task: Task | None = None
    """Read, never written: a group carried with its task itself rather than its `row`."""
    surprisal: list[float] = Field(default_factory=list)
    """Read, never written: the per-call figures a branch point was chosen from."""
    seed_from: Member | None = None
    """A group whose seed is drawn from the run's record (`groups.seed: adaptive`): the
    earlier rollout of the same task all its members branch from, until they start; None
    otherwise."""
    tally: ValTally | None = None
    """A step's validation (`mode` val): one book group for all its rollouts, each a group
    of its own for its workflow (`<run>.v<step>.t<position>`), which report into this tally
    rather than as members (only what the step's record says of them is kept)."""

    @model_serializer(mode="wrap")
    def _without_empty_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """What is unset stays out of the JSON (a group is one of thousands in the state)."""
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if k not in _OMITTED_WHEN_EMPTY or v}


# GroupState's optional fields, left out of its JSON when unset or empty.
_OMITTED_WHEN_EMPTY = frozenset(
    {"seed", "unopened", "row", "branch_point", "task", "surprisal", "seed_from", "tally"}
)


class TaskOutcomes(State):
    """A task's recent outcomes in the run (`groups.seed: adaptive`), and the latest rollout
    of each outcome that could seed a branching group of it: a few hundred bytes a task."""

    recent: str = Field(default="", pattern="^[01]*$")
    """Its last outcomes, oldest first: 1 a success (the reward reached
    `success_threshold`), 0 a failure."""
    success: Member | None = None
    """Its latest success with a prefix to give (two calls or more, its own prefix held)."""
    failure: Member | None = None
    """Its latest failure with a prefix to give."""


class Counters(State):
    """Every rollout the run started ends in exactly one of the rollout buckets."""

    rollouts_started: int = 0
    """Rollouts the run started (train and validation)."""
    rollouts_trained: int = 0
    """Rollouts trained on, in a step."""
    rollouts_in_dropped_groups: int = 0
    """Rollouts with a reward whose group was dropped (too small, too stale, all rewards
    equal)."""
    rollouts_failed: int = 0
    """Rollouts that finished without a reward (agent failure, timeout, infra)."""
    rollouts_cancelled: int = 0
    """Rollouts cancelled (a stop, the end of the run)."""
    rollouts_validated: int = 0
    """Validation rollouts that reported with a reward."""
    rollouts_left_over: int = 0
    """Rollouts complete when the run ended, with no step left to train them."""
    rollouts_broken_branches: int = 0
    """Branches whose prefix could not be replayed, left out of their group
    (`groups.broken_branches: drop`)."""
    groups_trained: int = 0
    """Groups trained in a step."""
    groups_dropped_stale: int = 0
    """Groups dropped as too many versions behind (`knobs.max_staleness`)."""
    groups_dropped_small: int = 0
    """Groups dropped with fewer trainable members than `min_group_size`."""
    groups_dropped_equal: int = 0
    """Groups dropped because all their rewards were equal (`equal_reward_groups: drop`)."""
    duplicate_reports: int = 0
    """Reports of a rollout that had already reported (counted, not used)."""
    unknown_reports: int = 0
    """Reports of a rollout the run does not know (counted, not used)."""
    reconciled_rollouts: int = 0
    """Rollouts looked up after `reconcile_after_seconds` of silence that had ended."""
    rollouts_resumed: int = 0
    """Replay (rule 10): rollouts whose final attempt resumed a lost one from its record."""
    calls_replayed: int = 0
    """Replay: the calls those attempts replayed."""
    replays_diverged: int = 0
    """Replay: the replays that ended before the record did (the agent asked what the record
    does not hold)."""
    groups_branched: int = 0
    """Branching groups (`groups.mode: branch`) whose members started from their seed's
    prefix."""
    branches_broken: int = 0
    """Branches that left the prefix early (dropped or kept)."""
    branch_calls_replayed: int = 0
    """The calls the branches replayed from their prefix."""
    seeds_not_branched: int = 0
    """Seeds that could not branch (fewer than two calls, or no reward), whose members
    started whole."""

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
    """The step (from 1)."""
    policy_version: int
    """The policy version it made (the step's number)."""
    time: float
    """When it was recorded, in workflow time (seconds since the Unix epoch)."""
    rollouts: int
    """Rollouts trained in the step."""
    groups: int
    """Groups trained in the step."""
    reward_mean: float
    """The mean reward of the rollouts trained."""
    reward_std: float
    """Their rewards' standard deviation (population)."""
    success_rate: float
    """The share of them whose reward reached `success_threshold`."""
    response_tokens_mean: float
    """Their mean completion tokens."""
    staleness_mean: float
    """How many versions behind the trained groups were, on average (0 in `sync` mode)."""
    paused_seconds: float
    """Seconds the gateway held or refused new calls during the step's weight sync."""
    rollouts_per_minute: float
    """Rollouts ended per minute, over the last few steps (one step's own window can be a
    moment long in async mode)."""
    rollouts_ended: int = 0
    """Rollouts ended so far in the run (any counter)."""
    train_seconds: float
    """Seconds the trainer's step took."""
    trainer: dict[str, float] = Field(default_factory=dict)
    """The backend's own metrics of the step (loss, KL, grad norm, ...)."""
    val_reward_mean: float | None = None
    """The mean reward of the step's validation rollouts; None: no validation at the step."""
    val_success_rate: float | None = None
    """The share of the step's validation rollouts that reached `success_threshold`."""


class TrainingState(State):
    """What a training run knows, carried across continue-as-new in
    `TrainingConfig.carried_state`."""

    step: int = 0
    """Steps trained so far."""
    policy_version: int = 0
    """The policy version the policy servers serve (the last step's)."""
    policy_path: str | None = None
    """The checkpoint of `policy_version`, as the policy servers load it; None before the
    first."""
    initialized: bool = False
    """Whether the starting policy has been set up (`initialize_policy`)."""
    epoch: int = 0
    """The epoch the dataset is read in (from 0)."""
    cursor: int = 0
    """The next row's place in the epoch's order."""
    dataset_exhausted: bool = False
    """Whether every epoch's rows have been started."""
    groups: dict[str, GroupState] = Field(default_factory=dict)
    """The groups out or waiting for a step, by id."""
    ready: list[str] = Field(default_factory=list)
    """Complete train groups waiting for a step, oldest first."""
    counters: Counters = Field(default_factory=Counters)
    """The run's counts of rollouts and groups."""
    knobs: Knobs = Field(default_factory=Knobs)
    """The knobs in force (the config's, as `update_knobs` changed them)."""
    recent_steps: list[StepRecord] = Field(default_factory=list)
    """The last few steps' records."""
    paused: bool = False
    """Whether the run is paused (the `pause` signal)."""
    stop_requested: bool = False
    """Whether a stop was asked for (the `stop` signal)."""
    stop_cancels_inflight: bool = True
    """Whether that stop cancels the rollouts out (`StopRequest.cancel_inflight`)."""
    stop_grace_seconds: float | None = None
    """Seconds a stop that lets rollouts finish waits for them (`StopRequest.grace_seconds`);
    None: the config's `stop_grace_seconds`."""
    runs: int = 1
    """Runs of the workflow's continue-as-new chain so far (1 for the first)."""
    started_at: float = 0.0
    """When the chain's first run started, in workflow time (seconds since the Unix
    epoch)."""
    unwritten_records: list[StepRecord] = Field(default_factory=list)
    """Step records (or their late validation results) not yet written to disk."""
    failed_in_a_row: int = 0
    """Rollouts that failed since the last one that succeeded."""
    last_failure: str | None = None
    """The last failed rollout's error."""
    task_outcomes: dict[int, TaskOutcomes] = Field(default_factory=dict)
    """`groups.seed: adaptive`: the outcomes of the tasks last trained on, by their row's
    index in the dataset, least recently recorded first (training_adaptive_seeds.py bounds
    them)."""
