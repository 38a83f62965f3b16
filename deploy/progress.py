"""Following a training run from the terminal: one line per step as the TrainingWorkflow's
`metrics` query shows it, and a status line with what the run is doing now. A step's
validation finishes after its row is shown: the row is shown again, with `val`, when it lands."""

from __future__ import annotations

import asyncio

from rich.console import Console
from temporalio.client import WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from darl.workflows.names import METRICS_QUERY, STATUS_QUERY
from darl.workflows.training_messages import TrainingProgress, TrainingSummary
from darl.workflows.training_state import StepRecord

HEADER = (
    f"{'step':>5} {'reward':>7} {'±':>5} {'success':>7} {'val':>5} {'resp tok':>8} "
    f"{'stale':>5} {'paused s':>8} {'train s':>7} {'rollouts/min':>12}"
)


def step_line(record: StepRecord) -> str:
    val = "-" if record.val_reward_mean is None else f"{record.val_reward_mean:.2f}"
    return (
        f"{record.step:>5} {record.reward_mean:>7.3f} {record.reward_std:>5.2f} "
        f"{record.success_rate:>7.0%} {val:>5} {record.response_tokens_mean:>8.1f} "
        f"{record.staleness_mean:>5.2f} {record.paused_seconds:>8.3f} "
        f"{record.train_seconds:>7.2f} {record.rollouts_per_minute:>12.0f}"
    )


def status_line(progress: TrainingProgress) -> str:
    c = progress.counters
    return (
        f"{progress.phase.value}: step {progress.step}, {progress.inflight_rollouts} rollouts "
        f"out, {progress.ready_groups} groups ready, {c.rollouts_started} started, "
        f"{c.rollouts_trained} trained, {c.rollouts_failed} failed"
        + (f", {c.rollouts_resumed} resumed by replay" if c.rollouts_resumed else "")
    )


def step_table(records: list[StepRecord]) -> list[str]:
    """The header and a row per step (what `darl status` shows); nothing without steps."""
    return [HEADER, *map(step_line, records)] if records else []


async def follow(
    handle: WorkflowHandle,
    console: Console,
    interval: float = 1.0,
    shown: dict[int, StepRecord] | None = None,
) -> TrainingSummary:
    """Print steps as they land until the run ends; returns its summary. `shown` (by step)
    holds the records seen, last version of each, for the caller's report. Temporal going
    away is said once, and the run followed again when it is back."""
    shown = {} if shown is None else shown
    console.print(HEADER, style="bold", soft_wrap=True)
    # The handle was made with result_type=TrainingSummary.
    result = asyncio.ensure_future(handle.result())
    lost = False
    with console.status("starting...") as status:
        while True:
            if result.done() and _unavailable(result.exception()):
                result = asyncio.ensure_future(handle.result())
            finished = result.done()
            try:
                records = await handle.query(METRICS_QUERY, result_type=list[StepRecord])
                progress = await handle.query(STATUS_QUERY, result_type=TrainingProgress)
            except RPCError as err:
                if _unavailable(err):
                    if not lost:
                        console.print(
                            f"lost Temporal ({err.message}); waiting for it to come back "
                            "(Ctrl-C stops following, not the run)"
                        )
                        lost = True
                    status.update("waiting for Temporal")
                else:
                    # A query can time out while a worker restarts; the run goes on.
                    status.update(f"waiting for the trainer worker ({err.message})")
            else:
                if lost:
                    console.print("Temporal is back")
                    lost = False
                _print_new(console, records, shown)
                status.update(status_line(progress))
            if finished:
                # One last look after the end: the last steps may have landed since.
                return result.result()
            await asyncio.wait({result}, timeout=interval)


def _unavailable(err: BaseException | None) -> bool:
    return isinstance(err, RPCError) and err.status == RPCStatusCode.UNAVAILABLE


def _print_new(console: Console, records: list[StepRecord], shown: dict[int, StepRecord]) -> None:
    for record in records:
        if record.step not in shown:
            console.print(step_line(record), soft_wrap=True)
        elif record.val_reward_mean is not None and shown[record.step].val_reward_mean is None:
            # Validation of a step lands after its row: the row again, its `val` filled in.
            console.print(f"{step_line(record)}  validated", soft_wrap=True)
        shown[record.step] = record
