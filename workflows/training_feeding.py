"""The feeder: the TrainingWorkflow's loop that keeps rollouts going, reading the next tasks
whenever the book has room (at most BATCH at a time) and starting a group for each, until the
run closes or the dataset is used up."""

from __future__ import annotations

from temporalio import workflow

from darl.workflows.contracts import RolloutMode
from darl.workflows.names import READ_TASKS
from darl.workflows.training_activity_options import (
    BATCH,
    HEARTBEAT,
    RETRY_WITHOUT_LIMIT,
    START_TO_CLOSE,
)
from darl.workflows.training_messages import ReadTasksRequest, TaskBatch, TrainingPhase
from darl.workflows.training_rollout_starts import start_groups
from darl.workflows.training_run import TrainingRun


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
