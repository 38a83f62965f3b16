"""The trainer backend contract: what a Temporal training activity calls, whichever engine does
the math (the CPU reference backend or verl), and the checkpoint
directory layout both share (`<checkpoint_dir>/step-000007/`, published atomically).

A backend's state lives on disk, one checkpoint per step, so a restarted process resumes where
the last one stopped and a retried activity never trains the same step twice.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field
from verl import DataProto

from darl.workflows.heartbeats import Heartbeat

OUTCOME_FILE = "outcome.json"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_TMP_PREFIX = ".tmp-"


# What trainer/aggregation.py puts in a DataProto's batch and every backend trains on.
REQUIRED_KEYS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "old_log_probs",
    "token_level_rewards",
)


class TrainerBackendError(Exception):
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


class CheckpointStore:
    """The checkpoint directory: one `step-NNNNNN` folder per saved step, each published by
    renaming a fully written and fsynced temporary folder, so a folder that exists is whole."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> int:
        steps = self.steps()
        return steps[-1] if steps else -1

    def has(self, step: int) -> bool:
        return self.step_dir(step).is_dir()

    def remove_partial(self) -> None:
        """Delete temporary folders a crashed writer left behind."""
        if self.root.is_dir():
            for path in self.root.iterdir():
                if path.name.startswith(_TMP_PREFIX):
                    shutil.rmtree(path, ignore_errors=True)

    def publish(self, step: int, write: Callable[[Path], None]) -> bool:
        """Let `write` fill a temporary folder, fsync it and rename it to `step_dir(step)`.
        False when another writer published that step first (its checkpoint is kept)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{_TMP_PREFIX}{self.step_dir(step).name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write(tmp)
            for file in tmp.rglob("*"):
                if file.is_file():
                    _fsync(file)
            _fsync(tmp)
            try:
                tmp.rename(self.step_dir(step))
            except OSError:
                if self.has(step):
                    return False
                raise
            _fsync(self.root)
            return True
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def write_outcome(self, folder: Path, outcome: StepOutcome) -> None:
        (folder / OUTCOME_FILE).write_text(outcome.model_dump_json(indent=2))

    def read_outcome(self, step: int) -> StepOutcome:
        """The outcome saved with `step`, its checkpoint path as found now."""
        file = self.step_dir(step) / OUTCOME_FILE
        try:
            saved = json.loads(file.read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot read the outcome of step {step}: {err}") from err
        return StepOutcome.model_validate({**saved, "checkpoint": self.step_dir(step)})


def validate_batch(batch: DataProto, vocab_size: int) -> DataProto:
    """The batch if it has trainer/aggregation.py's keys (REQUIRED_KEYS) with consistent
    shapes, token ids below `vocab_size` and finite rollout log-probs; else BatchError."""
    present = set(batch.batch.keys())
    missing = [key for key in REQUIRED_KEYS if key not in present]
    if missing:
        raise BatchError(f"the batch lacks {missing}")
    b = batch.batch
    rows, prompt_len = b["prompts"].shape
    response_len = b["responses"].shape[1]
    expected = {
        "input_ids": (rows, prompt_len + response_len),
        "attention_mask": (rows, prompt_len + response_len),
        "position_ids": (rows, prompt_len + response_len),
        "response_mask": (rows, response_len),
        "old_log_probs": (rows, response_len),
        "token_level_rewards": (rows, response_len),
    }
    for key, shape in expected.items():
        if tuple(b[key].shape) != shape:
            raise BatchError(f"{key} has shape {tuple(b[key].shape)}, expected {shape}")
    if prompt_len == 0 or not b["response_mask"].any():
        raise BatchError("the batch has no prompt or no trainable response token")
    ids = b["input_ids"]
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise BatchError(f"token ids must lie in [0, {vocab_size})")
    if not torch.isfinite(b["old_log_probs"][b["response_mask"].bool()]).all():
        raise BatchError("old_log_probs holds a non-finite value on a trained token")
    return batch


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
