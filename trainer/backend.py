"""The trainer backend contract: what a Temporal training activity calls, whichever engine does
the math (the CPU reference backend or verl): the protocol, its errors and what a step returns.
A backend's state lives on disk, one checkpoint per step (`checkpoints.py`), so a restarted
process resumes where the last one stopped and a retried activity never trains the same step
twice; every batch it is given passes `batch_checks.validate_batch` first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field
from verl import DataProto

from darl.trainer.errors import TrainerError
from darl.workflows.heartbeats import Heartbeat


class TrainerBackendError(TrainerError):
    """Base of the errors a trainer backend raises on purpose."""


class StepOutOfOrderError(TrainerBackendError):
    """`train_step(step)` for a step that is neither saved nor the one after the latest."""


class CheckpointError(TrainerBackendError):
    """A checkpoint is missing or cannot be read (a corrupt or foreign directory)."""


class BatchError(TrainerBackendError, ValueError):
    """The batch lacks a key, has inconsistent shapes or holds no trainable token."""


class StepOverrides(BaseModel):
    """Per-step overrides of the backend's settings; None keeps the configured value."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    lr: float | None = Field(default=None, gt=0)
    entropy_coeff: float | None = None
    kl_loss_coef: float | None = Field(default=None, ge=0)


class CheckpointInfo(BaseModel):
    """A saved step: `path` is the policy model directory for `reload_weights`."""

    model_config = ConfigDict(frozen=True)
    step: int
    path: Path


class StepOutcome(BaseModel):
    """What training one step did: verl-style metric names (`actor/pg_loss`, ...), the
    checkpoint it saved, and the seconds the update took without the checkpoint write (as
    first measured, also when the outcome is replayed)."""

    # NaN and infinities are written as JSON's NaN/Infinity, so every saved outcome reads back.
    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")
    step: int
    metrics: dict[str, float]
    checkpoint: Path
    seconds: float


@runtime_checkable
class TrainerBackend(Protocol):
    """One policy trained step by step; every method reads its state from the checkpoints."""

    def initialize(self) -> CheckpointInfo:
        """Idempotent: save step 0 from the initial model if no checkpoint exists, else load
        the latest one. Returns the latest checkpoint."""
        ...

    def train_step(
        self,
        step: int,
        batch: DataProto,
        knobs: StepOverrides | None = None,
        heartbeat: Heartbeat | None = None,
    ) -> StepOutcome:
        """Idempotent per step: the saved outcome when checkpoint `step` exists (no training);
        else train on `batch`, save checkpoint `step` atomically and return its outcome.
        `heartbeat` is called between mini-batches. Raises StepOutOfOrderError unless `step`
        is saved or is latest + 1, BatchError for an unusable batch."""
        ...

    @property
    def pad_token_id(self) -> int:
        """The id rows are padded with (the policy's tokenizer's pad token)."""
        ...

    def policy_path(self, step: int) -> Path:
        """The HF model directory the policy server loads for `step`; CheckpointError if
        that step is not saved."""
        ...

    def latest_step(self) -> int:
        """The highest saved step, -1 before `initialize`."""
        ...

    def checkpoint_steps(self) -> list[int]:
        """All saved steps, ascending."""
        ...

    def close(self) -> None:
        """Let go of what the backend holds outside its process (verl's Ray workers)."""
        ...
