"""The feeder: the TrainingWorkflow's loop that keeps rollouts going, reading the next tasks
whenever the book has room and starting a group for each; and the start of booked rollouts,
which the feeder, the brancher and a step's validation share."""

from __future__ import annotations

from temporalio import workflow

from darl.workflows.contracts import CURRENT_REVISION, RolloutMode
from darl.workflows.names import READ_TASKS, START_ROLLOUTS
from darl.workflows.training_activity_options import (
    BATCH,
    HEARTBEAT,
    RETRY_WITHOUT_LIMIT,
    START_TO_CLOSE,
    in_batches,
)
from darl.workflows.training_messages import (
    ReadTasksRequest,
    RolloutStart,
    StartRolloutsRequest,
    TaskBatch,
    TrainingPhase,
)
from darl.workflows.training_run import TrainingRun
from darl.workflows.training_state import TaskRow


async def feed(run: TrainingRun) -> None:
    """Until the run closes or the dataset is used up: wait for room, read that many tasks
    (at most BATCH), start their groups."""
    state, config = run.state, run.config
    while True:
        await workflow.wait_condition(lambda: run.closing or _room(run) > 0)
        if run.closing:
            return
        batch = await workflow.execute_activity(
            READ_TASKS,
            ReadTasksRequest(
                dataset=config.dataset,
                epoch=state.epoch,
                cursor=state.cursor,
                count=min(_room(run), BATCH),
                epochs=config.epochs,
            ),
            result_type=TaskBatch,
            start_to_close_timeout=START_TO_CLOSE[READ_TASKS],
            heartbeat_timeout=HEARTBEAT,
            retry_policy=RETRY_WITHOUT_LIMIT,
        )
        state.epoch, state.cursor = batch.epoch, batch.cursor
        state.dataset_exhausted = batch.exhausted
        await start_groups(run, batch.rows, RolloutMode.TRAIN, config.group_size)
        if batch.exhausted:
            return


def _room(run: TrainingRun) -> int:
    busy = run.phase in (TrainingPhase.TRAINING, TrainingPhase.SYNCING)
    return run.book.room(busy)


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
