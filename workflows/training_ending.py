"""How a TrainingWorkflow run ends: finishing (no new rollouts, the last validation waited
for, the rollouts still out given their grace or cancelled, the summary), or continuing as new
with its state, nothing mid-start."""

from __future__ import annotations

from typing import NoReturn

from temporalio import workflow

from darl.workflows.names import CANCEL_ROLLOUTS
from darl.workflows.training_activity_options import (
    HEARTBEAT,
    RETRY_WITHOUT_LIMIT,
    START_TO_CLOSE,
)
from darl.workflows.training_messages import TrainingPhase, TrainingSummary
from darl.workflows.training_run import TrainingRun


async def finish(run: TrainingRun, reason: str) -> TrainingSummary:
    """No new rollouts; the ones out finish (within the grace) or are cancelled. Every step
    is already checkpointed, so the summary is all that is left to write."""
    config, state, book = run.config, run.state, run.book
    run.phase = TrainingPhase.STOPPING
    await run.stop_loops()
    if not state.stop_requested and book.validating():
        # The last step's validation is part of the run's result.
        await run.wait_for_reports(
            lambda: not book.validating(), config.rollout.timeouts.agent_seconds
        )
    grace = state.stop_grace_seconds
    if grace is None:
        grace = config.stop_grace_seconds
    if book.inflight() and grace and not state.stop_cancels_inflight:
        await _wait_for_rollouts_to_finish(run, grace)
    pending = book.pending_rollouts()
    if pending:
        await workflow.execute_activity(
            CANCEL_ROLLOUTS,
            pending,
            start_to_close_timeout=START_TO_CLOSE[CANCEL_ROLLOUTS],
            heartbeat_timeout=HEARTBEAT,
            retry_policy=RETRY_WITHOUT_LIMIT,
        )
        await _wait_out_cancelled(run)
    book.close()
    await run.flush_records()
    run.phase = TrainingPhase.FINISHED
    run.publish()
    await workflow.wait_condition(workflow.all_handlers_finished)
    return TrainingSummary(
        run_id=config.run_id,
        steps=state.step,
        policy_version=state.policy_version,
        stopped=state.stop_requested,
        reason=reason,
        counters=state.counters,
        inflight_at_end=book.inflight(),
        last=state.recent_steps[-1] if state.recent_steps else None,
        run_dir=config.run_dir,
        seconds=workflow.time() - state.started_at,
    )


async def _wait_for_rollouts_to_finish(run: TrainingRun, grace: float) -> None:
    """A stop that lets rollouts finish: they finish within the grace, or a later stop that
    cancels cuts the wait short (a patch marker: the TrainingWorkflow's module docstring)."""
    if workflow.patched("a-cancelling-stop-cuts-the-grace"):
        await run.wait_for_reports(
            lambda: not run.book.inflight() or run.state.stop_cancels_inflight, grace
        )
    else:
        await _wait_for_rollouts(run, grace)


async def _wait_out_cancelled(run: TrainingRun) -> None:
    """Every cancelled rollout reports (or is found closed by a lookup) before the run ends,
    within `cancel_wait_seconds`; what is still out then is in the summary."""
    deadline = workflow.time() + run.config.cancel_wait_seconds
    while run.book.inflight() and workflow.time() < deadline:
        await _wait_for_rollouts(run, min(60.0, max(deadline - workflow.time(), 1.0)))


async def _wait_for_rollouts(run: TrainingRun, seconds: float) -> None:
    await run.wait_for_reports(lambda: not run.book.inflight(), seconds)


async def continue_as_new(run: TrainingRun) -> NoReturn:
    """Hand the state to a fresh run: nothing is out mid-start, every handler is done;
    rollouts still running report to the workflow id and reach the next run."""
    await run.stop_loops()
    await workflow.wait_condition(workflow.all_handlers_finished)
    run.state.runs += 1
    workflow.continue_as_new(run.config.model_copy(update={"carried_state": run.state}))
