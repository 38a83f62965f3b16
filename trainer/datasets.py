"""Task datasets for training: a Parquet file or JSON lines, read with pyarrow, and the
deterministic per-epoch order the TrainingWorkflow's cursor walks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.json as pa_json
import pyarrow.parquet as pq


class DatasetError(ValueError):
    """The dataset cannot be read or has no rows: no retry fixes it."""


@dataclass(frozen=True)
class TaskTable:
    rows: list[dict[str, Any]]

    def order(self, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        """The row order of an epoch: the same for the same (seed, epoch), so a cursor into it
        means the same tasks after any restart."""
        if not shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([seed, epoch]).permutation(len(self.rows))


def load_tasks(path: Path) -> TaskTable:
    if not path.is_file():
        raise DatasetError(f"dataset {path} does not exist")
    if path.stat().st_size == 0:
        raise DatasetError(f"dataset {path} has no rows (the file is empty)")
    try:
        if path.suffix == ".parquet":
            table = pq.read_table(path)
        elif path.suffix in {".jsonl", ".json", ".ndjson"}:
            table = pa_json.read_json(path)
        else:
            raise DatasetError(f"dataset {path}: expected .parquet or .jsonl")
    except (OSError, ValueError) as err:
        if isinstance(err, DatasetError):
            raise
        raise DatasetError(f"dataset {path} cannot be read: {err}") from err
    rows = table.to_pylist()
    if not rows:
        raise DatasetError(f"dataset {path} has no rows")
    # Rows go into workflow history and to agents as JSON: keep them JSON-clean.
    return TaskTable(rows=json.loads(json.dumps(rows, default=str)))


class TaskTables:
    """Loaded datasets by path, reloaded when the file changes."""

    def __init__(self) -> None:
        self._tables: dict[Path, tuple[float, TaskTable]] = {}

    def get(self, path: str) -> TaskTable:
        resolved = Path(path).expanduser().resolve()
        try:
            mtime = resolved.stat().st_mtime
        except FileNotFoundError as err:
            raise DatasetError(f"dataset {resolved} does not exist") from err
        cached = self._tables.get(resolved)
        if cached is None or cached[0] != mtime:
            cached = (mtime, load_tasks(resolved))
            self._tables[resolved] = cached
        return cached[1]
