"""Contracts of the training loop: the run's config, the state it carries across
continue-as-new, and the inputs and outputs of the trainer's activities.

JSON-friendly pydantic models, so `temporal workflow start --type TrainingWorkflow
--task-queue darl-trainer --input-file config.json` works with plain JSON.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from darl.workflows.contracts import (
    ROLLOUT_ID_PATTERN,
    AgentSpec,
    Contract,
    RewardSpec,
    RolloutMode,
    RolloutResult,
    RolloutSpec,
    RolloutTimeouts,
)
from darl.workflows.names import ROLLOUT_TASK_QUEUE


def training_workflow_id(run_id: str) -> str:
    """The one workflow id of a training run (rule 2); rollouts signal it by this id, so a
    report reaches whichever run of the chain is current."""
    return f"train/{run_id}"


# How the gateway holds new calls while the weights change: `hold` makes them wait, `reject`
# answers 429 with Retry-After.
PauseMode = Literal["hold", "reject"]
# What happens to calls in flight at a sync: `drain` lets them finish on the old weights,
# `keep` freezes them on the policy server and continues them on the new weights.
InflightMode = Literal["drain", "keep"]
# How a policy server pauses (vLLM's `/pause?mode=`): `keep` freezes decoding to continue it
# after the load, `wait` finishes what is running, `abort` ends it with finish reason `abort`.
ServerPauseMode = Literal["keep", "wait", "abort"]


class TrainingMode(StrEnum):
    SYNC = "sync"
    ASYNC = "async"


class DatasetSpec(Contract):
    """Rows of tasks: a Parquet file or JSON lines, shuffled per epoch by `seed`."""

    path: str
    shuffle: bool = True
    seed: int = 0


class RolloutSettings(Contract):
    """How each rollout runs: the same agent, reward and timeouts for every task."""

    agent: AgentSpec
    reward: RewardSpec = Field(default_factory=RewardSpec)
    timeouts: RolloutTimeouts = Field(default_factory=RolloutTimeouts)
    max_attempts: int = Field(default=3, ge=1, le=20)
    task_queue: str = ROLLOUT_TASK_QUEUE


class ValidationSpec(Contract):
    """Validation rollouts (mode `val`, one per task) every `every_steps` steps; 0 turns it
    off. `path` None takes the first `tasks` rows of the training dataset, unshuffled."""

    every_steps: int = Field(default=0, ge=0)
    path: str | None = None
    tasks: int = Field(default=32, ge=1, le=10_000)


class PolicyServerSpec(Contract):
    """One policy server the gateway forwards to and the trainer syncs weights into.

    `reference`: DARL's CPU server (reloads a checkpoint in place). `vllm`: a vLLM OpenAI
    server started with `VLLM_SERVER_DEV_MODE=1`; without `launcher_url` its weights are
    reloaded in place (`/collective_rpc reload_weights`, right on GPU); with `launcher_url`
    (`darl vllm-server`) the launcher restarts it on the new weights, as CPU builds need."""

    kind: Literal["reference", "vllm"] = "reference"
    url: str
    launcher_url: str | None = None

    @property
    def restarts_to_load(self) -> bool:
        return self.launcher_url is not None


class WeightSyncSettings(Contract):
    """How new weights reach the policy servers after each step (docs/architecture.md, "Weight
    sync").

    `inflight` `drain` lets calls in flight finish (at most `drain_timeout_seconds`) before
    the weights change; `keep` pauses their decoding on the policy server instead and
    continues it on the new weights after the resume (not possible on a server that restarts
    to load). A policy server given as a plain URL is a `reference` one. With
    `register_upstreams` each sync makes `policy_servers` the gateway's upstreams (so the
    config is the one list of servers); turn it off when the gateway reaches them by other
    addresses than the trainer does."""

    gateway_admin_url: str
    policy_servers: list[PolicyServerSpec] = Field(min_length=1)
    inflight: InflightMode = "drain"
    drain_timeout_seconds: float = Field(default=60.0, ge=0, le=3600)
    pause_mode: PauseMode = "hold"
    register_upstreams: bool = True
    # Between syncs, how often the trainer looks whether every policy server still holds the
    # run's weights and loads them again on one that does not (it restarted on other weights,
    # a vLLM that nothing restored): the gateway records no call from it meanwhile.
    check_every_seconds: float = Field(default=30.0, gt=0)

    @field_validator("policy_servers", mode="before")
    @classmethod
    def _plain_urls_are_reference_servers(cls, servers: Any) -> Any:
        if not isinstance(servers, list):
            return servers
        return [{"url": s} if isinstance(s, str) else s for s in servers]

    @model_validator(mode="after")
    def _keep_needs_servers_that_load_in_place(self) -> WeightSyncSettings:
        check_keep(self.inflight, [s.url for s in self.policy_servers if s.restarts_to_load])
        return self


def check_keep(inflight: InflightMode, restarting: list[str]) -> None:
    """The one rule of `inflight: keep`: calls frozen on a policy server continue on its new
    weights, which a server that restarts to load cannot do. ValueError otherwise."""
    if inflight == "keep" and restarting:
        raise ValueError(
            f"inflight 'keep' cannot hold calls across a restart: {restarting} restart to load "
            "weights (use inflight 'drain')"
        )


class AggregationSpec(Contract):
    """How a rollout's calls become training rows (`trainer/aggregation.py`): `trajectory`
    merges the calls of a rollout into as few rows as their tokens allow, `transition` makes a
    row of each call."""

    mode: Literal["transition", "trajectory"] = "trajectory"
    # Tokens; a longer prompt keeps its last tokens (the system prompt is lost first).
    max_prompt_length: int = Field(default=512, ge=1)
    # Tokens; a longer response is cut at the end (later turns are lost first).
    max_response_length: int = Field(default=256, ge=1)


VERL_ROLLOUT_N = "actor_rollout_ref.rollout.n"
# verl's settings that the run's own fields decide.
VERL_KEYS_OF_THE_RUN = {VERL_ROLLOUT_N: "group_size", "data.train_batch_size": "batch_size"}


class BackendSpec(Contract):
    """The trainer backend and its settings, in the backend's own keys (for the reference
    backend, verl's names: `lr`, `clip_ratio_low`, `ppo_epochs`, ...)."""

    name: Literal["reference", "verl"] = "reference"
    model_dir: str
    settings: dict[str, Any] = Field(default_factory=dict)


