"""The policy servers' weights as a TrainingWorkflow keeps them: the sync that puts each new
step's weights on them, and the weight guard, the loop that loads the run's weights again on a
server that lost them between syncs."""

from __future__ import annotations

import contextlib
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

from darl.workflows.names import (
    RESTORE_WEIGHTS,
    SYNC_WEIGHTS,
    TRAINING_CONFIG_ERROR,
    WEIGHT_SYNC_ERROR,
)
from darl.workflows.training_activity_options import HEARTBEAT, START_TO_CLOSE, SYNC_RETRY
from darl.workflows.training_messages import RestoreResult, SyncRequest, SyncResult, TrainingPhase
from darl.workflows.training_run import TrainingRun


async def sync_weights(run: TrainingRun, policy_path: str, version: int) -> SyncResult:
    """Put the weights at `policy_path` on every policy server, as `version`."""
    # A restore of the previous weights must not land after this sync's load.
    await workflow.wait_condition(lambda: not run.restoring_weights)
    result: SyncResult = await workflow.execute_activity(
        SYNC_WEIGHTS,
        SyncRequest(
            weight_sync=run.config.weight_sync,
            policy_path=policy_path,
            policy_version=version,
        ),
        result_type=SyncResult,
        start_to_close_timeout=START_TO_CLOSE[SYNC_WEIGHTS]
        + timedelta(seconds=run.config.weight_sync.drain_timeout_seconds),
        heartbeat_timeout=HEARTBEAT,
        retry_policy=SYNC_RETRY,
    )
    return result


async def guard_weights(run: TrainingRun) -> None:
    """Between syncs, every `check_every_seconds`: a policy server that lost the run's
    weights (restarted on others, rule 8) gets them loaded again. It served no call
    meanwhile: the gateway holds calls for a server behind the run."""
    every = timedelta(seconds=run.config.weight_sync.check_every_seconds)
    while not run.closing:
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(lambda: run.closing, timeout=every)
        if run.closing or run.phase == TrainingPhase.SYNCING:
            continue
        path = run.state.policy_path
        if path is None:
            continue
        run.restoring_weights = True
        try:
            found = await _restore(run, path)
        except ActivityError as err:
            # A server gone for good fails the run's rollouts, and so the run; until then,
            # the next round tries again.
            workflow.logger.warning("restoring the run's weights failed: %s", err.cause)
            continue
        finally:
            run.restoring_weights = False
        if found.restored:
            workflow.logger.warning("loaded the run's weights again on %s", found.restored)


async def _restore(run: TrainingRun, path: str) -> RestoreResult:
    result: RestoreResult = await workflow.execute_activity(
        RESTORE_WEIGHTS,
        SyncRequest(
            weight_sync=run.config.weight_sync,
            policy_path=path,
            policy_version=run.state.policy_version,
        ),
        result_type=RestoreResult,
        start_to_close_timeout=START_TO_CLOSE[RESTORE_WEIGHTS],
        heartbeat_timeout=HEARTBEAT,
        # A few tries: the next round tries again, and a sync waits for this one.
        retry_policy=RetryPolicy(
            maximum_attempts=3,
            non_retryable_error_types=[TRAINING_CONFIG_ERROR, WEIGHT_SYNC_ERROR],
        ),
    )
    return result
