"""Task datasets for training: a Parquet file (a task per row, an object of its columns) or
JSON lines (a task per line, any JSON value), and the deterministic per-epoch order the
TrainingWorkflow's cursor walks."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from darl.trainer.errors import TrainerError


class DatasetError(TrainerError, ValueError):
    """The dataset cannot be read or has no rows: no retry fixes it."""


@dataclass(frozen=True)
class TaskTable:
    # Each a task: any JSON value other than null (an object for a Parquet row).
    rows: list[Any]
    _digests: dict[int, str] = field(default_factory=dict, compare=False, repr=False)

    def digest(self, index: int) -> str:
        """A short SHA-256 of row `index`'s JSON: what a reference to the row is checked
        against where the task is read (`TaskRow.digest`)."""
        found = self._digests.get(index)
        if found is None:
            text = json.dumps(self.rows[index], sort_keys=True, separators=(",", ":"))
            found = self._digests[index] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return found

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
    if path.suffix == ".parquet":
        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as err:
            raise DatasetError(f"dataset {path} cannot be read: {err}") from err
    elif path.suffix in {".jsonl", ".json", ".ndjson"}:
        rows = _json_lines(path)
    else:
        raise DatasetError(f"dataset {path}: expected .parquet or .jsonl")
    if not rows:
        raise DatasetError(f"dataset {path} has no rows")
    # Rows go into workflow history and to agents as JSON: keep them JSON-clean.
    return TaskTable(rows=json.loads(json.dumps(rows, default=str)))


def _json_lines(path: Path) -> list[Any]:
    """A task per non-blank line, as written. The stdlib reads them, not pyarrow: a task may
    be a string or a list (pyarrow reads only objects), and pyarrow would also add the fields
    other lines have (as null) and turn date-like strings into timestamps."""
    rows = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DatasetError(
                        f"dataset {path} cannot be read: line {number}: {err}"
                    ) from err
                if row is None:
                    raise DatasetError(f"dataset {path}: line {number} is null, not a task")
                rows.append(row)
    except (OSError, UnicodeDecodeError) as err:
        raise DatasetError(f"dataset {path} cannot be read: {err}") from err
    return rows


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