class Knobs(Contract):
    """What a running training can change through the `update_knobs` update."""

    learning_rate: float | None = Field(default=None, gt=0, le=1)
    max_inflight: int = Field(default=64, ge=1, le=100_000)
    max_staleness: int = Field(default=1, ge=0, le=1000)


class TrainingConfig(Contract):
    run_id: str = Field(pattern=ROLLOUT_ID_PATTERN)
    dataset: DatasetSpec
    rollout: RolloutSettings
    backend: BackendSpec
    weight_sync: WeightSyncSettings
    mode: TrainingMode = TrainingMode.SYNC
    # GRPO: `group_size` rollouts per task; a step trains `batch_size` groups.
    group_size: int = Field(default=8, ge=1, le=1024)
    batch_size: int = Field(default=8, ge=1, le=10_000)
    # A group that lost members (their rollouts failed) is still trained with this many.
    min_group_size: int | None = Field(default=None, ge=1)
    # Groups whose rewards are all equal carry no GRPO signal: train them or drop them.
    equal_reward_groups: Literal["train", "drop"] = "drop"
    total_steps: int | None = Field(default=None, ge=1)
    epochs: int = Field(default=1, ge=1)
    # A rollout whose reward reaches this counts as a success in the metrics.
    success_threshold: float = 1.0
    knobs: Knobs = Field(default_factory=Knobs)
    aggregation: AggregationSpec = Field(default_factory=AggregationSpec)
    validation: ValidationSpec = Field(default_factory=ValidationSpec)
    # Where checkpoints and metrics go; None: `<runs dir of the trainer worker>/<run_id>`.
    run_dir: str | None = None
    # Continue-as-new at a step boundary once the history is this long (or Temporal says so).
    continue_as_new_after_events: int = Field(default=10_000, ge=100)
    # A rollout not heard of for this long is looked up (its report may have been lost).
    reconcile_after_seconds: float = Field(default=300.0, gt=0)
    # Seconds to wait for in-flight rollouts when stopping before they are cancelled.
    stop_grace_seconds: float = Field(default=0.0, ge=0)
    # How long the end of a run waits for its cancelled rollouts to report.
    cancel_wait_seconds: float = Field(default=600.0, ge=0)
    # A trainer worker that dies mid-step is noticed after this long and the step retried.
    train_heartbeat_seconds: float = Field(default=60.0, gt=0)
    # A run whose rollouts keep failing (an agent that cannot start, a reward that cannot be
    # computed, a service that is gone) fails after this many failures in a row, with the
    # last one's error, instead of going on without ever training (rule 9).
    max_failed_rollouts_in_a_row: int = Field(default=256, ge=1)
    # Set by continue-as-new (the run's state handed to the next run); leave it out.
    carried_state: TrainingState | None = None

    @model_validator(mode="before")
    @classmethod
    def _verl_batch_shape_is_the_runs(cls, data: Any) -> Any:
        """verl's `rollout.n` is `group_size` and its `data.train_batch_size` (prompts a step)
        is `batch_size`: for the verl backend they are filled in when absent and refused when
        different (verl counts `ppo_mini_batch_size` in prompts of `rollout.n` answers)."""
        if not isinstance(data, dict):
            return data
        backend = data.get("backend")
        if isinstance(backend, BackendSpec):
            backend = backend.model_dump()
        if not isinstance(backend, dict) or backend.get("name") != "verl":
            return data
        settings = dict(backend.get("settings") or {})
        for verl_key, field in VERL_KEYS_OF_THE_RUN.items():
            ours = data.get(field, cls.model_fields[field].default)
            theirs = settings.setdefault(verl_key, ours)
            if theirs != ours:
                raise ValueError(
                    f"backend setting {verl_key} ({theirs}) must equal {field} ({ours})"
                )
        return {**data, "backend": {**backend, "settings": settings}}

    @model_validator(mode="after")
    def _consistent(self) -> TrainingConfig:
        if self.min_group_size is not None and self.min_group_size > self.group_size:
            raise ValueError("min_group_size cannot exceed group_size")
        if self.mode == TrainingMode.ASYNC and self.knobs.max_inflight < self.group_size:
            raise ValueError("knobs.max_inflight must hold at least one group")
        return self

    @property
    def least_group_size(self) -> int:
        return self.min_group_size if self.min_group_size is not None else self.group_size


