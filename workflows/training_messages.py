"""What crosses Temporal to and from a TrainingWorkflow besides its config: its signals,
update and queries, and the inputs and outputs of the trainer's activities."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from darl.workflows.contracts import (
    CURRENT_REVISION,
    Contract,
    PrefixSpec,
    RolloutMode,
    RolloutOutcome,
    RolloutSpec,
)
from darl.workflows.training_config import (
    MAX_WAIT_SECONDS,
    AggregationSpec,
    BackendSpec,
    DatasetSpec,
    RolloutSettings,
    TrainingConfig,
    ValidationSpec,
    WeightSyncSettings,
)
from darl.workflows.training_state import MAX_INFLIGHT, Counters, Knobs, StepRecord, TaskRow

# --- signals, updates, queries ---------------------------------------------------------------


class StopRequest(Contract):
    """The `stop` signal's input (`darl stop`): end the run.
    `cancel_inflight` False lets running rollouts finish (they are not trained): the run
    waits up to `grace_seconds` for them (None: the config's `stop_grace_seconds`), then
    cancels the ones still out."""

    cancel_inflight: bool = True
    """True (the default): cancel the rollouts out at once. False: let them finish first,
    within `grace_seconds`."""
    grace_seconds: float | None = Field(
        default=None, ge=0, le=MAX_WAIT_SECONDS, allow_inf_nan=False
    )
    """Seconds to wait for the rollouts out when `cancel_inflight` is False (a week at
    most); None (the default): the config's `stop_grace_seconds`."""


class KnobUpdate(Contract):
    """The `update_knobs` update's input: the knobs to change, the others left as they are
    (at least one). It answers with the knobs now in force (`Knobs`)."""

    learning_rate: float | None = Field(default=None, gt=0, le=1)
    """The learning rate of the next steps (above 0, at most 1); None: unchanged."""
    max_inflight: int | None = Field(default=None, ge=1, le=MAX_INFLIGHT)
    """`async` mode: train rollouts out at once, at most (1 to 2048, one group at least);
    None: unchanged."""
    max_staleness: int | None = Field(default=None, ge=0, le=1000)
    """`async` mode: versions behind a group may be and still train (0 to 1000); None:
    unchanged."""


class TrainingPhase(StrEnum):
    """What a training run is doing now (`TrainingProgress.phase`)."""

    STARTING = "starting"
    ROLLING_OUT = "rolling_out"
    TRAINING = "training"
    SYNCING = "syncing"
    VALIDATING = "validating"
    PAUSED = "paused"
    STOPPING = "stopping"
    FINISHED = "finished"


class TrainingProgress(Contract):
    """The answer of the `status` query (`darl status`)."""

    run_id: str
    """The run."""
    phase: TrainingPhase
    """What the run is doing now."""
    step: int
    """Steps trained so far."""
    policy_version: int
    """The policy version the policy servers serve."""
    epoch: int
    """The epoch the dataset is read in (from 0)."""
    cursor: int
    """The next row's place in the epoch's order."""
    inflight_rollouts: int
    """Rollouts started and not yet reported."""
    ready_groups: int
    """Complete groups waiting for a step."""
    paused: bool
    """Whether the run is paused."""
    knobs: Knobs
    """The knobs in force."""
    counters: Counters
    """The run's counts of rollouts and groups."""
    runs: int
    """Runs of the workflow's continue-as-new chain so far (1 for the first)."""
    history_length: int
    """Events in the current run's history (it continues as new past
    `continue_as_new_after_events`)."""
    last: StepRecord | None = None
    """The last step's record; None before the first step."""


class TrainingSummary(Contract):
    """The TrainingWorkflow's result: how the run ended."""

    run_id: str
    """The run."""
    steps: int
    """Steps trained."""
    policy_version: int
    """The last policy version."""
    stopped: bool
    """Whether a stop ended it."""
    reason: str
    """Why it ended (`completed 50 steps`, `dataset exhausted`, `stopped by request`)."""
    counters: Counters
    """The run's counts of rollouts and groups."""
    inflight_at_end: int = 0
    """Rollouts still out when the run ended (they did not report within
    `cancel_wait_seconds`)."""
    last: StepRecord | None = None
    """The last step's record; None: no step."""
    run_dir: str | None = None
    """Where its checkpoints and metrics are, on the trainer worker."""
    seconds: float | None = None
    """Seconds from the run's start (the first run of its chain) to its end, in workflow
    time."""


# --- activity inputs and outputs -------------------------------------------------------------


class ReadTasksRequest(Contract):
    dataset: DatasetSpec
    epoch: int
    cursor: int
    count: int
    epochs: int


class TaskBatch(Contract):
    rows: list[TaskRow]
    epoch: int
    cursor: int
    exhausted: bool


class ReadValTasksRequest(Contract):
    dataset: DatasetSpec
    validation: ValidationSpec


class RolloutStart(Contract):
    """One rollout to start: its ids, its task row, and the prefix it branches from."""

    rollout_id: str
    group_id: str
    mode: RolloutMode
    row: TaskRow
    prefix: PrefixSpec | None = None


class StartRolloutsRequest(Contract):
    """Rollouts to start, each a `RolloutSpec` the activity builds from what they share (the
    run's rollout settings) and what each is (`RolloutStart`), with its task read from the
    dataset. `specs`: rollouts as whole specs, tasks included, which the activity starts as
    they are (a recorded history may hold them; the trainer sends `rollouts`)."""

    task_queue: str
    run_id: str = ""
    settings: RolloutSettings | None = None
    # The files the rows index: train groups', and validation groups'.
    dataset: str | None = None
    val_dataset: str | None = None
    policy_version: int = 0
    report_to: str | None = None
    revision: int = CURRENT_REVISION
    rollouts: list[RolloutStart] = Field(default_factory=list)
    specs: list[RolloutSpec] = Field(default_factory=list)


class TrainMember(Contract):
    """A member of a group to train: its final attempt's committed calls, read from the store
    as the first `calls` of the attempt, checked against their `digest` (the rollout's
    `events_digest`). `call_ids`: the calls named one by one instead, read without the
    count and digest check (a recorded history may hold them; the trainer sends none)."""

    rollout_id: str
    attempt: int
    calls: int = Field(default=0, ge=0)
    digest: str = ""
    call_ids: list[str] | None = None
    reward: float
    # How many of its first calls are context only, never trained (a branch's replayed
    # prefix, and the seed's unless `groups.train_seed_prefix`).
    masked_calls: int = Field(default=0, ge=0)


class TrainGroup(Contract):
    group_id: str
    members: list[TrainMember]


class BranchPointRequest(Contract):
    """A seed rollout's final attempt and its committed calls (read as `TrainMember`'s are)."""

    rollout_id: str
    attempt: int
    calls: int = Field(default=0, ge=0)
    digest: str = ""
    call_ids: list[str] | None = None


class BranchPoint(Contract):
    """The branch point `choose_branch_point` found (None: the store held fewer than two of
    the calls, so the seed cannot branch) and the mean -logprob of each call's sampled
    tokens, in call order, that it chose from."""

    at: int | None
    surprisal: list[float]


class TrainStepRequest(Contract):
    run_id: str
    run_dir: str | None
    step: int
    backend: BackendSpec
    aggregation: AggregationSpec
    groups: list[TrainGroup]
    learning_rate: float | None = None


class TrainStepResult(Contract):
    step: int
    policy_path: str
    metrics: dict[str, float]
    seconds: float


class InitializeRequest(Contract):
    run_id: str
    run_dir: str | None
    backend: BackendSpec


class SyncRequest(Contract):
    weight_sync: WeightSyncSettings
    policy_path: str
    policy_version: int


class SyncResult(Contract):
    paused_seconds: float
    drained: bool | None = None


class RestoreResult(Contract):
    """What `restore_weights` found: the servers that were behind and were loaded again."""

    restored: list[str] = Field(default_factory=list)


class RecordStepRequest(Contract):
    run_id: str
    run_dir: str | None
    record: StepRecord


class RolloutLookup(Contract):
    """What `check_rollouts` finds of a rollout the trainer has not heard from."""

    rollout_id: str
    result: RolloutOutcome | None = None
    running: bool = False
    # How it closed when it left no result (terminated, failed, timed_out, not found).
    closed_as: str | None = None


TrainingConfig.model_rebuild()
