"""What a TrainingWorkflow run does next: wait, train a step, continue as new, fail or
finish, decided from its state and its loops; and the wait until there is something to do."""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum
from typing import NamedTuple

from temporalio import workflow

from darl.workflows.training_run import TrainingRun


class NextAction(StrEnum):
    """What the TrainingWorkflow's loop does next (`decide_next`)."""

    WAIT = "wait"
    TRAIN = "train"
    CONTINUE_AS_NEW = "continue"
    # Reading or starting the next tasks (or branches) failed for good.
    FEEDING_FAILED = "feeder failed"
    # So many rollouts failed in a row that the run cannot be working: it fails.
    FAIL = "failing"
    # Stopped, all steps done, or the dataset used up: the decision's `reason` says which.
    FINISH = "finish"


class Decision(NamedTuple):
    """The next action, and for FINISH why."""

    action: NextAction
    # Why the run finishes (FINISH): the TrainingSummary's reason.
    reason: str = ""


def decide_next(run: TrainingRun) -> Decision:
    """The first that holds: a feeding loop failed, too many rollouts failed in a row, a
    stop, the last step done, a pause (wait), continue-as-new due, a batch ready, the dataset
    used up (its last groups trained, then finish)."""
    state, book, config = run.state, run.book, run.config
    if run.feeding_failed():
        return Decision(NextAction.FEEDING_FAILED)
    if book.failing():
        return Decision(NextAction.FAIL)
    if state.stop_requested:
        return Decision(NextAction.FINISH, "stopped by request")
    total = config.total_steps
    if total is not None and state.step >= total:
        return Decision(NextAction.FINISH, f"completed {total} steps")
    if state.paused:
        return Decision(NextAction.WAIT)
    if continue_as_new_due(run):
        return Decision(NextAction.CONTINUE_AS_NEW)
    if book.batch_ready():
        return Decision(NextAction.TRAIN)
    if state.dataset_exhausted and not book.inflight() and not book.awaiting_branches():
        if state.ready:
            return Decision(NextAction.TRAIN)
        return Decision(NextAction.FINISH, "dataset exhausted")
    return Decision(NextAction.WAIT)


async def wait_for_work(run: TrainingRun) -> Decision:
    """Wait until there is something to do: train, continue as new, or finish (with the
    reason), or step records to write. A long silence from rollouts makes the run look them
    up."""
    try:
        await workflow.wait_condition(
            lambda: (
                decide_next(run).action is not NextAction.WAIT or bool(run.state.unwritten_records)
            ),
            timeout=timedelta(seconds=run.config.reconcile_after_seconds),
        )
    except TimeoutError:
        await run.reconcile()
    return decide_next(run)


def continue_as_new_due(run: TrainingRun) -> bool:
    """Temporal suggests it, or the history has reached `continue_as_new_after_events`."""
    info = workflow.info()
    return (
        info.is_continue_as_new_suggested()
        or info.get_current_history_length() >= run.config.continue_as_new_after_events
    )
