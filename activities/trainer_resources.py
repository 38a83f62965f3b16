"""What the trainer's activities share in one worker process: the Temporal client, the
trajectory store (read-only), the runs directory, the gateway's admin key, one HTTP client, the
datasets read so far and each run's trainer backend."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from temporalio.client import Client

from darl.activities.errors import training_config_error
from darl.gateway.store.base import TrajectoryStore
from darl.trainer.backend import TrainerBackend
from darl.trainer.backend_factory import make_backend
from darl.trainer.datasets import DatasetError, TaskTable, TaskTables
from darl.workflows.training_config import BackendSpec

# A trainer activity heartbeats at least this often, and well inside its heartbeat timeout,
# whatever the config made it.
HEARTBEAT_SECONDS = 5.0


class TrainerResources:
    """The trainer's activity classes (`run_checks`, `trainer_rollouts`, `policy_steps`) all
    build on this; `TrainerActivities` is one object of all of them."""

    def __init__(
        self,
        client: Client,
        store: TrajectoryStore,
        runs_dir: Path,
        admin_key: str,
        http: httpx.AsyncClient,
    ) -> None:
        self._client = client
        self._store = store
        self._runs_dir = runs_dir
        self._admin_key = admin_key
        self._http = http
        self._tables = TaskTables()
        self._backends: dict[str, TrainerBackend] = {}
        # One step at a time per process: steps of one run never overlap in memory.
        self._train_lock = threading.Lock()

    def run_dir(self, run_id: str, run_dir: str | None) -> Path:
        return Path(run_dir) if run_dir else self._runs_dir / run_id

    def _table(self, path: str) -> TaskTable:
        """The dataset at `path`, read once per process; a training config error when it
        cannot be read."""
        try:
            return self._tables.get(path)
        except DatasetError as err:
            raise training_config_error(str(err)) from err

    def _backend(self, run_id: str, run_dir: str | None, spec: BackendSpec) -> TrainerBackend:
        backend = self._backends.get(run_id)
        if backend is None:
            checkpoints = self.run_dir(run_id, run_dir) / "checkpoints"
            try:
                backend = make_backend(spec, checkpoints)
            except ValueError as err:
                raise training_config_error(f"backend settings: {err}") from err
            self._backends[run_id] = backend
        return backend

    def close(self) -> None:
        """Release what the backends hold (verl's Ray workers)."""
        while self._backends:
            _, backend = self._backends.popitem()
            backend.close()
