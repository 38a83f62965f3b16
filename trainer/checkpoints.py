"""The checkpoint directory every trainer backend shares: `<checkpoint_dir>/step-000007/`, one
folder per saved step, each published atomically with the step's outcome beside its weights."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl import DataProto

from darl.trainer.backend import (
    CheckpointError,
    CheckpointInfo,
    StepOutcome,
    StepOutOfOrderError,
    StepOverrides,
)
from darl.workflows.heartbeats import Heartbeat, no_heartbeat

log = logging.getLogger(__name__)

OUTCOME_FILE = "outcome.json"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_TMP_PREFIX = ".tmp-"


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


class CheckpointedBackend(ABC):
    """The step discipline both backends share: a step already checkpointed is returned as it
    was (a retried activity); a step must follow the latest checkpoint; an update that fails
    leaves the model to be reloaded before the next try; the step is published atomically,
    and a step another writer published first is loaded instead of ours."""

    store: CheckpointStore
    _loaded_step: int

    @abstractmethod
    def initialize(self) -> CheckpointInfo: ...

    def train_step(
        self,
        step: int,
        batch: DataProto,
        knobs: StepOverrides | None = None,
        heartbeat: Heartbeat | None = None,
    ) -> StepOutcome:
        if self.store.has(step):
            return self.store.read_outcome(step)
        latest = self.initialize().step
        if step != latest + 1:
            raise StepOutOfOrderError(f"cannot train step {step}: the latest saved is {latest}")
        prepared = self._prepare(step, batch)
        started = time.monotonic()
        try:
            metrics = self._update(prepared, knobs or StepOverrides(), heartbeat or no_heartbeat)
        except BaseException as err:
            self._update_failed(err)
            raise
        seconds = time.monotonic() - started
        metrics["timing_s/train_step"] = seconds
        outcome = StepOutcome(
            step=step, metrics=metrics, checkpoint=self.store.step_dir(step), seconds=seconds
        )
        if self._publish_step(outcome):
            self._loaded_step = step
        else:
            log.warning("step %d was published by another writer; loading theirs", step)
            self._load_step(step)
        return self.store.read_outcome(step)

    def latest_step(self) -> int:
        return self.store.latest()

    def checkpoint_steps(self) -> list[int]:
        return self.store.steps()

    def _prepare(self, step: int, batch: DataProto) -> Any:
        """The batch as `_update` takes it (before the step's clock starts)."""
        return batch

    def _update_failed(self, err: BaseException) -> None:
        self._loaded_step = -1  # the model may be half updated: reload it before a retry

    @abstractmethod
    def _update(
        self, prepared: Any, knobs: StepOverrides, heartbeat: Heartbeat
    ) -> dict[str, float]:
        """Train one step in memory; its metrics."""

    @abstractmethod
    def _publish_step(self, outcome: StepOutcome) -> bool:
        """Write the step's checkpoint with `store.publish`; False if another writer won."""

    @abstractmethod
    def _load_step(self, step: int) -> None:
        """Load the checkpoint of `step` (another writer's)."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
