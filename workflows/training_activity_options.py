"""How the TrainingWorkflow calls its activities: the retry policies and timeouts its steps
pass at each call, and the batches in which it starts and looks up many rollouts."""

from __future__ import annotations

from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy

from darl.workflows.names import (
    CANCEL_ROLLOUTS,
    CHECK_ROLLOUTS,
    CHECK_RUN,
    CHOOSE_BRANCH_POINT,
    INITIALIZE_POLICY,
    READ_TASKS,
    READ_VAL_TASKS,
    RECORD_STEP,
    RESTORE_WEIGHTS,
    START_ROLLOUTS,
    SYNC_WEIGHTS,
    TRAIN_STEP,
    TRAINING_CONFIG_ERROR,
    WEIGHT_SYNC_ERROR,
)

# Retries without limit, at most 30 s apart: what the run cannot go on without (a step, the
# next tasks, starting its rollouts) waits out any outage, and only bad input fails it.
RETRY_WITHOUT_LIMIT = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=30),
    non_retryable_error_types=[TRAINING_CONFIG_ERROR],
)
# What the run needs from the world (agent service, policy servers, gateway) gets about half
# a minute to answer at the start; then the run fails saying what did not (rule 9).
START_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=4),
    maximum_attempts=10,
    non_retryable_error_types=[TRAINING_CONFIG_ERROR],
)
# A weight sync rides out a policy server or gateway restart (a vLLM takes ~30 s on CPU, a
# Kubernetes Pod longer), for about ten minutes; then the run fails with the sync's error.
SYNC_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=25,
    non_retryable_error_types=[TRAINING_CONFIG_ERROR, WEIGHT_SYNC_ERROR],
)
# Choosing a branch point reads the seed's records from the store: a few tries, then the
# group's members start whole (an outage or a malformed record must not hold the run).
BRANCH_POINT_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=8),
    maximum_attempts=5,
)
# Every trainer activity heartbeats (train_step at its own configured timeout): a trainer
# worker that dies is noticed within this, and its activity moves to the next worker.
HEARTBEAT = timedelta(seconds=10)
# How long each activity may take, start to close (a retry starts the clock again). A sync
# gets this beyond its drain timeout; train_step also has the config's own heartbeat timeout.
START_TO_CLOSE = {
    CHECK_RUN: timedelta(minutes=2),
    INITIALIZE_POLICY: timedelta(minutes=10),
    READ_TASKS: timedelta(minutes=5),
    READ_VAL_TASKS: timedelta(minutes=5),
    START_ROLLOUTS: timedelta(minutes=5),
    CANCEL_ROLLOUTS: timedelta(minutes=5),
    CHECK_ROLLOUTS: timedelta(minutes=5),
    TRAIN_STEP: timedelta(hours=2),
    SYNC_WEIGHTS: timedelta(minutes=5),
    RESTORE_WEIGHTS: timedelta(minutes=10),
    RECORD_STEP: timedelta(minutes=1),
    CHOOSE_BRANCH_POINT: timedelta(minutes=5),
}
# The most rollouts one start_rollouts or check_rollouts activity takes, and the most tasks
# one read_tasks reads: their inputs and results stay far below Temporal's 2 MB
# (docs/architecture.md, the budgets).
BATCH = 256

_Item = TypeVar("_Item")


def in_batches(items: list[_Item]) -> list[list[_Item]]:
    """`items` in batches of BATCH; one batch, whatever its size, when replaying a history
    without the "rollouts-in-batches" marker (the TrainingWorkflow's module docstring)."""
    if len(items) <= BATCH or not workflow.patched("rollouts-in-batches"):
        return [items] if items else []
    return [items[i : i + BATCH] for i in range(0, len(items), BATCH)]
