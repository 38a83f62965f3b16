"""Training runs for integration tests: a Stack that also hosts the digits agent service and a
trainer worker, a small training config aimed at it (the demo's, made small), and the checks a
finished run must pass whatever happened on the way: every step checkpointed and recorded
exactly once, every rollout accounted for."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowHandle, WorkflowQueryFailedError
from temporalio.service import RPCError

from darl.deploy.config_file import load_config
from darl.examples.digits.task import make_tasks
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.trainer.reference_backend import ReferenceTrainerSettings
from darl.trainer.run_files import read_metrics
from darl.workflows.names import TRAINING_WORKFLOW
from darl.workflows.training_config import TrainingConfig, training_workflow_id
from darl.workflows.training_messages import TrainingProgress, TrainingSummary
from tests.accounting import assert_accounted
from tests.integration.stack import Stack

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "digits" / "train.yaml"
AGENT_SERVICE = "darl.examples.digits.agent_service:app"


def start_training_stack(root: Path, client: Client) -> Stack:
    """Policy server (the digits model), gateway, rollout worker, agent service and one
    trainer worker named `trainer`; stopped again if any of them fails to start."""
    stack = Stack(root, client)
    stack.model = "digits"
    try:
        stack.start()
        stack.start_agent_service(AGENT_SERVICE)
        stack.start_trainer_worker("trainer")
    except BaseException:
        stack.stop()
        raise
    return stack


def write_tasks(path: Path, count: int, seed: int, max_tokens: int = 4) -> Path:
    tasks = make_tasks(count, seed, max_tokens=max_tokens)
    path.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    return path


def training_config(stack: Stack, run_id: str, steps: int, **overrides: Any) -> TrainingConfig:
    """The demo config, small and on-policy, aimed at `stack`: 4 groups of 4 rollouts a step,
    its own task file and run directory under the stack's root. `overrides` replace top-level
    keys; `backend_settings` merges into the backend's settings; `max_tokens` goes into the
    tasks."""
    demo = load_config(DEMO_CONFIG, run_id)
    data = demo.model_dump(mode="json")
    settings = {**data["backend"]["settings"], **overrides.pop("backend_settings", {})}
    data["backend"] |= {"model_dir": str(stack.model_dir), "settings": settings}
    data["weight_sync"] |= {
        "gateway_admin_url": None,
        "gateway_admin_urls": stack.admin_urls(),
        "policy_servers": [stack.policy_url],
    }
    data["rollout"]["agent"]["url"] = f"{stack.agent_service_url}/rollouts"
    data["rollout"]["task_queue"] = stack.task_queue
    max_tokens = overrides.pop("max_tokens", 4)
    tasks = write_tasks(stack.root / f"{run_id}-tasks.jsonl", 400, len(run_id), max_tokens)
    data["dataset"]["path"] = str(tasks)
    data |= {
        "run_dir": str(stack.runs_dir / run_id),
        "mode": "sync",
        "group_size": 4,
        "batch_size": 4,
        "min_group_size": 3,
        "total_steps": steps,
        "validation": {"every_steps": 0},
        # A killed trainer's step is retried this soon (the worker heartbeats every 5 s).
        "train_heartbeat_seconds": 12,
        "reconcile_after_seconds": 30,
        **overrides,
    }
    return TrainingConfig.model_validate(data)


def served_versions(stack: Stack, run_id: str) -> set[int]:
    """The policy versions that served the calls of the run's rollouts (from the store)."""
    store = DirectoryTrajectoryStore(stack.store_dir)
    return {
        record.policy_version
        for folder in stack.store_dir.iterdir()
        if folder.name.startswith(run_id)
        for record in store.read_sync(folder.name)
    }


async def start_training(
    client: Client, config: TrainingConfig, task_queue: str
) -> WorkflowHandle[Any, TrainingSummary]:
    return await client.start_workflow(
        TRAINING_WORKFLOW,
        config,
        id=training_workflow_id(config.run_id),
        task_queue=task_queue,
        result_type=TrainingSummary,
    )


