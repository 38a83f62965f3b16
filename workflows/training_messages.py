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
    """The `read_tasks` activity's input: the next rows to start groups for."""

    dataset: DatasetSpec
    """The run's dataset."""
    epoch: int
    """The epoch to read from (from 0)."""
    cursor: int
    """The place in the epoch's order to read from."""
    count: int
    """Rows to read at most."""
    epochs: int
    """The run's epochs (`TrainingConfig.epochs`): reading stops when they run out."""


class TaskBatch(Contract):
    """What `read_tasks` read: rows by reference, and where the next read starts."""

    rows: list[TaskRow]
    """The rows read, in order."""
    epoch: int
    """The epoch the next read starts in."""
    cursor: int
    """The place in that epoch's order the next read starts at."""
    exhausted: bool
    """Whether every epoch has been read."""


class ReadValTasksRequest(Contract):
    """The `read_val_tasks` activity's input: the rows of a step's validation."""

    dataset: DatasetSpec
    """The run's dataset (the validation's, when `validation.path` is None)."""
    validation: ValidationSpec
    """The run's validation settings."""


class RolloutStart(Contract):
    """One rollout to start: its ids, its task row, and the prefix it branches from."""

    rollout_id: str
    """The rollout's id (`<run_id>.e<epoch>.t<position>.<k>`)."""
    group_id: str
    """Its group."""
    mode: RolloutMode
    """`train` or `val`."""
    row: TaskRow
    """The task's row, read from the dataset when the rollout starts."""
    prefix: PrefixSpec | None = None
    """The seed's prefix a branch starts from; None: from the task."""


class StartRolloutsRequest(Contract):
    """Rollouts to start, each a `RolloutSpec` the activity builds from what they share (the
    run's rollout settings) and what each is (`RolloutStart`), with its task read from the
    dataset. `specs`: rollouts as whole specs, tasks included, which the activity starts as
    they are (a recorded history may hold them; the trainer sends `rollouts`)."""

    task_queue: str
    """The rollout workers' task queue."""
    run_id: str = ""
    """The run the rollouts belong to."""
    settings: RolloutSettings | None = None
    """The run's rollout settings, shared by every rollout; None with `specs`."""
    dataset: str | None = None
    """The file train groups' rows index."""
    val_dataset: str | None = None
    """The file validation groups' rows index."""
    policy_version: int = 0
    """The policy version the rollouts start at."""
    report_to: str | None = None
    """The workflow id the rollouts report to (the run's)."""
    revision: int = CURRENT_REVISION
    """The rollouts' `RolloutSpec.revision`."""
    rollouts: list[RolloutStart] = Field(default_factory=list)
    """The rollouts to start, each built from `settings` and its row."""
    specs: list[RolloutSpec] = Field(default_factory=list)
    """Rollouts as whole specs, started as they are (recorded histories); the trainer sends
    none."""


class TrainMember(Contract):
    """A member of a group to train: its final attempt's committed calls, read from the store
    as the first `calls` of the attempt, checked against their `digest` (the rollout's
    `events_digest`). `call_ids`: the calls named one by one instead, read without the
    count and digest check (a recorded history may hold them; the trainer sends none)."""

    rollout_id: str
    """The member's rollout."""
    attempt: int
    """Its final attempt, the one trained."""
    calls: int = Field(default=0, ge=0)
    """The attempt's committed calls (`RolloutResult.calls`): the first this many are read."""
    digest: str = ""
    """`RolloutResult.events_digest`, which the calls read are checked against."""
    call_ids: list[str] | None = None
    """The calls named one by one instead (recorded histories); None: by count and digest."""
    reward: float
    """The member's reward."""
    masked_calls: int = Field(default=0, ge=0)
    """How many of its first calls are context only, never trained (a branch's replayed
    prefix, and the seed's unless `groups.train_seed_prefix`)."""


class TrainGroup(Contract):
    """A group to train: its members, whose rewards are compared."""

    group_id: str
    """The group."""
    members: list[TrainMember]
    """Its members that train."""


class BranchPointRequest(Contract):
    """A seed rollout's final attempt and its committed calls (read as `TrainMember`'s are)."""

    rollout_id: str
    """The seed rollout."""
    attempt: int
    """Its final attempt."""
    calls: int = Field(default=0, ge=0)
    """The attempt's committed calls, read as `TrainMember.calls` are."""
    digest: str = ""
    """Their digest, as `TrainMember.digest`."""
    call_ids: list[str] | None = None
    """The calls named one by one instead, as `TrainMember.call_ids`."""


class BranchPoint(Contract):
    """The branch point `choose_branch_point` found (None: the store held fewer than two of
    the calls, so the seed cannot branch) and the mean -logprob of each call's sampled
    tokens, in call order, that it chose from."""

    at: int | None
    """The prefix length k; None: the seed cannot branch."""
    surprisal: list[float]
    """The mean -logprob of each call's sampled tokens, in call order."""


class TrainStepRequest(Contract):
    """The `train_step` activity's input: one step's groups."""

    run_id: str
    """The run."""
    run_dir: str | None
    """`TrainingConfig.run_dir`."""
    step: int
    """The step to train (from 1)."""
    backend: BackendSpec
    """The run's backend."""
    aggregation: AggregationSpec
    """How the calls become rows."""
    groups: list[TrainGroup]
    """The groups to train."""
    learning_rate: float | None = None
    """`knobs.learning_rate`; None: the backend's own setting."""


class TrainStepResult(Contract):
    """What `train_step` made: the step's checkpoint and the backend's metrics."""

    step: int
    """The step trained."""
    policy_path: str
    """The checkpoint the policy servers load."""
    metrics: dict[str, float]
    """The backend's metrics of the step."""
    seconds: float
    """Seconds the step took."""


class InitializeRequest(Contract):
    """The `initialize_policy` activity's input: the run's starting checkpoint."""

    run_id: str
    """The run."""
    run_dir: str | None
    """`TrainingConfig.run_dir`."""
    backend: BackendSpec
    """The run's backend and the model it starts from."""


class SyncRequest(Contract):
    """The `sync_weights` activity's input: load a checkpoint into the policy servers."""

    weight_sync: WeightSyncSettings
    """The run's weight sync settings."""
    policy_path: str
    """The checkpoint to load."""
    policy_version: int
    """The version it is."""


class SyncResult(Contract):
    """What a weight sync did."""

    paused_seconds: float
    """Seconds the gateway held or refused new calls."""
    drained: bool | None = None
    """`drain`: whether every call in flight finished within `drain_timeout_seconds`;
    None under `keep`."""


class RestoreResult(Contract):
    """What `restore_weights` found: the servers that were behind and were loaded again."""

    restored: list[str] = Field(default_factory=list)
    """The URLs of the servers loaded again."""


class RecordStepRequest(Contract):
    """The `record_step` activity's input: a step record to append to `metrics.jsonl`."""

    run_id: str
    """The run."""
    run_dir: str | None
    """`TrainingConfig.run_dir`."""
    record: StepRecord
    """The record."""


class RolloutLookup(Contract):
    """What `check_rollouts` finds of a rollout the trainer has not heard from."""

    rollout_id: str
    """The rollout."""
    result: RolloutOutcome | None = None
    """Its outcome, when it finished with one."""
    running: bool = False
    """Whether it is still running."""
    closed_as: str | None = None
    """How it closed when it left no result (terminated, failed, timed_out, not found)."""


TrainingConfig.model_rebuild()
