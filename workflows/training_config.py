"""A training run's config: the TrainingConfig a user starts a TrainingWorkflow with (YAML for
`darl train`, JSON for `temporal workflow start --type TrainingWorkflow --task-queue
darl-trainer --workflow-id train/<run_id> --input-file config.json`) and the settings it is
made of (the weight sync's in `weight_sync_settings`, imported from here too)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, model_validator

from darl.workflows.contracts import (
    ROLLOUT_ID_PATTERN,
    AgentSpec,
    Contract,
    RewardSpec,
    RolloutTimeouts,
    check_grader_agent,
)
from darl.workflows.names import ROLLOUT_TASK_QUEUE
from darl.workflows.training_state import MAX_HELD, MAX_VALIDATION_TASKS, Knobs, TrainingState

# Re-exported: the weight sync's settings are part of the config, read from here too.
from darl.workflows.weight_sync_settings import (
    GATEWAY_ADMIN_SCHEMES as GATEWAY_ADMIN_SCHEMES,
)
from darl.workflows.weight_sync_settings import (
    InflightMode as InflightMode,
)
from darl.workflows.weight_sync_settings import (
    PauseMode as PauseMode,
)
from darl.workflows.weight_sync_settings import (
    PolicyServerSpec as PolicyServerSpec,
)
from darl.workflows.weight_sync_settings import (
    ServerPauseMode as ServerPauseMode,
)
from darl.workflows.weight_sync_settings import (
    WeightSyncSettings as WeightSyncSettings,
)
from darl.workflows.weight_sync_settings import (
    check_keep as check_keep,
)

MAX_WAIT_SECONDS = 7 * 24 * 3600.0
"""Seconds: the longest a run's own timers wait (a week). A timer past what a timedelta
holds would fail every workflow task of the run instead of being refused when it is asked
for."""
PATH_MAX_CHARS = 4096
"""Characters: the longest file path a config names (Linux's PATH_MAX)."""
CONFIG_MAX_BYTES = 128 * 1024
"""Bytes: the largest config as JSON, without its carried state (128 KiB): the config
travels with every continue-as-new and in its activities' inputs."""
RUN_ID_MAX_CHARS = 64
"""Characters: the longest run id, so that its rollouts' ids, which extend it, stay short
and bounded."""


def training_workflow_id(run_id: str) -> str:
    """The one workflow id of a training run (rule 2); rollouts signal it by this id, so a
    report reaches whichever run of the chain is current."""
    return f"train/{run_id}"


class TrainingMode(StrEnum):
    """`sync`: on-policy, one batch rolled out by the policy it trains, then the step.
    `async`: rollouts keep going while a step trains (up to `knobs.max_inflight`), groups at
    most `knobs.max_staleness` versions behind are trained."""

    SYNC = "sync"
    ASYNC = "async"


class DatasetSpec(Contract):
    """Rows of tasks: a Parquet file or JSON lines, shuffled per epoch by `seed`."""

    path: str = Field(min_length=1, max_length=PATH_MAX_CHARS)
    """The dataset file (`.parquet`, or JSON lines `.jsonl`: one task a line), on the trainer
    worker's disk; relative: to the worker's working directory (`darl train` makes it
    absolute)."""
    shuffle: bool = True
    """Whether each epoch takes the rows in a new order (True by default); False: file
    order."""
    seed: int = 0
    """The shuffle's seed: an epoch's order is the same for the same seed (0 by default)."""


class RolloutSettings(Contract):
    """How each rollout runs: the same agent, reward and timeouts for every task."""

    agent: AgentSpec
    """How each rollout's agent runs (`RolloutSpec.agent`)."""
    reward: RewardSpec = Field(default_factory=RewardSpec)
    """Where each rollout's reward comes from (`RolloutSpec.reward`); by default the agent
    reports it."""
    timeouts: RolloutTimeouts = Field(default_factory=RolloutTimeouts)
    """How long each part of an attempt may take, in seconds (`RolloutSpec.timeouts`)."""
    max_attempts: int = Field(default=3, ge=1, le=20)
    """Attempts per rollout at most (1 to 20; 3 by default): `RolloutSpec.max_attempts`."""
    task_queue: str = ROLLOUT_TASK_QUEUE
    """The task queue the rollout workers poll (`darl-rollouts` by default)."""

    @model_validator(mode="after")
    def _grader_reaches_the_sandbox(self) -> RolloutSettings:
        check_grader_agent(self.agent, self.reward)
        return self


class ValidationSpec(Contract):
    """Validation rollouts (mode `val`, one per task) every `every_steps` steps; 0 turns it
    off. `path` None takes the first `tasks` rows of the training dataset, unshuffled."""

    every_steps: int = Field(default=0, ge=0)
    """Validate after every this many steps; 0 (the default): never."""
    path: str | None = Field(default=None, min_length=1, max_length=PATH_MAX_CHARS)
    """The validation dataset (as `DatasetSpec.path`); None (the default): the training
    dataset."""
    tasks: int = Field(default=32, ge=1, le=MAX_VALIDATION_TASKS)
    """Rollouts per validation: its first this many rows, unshuffled (32 by default, 1536
    at most)."""


class AggregationSpec(Contract):
    """How a rollout's calls become training rows (`trainer/aggregation.py`): `trajectory`
    merges the calls of a rollout into as few rows as their tokens allow, `transition` makes a
    row of each call."""

    mode: Literal["transition", "trajectory"] = "trajectory"
    """`trajectory` (the default): a rollout's calls merged into as few rows as their
    tokens allow; `transition`: a row per call."""
    max_prompt_length: int = Field(default=512, ge=1)
    """Tokens of a row's prompt at most (512 by default); a longer prompt keeps its last
    tokens (the system prompt is lost first)."""
    max_response_length: int = Field(default=256, ge=1)
    """Tokens of a row's response at most (256 by default); a longer response is cut at the
    end (later turns are lost first)."""
    replay_normalized: Literal["keep", "drop"] = "keep"
    """Calls a resumed attempt replayed under the rollout's normalizers (rule 10), whose
    answer was sampled from a prompt that differed in the ignored spans: `keep` (the
    default) trains them like any call; `drop` leaves their tokens in the row as context,
    not trained (mask 0)."""


class GroupsSpec(Contract):
    """How a GRPO group's rollouts are made. `independent`: every member runs whole from the
    task. `branch`: the group's seed rollout runs whole; when it has finished, the other
    members start as branches of it (`RolloutSpec.prefix`): each replays the seed's first k
    calls and goes live from there, so the group's advantages compare continuations of one
    shared state. `seed` says which rollout is the seed: the group's own first member, or an
    earlier rollout of the same task chosen by outcome. `branch_at` chooses k (1 <= k < the
    seed's calls): `uniform` at random, `surprisal` the call whose sampled tokens had the
    highest mean -logprob, `fraction` that share of the seed's calls, rounded."""

    mode: Literal["independent", "branch"] = "independent"
    """`independent` (the default): every member runs whole from the task. `branch`: the
    members after the seed start from a prefix of the seed's calls."""
    seed: Literal["own", "adaptive"] = "own"
    """Which rollout a branching group branches from. `own` (the default): its first
    member, which runs whole first. `adaptive`: the run's latest recorded rollout of the same
    task, a success when the task's recent pass rate is under 0.5, a failure otherwise, so
    the group's pass rate moves toward 0.5; every member is a branch of it. A task with no
    such rollout yet makes an ordinary group (docs/branching.md)."""
    branch_at: Literal["uniform", "surprisal", "fraction"] = "uniform"
    """How the branch point k is chosen: `uniform` (the default) at random, `surprisal` the
    call with the highest mean -logprob, `fraction` that share of the seed's calls."""
    fraction: float = Field(default=0.5, gt=0, lt=1)
    """The share of the seed's calls the prefix is under `branch_at: fraction`, between 0
    and 1 exclusive (0.5 by default)."""
    broken_branches: Literal["drop", "keep"] = "drop"
    """A branch whose agent left the prefix before its k calls (`prefix_diverged_at`):
    `drop` (the default) leaves it out of its group, `keep` trains it as a member whose
    masked calls are those it did reproduce."""
    train_seed_prefix: bool = False
    """Whether the seed's own first k calls are trained; False (the default): the prefix is
    masked in every member, so the group compares the continuations only."""

    def branch_point(self, calls: int, rng: random.Random) -> int:
        """The prefix length k, 1 <= k < `calls`, of a seed of `calls` (2 or more) calls under
        `uniform` or `fraction` (`surprisal` reads the seed's records: `highest_surprisal`).
        The call at index k is the first one the branches sample again."""
        if self.branch_at == "fraction":
            return min(max(round(self.fraction * calls), 1), calls - 1)
        if self.branch_at == "uniform":
            return rng.randint(1, calls - 1)
        raise ValueError(f"branch_at {self.branch_at!r} is chosen from the seed's records")

    @staticmethod
    def highest_surprisal(surprisal: Sequence[float]) -> int:
        """The branch point under `surprisal`: of calls 1 .. n-1 (branching at the first call
        would share no prefix), the one whose sampled tokens had the highest mean -logprob,
        the earliest on a tie. ValueError for fewer than two calls."""
        if len(surprisal) < 2:
            raise ValueError(f"{len(surprisal)} calls cannot branch")
        return max(range(1, len(surprisal)), key=lambda i: (surprisal[i], -i))


VERL_ROLLOUT_N = "actor_rollout_ref.rollout.n"
"""verl's setting of the answers per prompt: the run's `group_size`."""
VERL_KEYS_OF_THE_RUN = {VERL_ROLLOUT_N: "group_size", "data.train_batch_size": "batch_size"}
"""verl's settings that the run's own fields decide (verl key: the config field)."""


class BackendSpec(Contract):
    """The trainer backend and its settings, in the backend's own keys (for the reference
    backend, verl's names: `lr`, `clip_ratio_low`, `ppo_epochs`, ...)."""

    name: Literal["reference", "verl"] = "reference"
    """`reference` (the default): DARL's CPU backend for the tiny model. `verl`: verl's FSDP
    actor workers (docs/backends.md)."""
    model_dir: str
    """The model to start from: a directory on the trainer worker (a Hugging Face
    checkpoint; relative: to the worker's working directory)."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """The backend's own settings, in its own keys: for `reference` verl's names, flat
    (`lr`, `clip_ratio_low`, `ppo_epochs`, ...), for `verl` its `ppo_trainer` keys as on its
    command line. Empty: the backend's defaults."""


class TrainingConfig(Contract):
    """A training run: the input of a `TrainingWorkflow`, started under the workflow id
    `train/<run_id>` (the one `darl status`, `pause` and `stop` look for). At most 128 KiB as
    JSON (`CONFIG_MAX_BYTES`), `carried_state` apart."""

    run_id: str = Field(pattern=ROLLOUT_ID_PATTERN, max_length=RUN_ID_MAX_CHARS)
    """The run's id: URL-safe (letters, digits, `.`, `_`, `-`), at most 64 characters. The
    rollouts' ids extend it (`<run_id>.e<epoch>.t<position>.<k>`)."""
    dataset: DatasetSpec
    """The tasks to train on."""
    rollout: RolloutSettings
    """How each rollout runs: the agent, the reward and the timeouts every task shares."""
    backend: BackendSpec
    """The trainer backend, the model it starts from and its settings."""
    weight_sync: WeightSyncSettings
    """How new weights reach the policy servers after each step."""
    mode: TrainingMode = TrainingMode.SYNC
    """`sync` (the default): on-policy steps. `async`: rollouts go on while a step trains."""
    group_size: int = Field(default=8, ge=1, le=1024)
    """GRPO: rollouts per task, one group (8 by default, 1024 at most)."""
    batch_size: int = Field(default=8, ge=1, le=10_000)
    """Groups a step trains (8 by default)."""
    min_group_size: int | None = Field(default=None, ge=1)
    """A group that lost members (their rollouts failed) is still trained with this many;
    fewer drop it. None (the default): `group_size`, every member."""
    equal_reward_groups: Literal["train", "drop"] = "drop"
    """Groups whose rewards are all equal carry no GRPO signal: `drop` (the default) leaves
    them out of the step, `train` trains them."""
    total_steps: int | None = Field(default=None, ge=1)
    """The run finishes after this many steps; None (the default): when `epochs` are done."""
    epochs: int = Field(default=1, ge=1)
    """Passes over the dataset (1 by default)."""
    success_threshold: float = 1.0
    """A rollout whose reward reaches this counts as a success in the metrics (1.0 by
    default)."""
    knobs: Knobs = Field(default_factory=Knobs)
    """What the `update_knobs` update can change while the run goes: their starting values."""
    aggregation: AggregationSpec = Field(default_factory=AggregationSpec)
    """How a rollout's calls become training rows."""
    groups: GroupsSpec = Field(default_factory=GroupsSpec)
    """How a group's rollouts are made: independently (the default) or as branches."""
    validation: ValidationSpec = Field(default_factory=ValidationSpec)
    """Validation rollouts every few steps; off by default."""
    run_dir: str | None = None
    """Where checkpoints and metrics go, on the trainer worker; None (the default):
    `<runs dir of the trainer worker>/<run_id>`."""
    continue_as_new_after_events: int = Field(default=10_000, ge=100)
    """Continue-as-new at a step boundary once the workflow's history holds this many events
    (or Temporal suggests it): 10,000 by default."""
    reconcile_after_seconds: float = Field(default=300.0, gt=0, le=MAX_WAIT_SECONDS)
    """Seconds: a rollout not heard of for this long is looked up (its report may have been
    lost). 300 by default, a week at most."""
    stop_grace_seconds: float = Field(default=0.0, ge=0, le=MAX_WAIT_SECONDS)
    """Seconds a stop that lets rollouts finish waits for them before they are cancelled
    (0 by default; `StopRequest.grace_seconds` overrides it)."""
    cancel_wait_seconds: float = Field(default=600.0, ge=0, le=MAX_WAIT_SECONDS)
    """Seconds the end of a run waits for its cancelled rollouts to report (600 by
    default)."""
    train_heartbeat_seconds: float = Field(default=60.0, gt=0)
    """Seconds: a trainer worker that dies mid-step is noticed after this long without a
    heartbeat and the step retried (60 by default)."""
    max_failed_rollouts_in_a_row: int = Field(default=256, ge=1)
    """A run whose rollouts keep failing (an agent that cannot start, a reward that cannot
    be computed, a service that is gone) fails after this many failures in a row, with the
    last one's error, instead of going on without ever training (rule 9). 256 by default."""
    carried_state: TrainingState | None = None
    """Set by continue-as-new (the run's state handed to the next run of its chain); leave
    it out."""

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
    def _within_budget(self) -> TrainingConfig:
        size = len(self.model_dump_json(exclude={"carried_state"}).encode())
        if size > CONFIG_MAX_BYTES:
            raise ValueError(
                f"the config is {size:,} bytes as JSON; a training config holds at most "
                f"{CONFIG_MAX_BYTES:,} (it travels with every continue-as-new): keep large "
                "values in files it names"
            )
        return self

    @model_validator(mode="after")
    def _consistent(self) -> TrainingConfig:
        if self.min_group_size is not None and self.min_group_size > self.group_size:
            raise ValueError("min_group_size cannot exceed group_size")
        if self.mode == TrainingMode.ASYNC and self.knobs.max_inflight < self.group_size:
            raise ValueError("knobs.max_inflight must hold at least one group")
        if (self.batch_size + 1) * self.group_size > MAX_HELD:
            raise ValueError(
                f"a step of batch_size {self.batch_size} groups of {self.group_size}, and a "
                f"group beyond it, must fit the {MAX_HELD:,} rollouts a run's state holds "
                "(a payload Temporal carries across continue-as-new): make them smaller"
            )
        if self.groups.seed == "adaptive" and self.groups.mode != "branch":
            raise ValueError("groups.seed 'adaptive' needs groups.mode 'branch'")
        if self.groups.mode == "branch" and self.group_size < 2:
            raise ValueError(
                f"groups.mode 'branch' needs group_size 2 or more (a seed and its branches), "
                f"not {self.group_size}"
            )
        return self

    @property
    def least_group_size(self) -> int:
        """The fewest trainable members a group is trained with: `min_group_size`, or
        `group_size` when that is None."""
        return self.min_group_size if self.min_group_size is not None else self.group_size
