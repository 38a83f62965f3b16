"""Writers that share one attempt, for the stores' many-writer tests: each writes its own
calls, whose prompts extend each other, so deltas across writers are real. A module of its
own, light to import: the directory store's writers are processes (spawned)."""

from __future__ import annotations

import asyncio
import multiprocessing.synchronize
from dataclasses import replace
from pathlib import Path

from darl.gateway.store.base import TrajectoryStore
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.record import CallRecord
from tests.unit.test_trajectory_store import conversation

WRITERS = 2
CALLS_EACH = 15


def writer_calls(writer: str) -> list[CallRecord]:
    """One writer's share of an attempt's calls: prompts that extend each other, so the
    deltas between neighbours from different writers are real."""
    steps = [(True, [n, n + 1], [n + 2]) for n in range(CALLS_EACH)]
    return [replace(r, call_id=f"{writer}-{r.call_id}") for r in conversation(steps)]


async def append_all(store: TrajectoryStore, writer: str) -> None:
    for record in writer_calls(writer):
        await store.append(record)


def directory_writer(root: str, writer: str, start: multiprocessing.synchronize.Barrier) -> None:
    start.wait()  # both processes imported and ready: their appends overlap
    asyncio.run(append_all(DirectoryTrajectoryStore(Path(root)), writer))