async def wait_for_progress(
    stack: Stack,
    handle: WorkflowHandle,
    until: Callable[[TrainingProgress], bool],
    timeout: float,
) -> TrainingProgress:
    """Poll the `status` query until `until` holds. A query fails while no trainer worker
    runs (or Temporal restarts); that is waited out too, within `timeout`."""
    progress = None
    try:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    progress = await handle.query("status", result_type=TrainingProgress)
                except (RPCError, WorkflowQueryFailedError):
                    progress = None
                if progress is not None and until(progress):
                    return progress
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(
            f"the run did not get there in {timeout:g}s: {progress}\n{trainer_logs(stack)}"
        ) from None


async def training_result(
    stack: Stack, handle: WorkflowHandle[Any, TrainingSummary], timeout: float
) -> TrainingSummary:
    try:
        return await asyncio.wait_for(handle.result(), timeout)
    except TimeoutError:
        raise AssertionError(
            f"the run did not finish in {timeout:g}s\n{trainer_logs(stack)}"
        ) from None


def trainer_logs(stack: Stack) -> str:
    """The tails of the trainer workers' logs, for a failure message."""
    return "\n".join(
        f"--- {name}:\n{process.log_tail()}"
        for name, process in stack.processes.items()
        if name.startswith("trainer")
    )


# --- what a finished run must show ---------------------------------------------------------


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The step of every checkpoint folder, read from its outcome.json (checked against the
    folder's name)."""
    steps = []
    for folder in sorted((run_dir / "checkpoints").iterdir()):
        assert folder.name.startswith("step-"), f"left behind in checkpoints: {folder.name}"
        outcome = json.loads((folder / "outcome.json").read_text())
        assert outcome["step"] == int(folder.name.removeprefix("step-")), folder
        steps.append(outcome["step"])
    return steps


def check_optimizer_updates(config: TrainingConfig) -> None:
    """AdamW's update count in each checkpoint is the sum of the mini-batches every step up
    to it applied, by its own outcome: no step was applied twice or half (a retry after a
    crash started from the last checkpoint, not from a half-trained model)."""
    settings = ReferenceTrainerSettings(**config.backend.settings)
    checkpoints = Path(config.run_dir or "") / "checkpoints"
    expected = 0
    for step in range(1, (config.total_steps or 0) + 1):
        folder = checkpoints / f"step-{step:06d}"
        metrics = json.loads((folder / "outcome.json").read_text())["metrics"]
        mini_batches = settings.ppo_epochs * math.ceil(
            metrics["training/rows"] / settings.ppo_mini_batch_size
        )
        skipped = metrics.get("actor/skipped_mini_batches", 0.0)  # a fraction
        expected += round(mini_batches * (1 - skipped))
        updates = json.loads((folder / "optimizer.json").read_text())["steps"]
        assert set(updates.values()) == {expected}, (step, expected, set(updates.values()))


def check_finished_run(summary: TrainingSummary, config: TrainingConfig) -> None:
    """All steps trained, checkpointed (0..steps, one folder each) and recorded once in
    metrics.jsonl; every rollout started ended in exactly one bucket of the counters."""
    steps = config.total_steps
    run_dir = Path(config.run_dir or "")
    assert summary.steps == steps, summary.reason
    assert summary.reason == f"completed {steps} steps"
    assert checkpoint_steps(run_dir) == list(range(steps + 1))
    if config.backend.name == "reference":
        check_optimizer_updates(config)
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, steps + 1))
    c = summary.counters
    assert_accounted(c)
    # Each step trained a full batch of groups, each of at least min_group_size rollouts.
    assert c.groups_trained == steps * config.batch_size, c
    assert c.rollouts_trained >= c.groups_trained * config.least_group_size, c


async def activity_attempts(handle: WorkflowHandle, activity_type: str) -> list[int]:
    """The attempt each started `activity_type` activity ran its last try as, in order
    (Temporal writes one started event per activity, for the attempt that ended it)."""
    scheduled: set[int] = set()
    attempts = []
    async for event in handle.fetch_history_events():
        if _scheduled_type(event) == activity_type:
            scheduled.add(event.event_id)
        elif event.HasField("activity_task_started_event_attributes"):
            started = event.activity_task_started_event_attributes
            if started.scheduled_event_id in scheduled:
                attempts.append(started.attempt)
    return attempts


def _scheduled_type(event: HistoryEvent) -> str | None:
    if not event.HasField("activity_task_scheduled_event_attributes"):
        return None
    return event.activity_task_scheduled_event_attributes.activity_type.name
