"""How a TrainingWorkflow starts its rollouts: groups booked in the GroupBook before any of
their rollouts starts, then the start_rollouts activity, in batches, at the run's current
policy version. The feeder, the brancher and a step's validation all start rollouts here."""

from __future__ import annotations

from temporalio import workflow

from darl.workflows.contracts import CURRENT_REVISION, RolloutMode
from darl.workflows.names import START_ROLLOUTS
from darl.workflows.training_activity_options import (
    HEARTBEAT,
    RETRY_WITHOUT_LIMIT,
    START_TO_CLOSE,
    in_batches,
)
from darl.workflows.training_messages import RolloutStart, StartRolloutsRequest
from darl.workflows.training_run import TrainingRun
from darl.workflows.training_state import TaskRow


async def start_groups(run: TrainingRun, rows: list[TaskRow], mode: RolloutMode, size: int) -> None:
    """Book the groups first, then start their rollouts (idempotent by workflow id), so a
    report can never arrive for a rollout the book does not know."""
    await start_rollouts(run, run.book.open_groups(rows, mode, size, now=workflow.time()))


async def start_rollouts(run: TrainingRun, starts: list[RolloutStart]) -> None:
    """Start rollouts booked at the current policy version, in batches (each a few hundred
    bytes: the tasks go by reference)."""
    config = run.config
    settings, version = config.rollout, run.state.policy_version
    for batch in in_batches(starts):
        await workflow.execute_activity(
            START_ROLLOUTS,
            StartRolloutsRequest(
                task_queue=settings.task_queue,
                run_id=config.run_id,
                settings=settings,
                dataset=config.dataset.path,
                val_dataset=config.validation.path or config.dataset.path,
                policy_version=version,
                report_to=workflow.info().workflow_id,
                revision=CURRENT_REVISION,
                rollouts=batch,
            ),
            start_to_close_timeout=START_TO_CLOSE[START_ROLLOUTS],
            heartbeat_timeout=HEARTBEAT,
            retry_policy=RETRY_WITHOUT_LIMIT,
        )
