"""The trainer worker: serves TrainingWorkflow and the trainer's activities on `darl-trainer`.

It needs the gateway's trajectory store (read-only) for the token data of each step, the runs
directory for checkpoints and metrics, and the admin key to pause and resume the gateway."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from temporalio.client import Client
from temporalio.worker import Worker

from darl.activities.training_activities import TrainerActivities
from darl.gateway.store.url import open_store
from darl.workflows.names import TRAINER_TASK_QUEUE
from darl.workflows.training_workflow import TrainingWorkflow


@dataclass(frozen=True)
class TrainerWorkerSettings:
    store_dir: Path
    runs_dir: Path
    admin_key: str
    task_queue: str = TRAINER_TASK_QUEUE
    # An s3:// (or file://) URL of the store, in place of `store_dir` (gateway/store_url.py).
    store_url: str | None = None


@contextlib.asynccontextmanager
async def build_trainer_worker(
    client: Client, settings: TrainerWorkerSettings, http_client: httpx.AsyncClient
) -> AsyncIterator[Worker]:
    """The worker, running while the context is open; on exit, after the worker has stopped,
    the backends let go of what they hold (verl's Ray workers)."""
    activities = TrainerActivities(
        client,
        open_store(settings.store_url or settings.store_dir),
        settings.runs_dir,
        settings.admin_key,
        http_client,
    )
    worker = Worker(
        client,
        task_queue=settings.task_queue,
        workflows=[TrainingWorkflow],
        activities=activities.activities(),
        # A step holds the model in memory and the CPU; steps wait for each other anyway.
        max_concurrent_activities=16,
    )
    try:
        async with worker:
            yield worker
    finally:
        await asyncio.to_thread(activities.close)
