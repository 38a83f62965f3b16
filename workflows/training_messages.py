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
    """`cancel_inflight` False lets running rollouts finish (they are not trained): the run
    waits up to `grace_seconds` for them (None: the config's `stop_grace_seconds`), then
    cancels the ones still out."""

    cancel_inflight: bool = True
    grace_seconds: float | None = Field(
        default=None, ge=0, le=MAX_WAIT_SECONDS, allow_inf_nan=False
    )


class KnobUpdate(Contract):
    learning_rate: float | None = Field(default=None, gt=0, le=1)
    max_inflight: int | None = Field(default=None, ge=1, le=MAX_INFLIGHT)
    max_staleness: int | None = Field(default=None, ge=0, le=1000)


class TrainingPhase(StrEnum):
    STARTING = "starting"
    ROLLING_OUT = "rolling_out"
    TRAINING = "training"
    SYNCING = "syncing"
    VALIDATING = "validating"
    PAUSED = "paused"
    STOPPING = "stopping"
    FINISHED = "finished"


class TrainingProgress(Contract):
    """The answer of the `status` query."""

    run_id: str
    phase: TrainingPhase
    step: int
    policy_version: int
    epoch: int
    cursor: int
    inflight_rollouts: int
    ready_groups: int
    paused: bool
    knobs: Knobs
    counters: Counters
    runs: int
    history_length: int
    last: StepRecord | None = None


class TrainingSummary(Contract):
    run_id: str
    steps: int
    policy_version: int
    stopped: bool
    reason: str
    counters: Counters
    # Rollouts still out when the run ended (they did not report within cancel_wait_seconds).
    inflight_at_end: int = 0
    last: StepRecord | None = None
    run_dir: str | None = None
    # From the run's start (the first run of its chain) to its end, in workflow time.
    seconds: float | None = None


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