# --- state carried across continue-as-new ---------------------------------------------------


class State(BaseModel):
    """Workflow state: mutable, but as strict about its fields as a contract."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GroupState(State):
    """A GRPO group: its task, the version it was started at, who is still out, who came back."""

    group_id: str
    mode: RolloutMode = RolloutMode.TRAIN
    step: int = 0  # for validation groups: the step they validate
    policy_version: int
    pending: list[str]
    results: list[RolloutResult] = Field(default_factory=list)
    started_at: float


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
    groups_trained: int = 0
    groups_dropped_stale: int = 0
    groups_dropped_small: int = 0
    groups_dropped_equal: int = 0
    duplicate_reports: int = 0
    unknown_reports: int = 0
    reconciled_rollouts: int = 0

    def ended(self) -> int:
        """Rollouts whose end is counted; equals `rollouts_started` once nothing is out."""
        return (
            self.rollouts_trained
            + self.rollouts_in_dropped_groups
            + self.rollouts_failed
            + self.rollouts_cancelled
            + self.rollouts_validated
            + self.rollouts_left_over
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
    runs: int = 1
    started_at: float = 0.0
    # Step records (or their late validation results) not yet written to disk.
    unwritten_records: list[StepRecord] = Field(default_factory=list)
    # Rollouts that failed since the last one that succeeded, and the last one's error.
    failed_in_a_row: int = 0
    last_failure: str | None = None


# --- signals, updates, queries ---------------------------------------------------------------


class StopRequest(Contract):
    """`cancel_inflight` False lets running rollouts finish (they are not trained)."""

    cancel_inflight: bool = True


class KnobUpdate(Contract):
    learning_rate: float | None = Field(default=None, gt=0, le=1)
    max_inflight: int | None = Field(default=None, ge=1, le=100_000)
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


# --- activity inputs and outputs -------------------------------------------------------------


class TaskRow(Contract):
    epoch: int
    position: int
    task: dict[str, Any]


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


class StartRolloutsRequest(Contract):
    task_queue: str
    specs: list[RolloutSpec]


class TrainMember(Contract):
    rollout_id: str
    attempt: int
    call_ids: list[str]
    reward: float


class TrainGroup(Contract):
    group_id: str
    members: list[TrainMember]


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
    result: RolloutResult | None = None
    running: bool = False
    # How it closed when it left no result (terminated, failed, timed_out, not found).
    closed_as: str | None = None


TrainingConfig.model_rebuild()
