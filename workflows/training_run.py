"""TrainingRun: what one workflow run of a TrainingWorkflow (one link of its continue-as-new
chain) works on, shared by its loops: the config, the state it carries, the book of groups, its
phase and its loops; and the steps they all take (publish, record a step, look up rollouts)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta

from temporalio import workflow

from darl.workflows import search_attributes as sa
from darl.workflows.names import CHECK_ROLLOUTS, RECORD_STEP
from darl.workflows.training_activity_options import (
    HEARTBEAT,
    RETRY_WITHOUT_LIMIT,
    START_TO_CLOSE,
    in_batches,
)
from darl.workflows.training_config import TrainingConfig
from darl.workflows.training_groups import GroupBook
from darl.workflows.training_messages import RecordStepRequest, RolloutLookup, TrainingPhase
from darl.workflows.training_state import StepRecord, TrainingState

# The step records the state keeps for the `metrics` query (metrics.jsonl keeps them all).
RECENT_STEPS = 50


class TrainingRun:
    """One workflow run's working set. Created by `TrainingWorkflow.__init__` from its config
    (and the state a continue-as-new carried in it); every loop and step reads and writes it,
    one at a time, as workflow code does."""

    def __init__(self, config: TrainingConfig) -> None:
        self.config = config.model_copy(update={"carried_state": None})
        self.state = config.carried_state or TrainingState(knobs=config.knobs)
        self.book = GroupBook(config, self.state)
        # Once initialized, rollouts go: a run continued as new (never mid-step) is rolling out.
        self.phase = TrainingPhase.ROLLING_OUT if self.state.initialized else TrainingPhase.STARTING
        # The run is ending or continuing as new: its loops start nothing more and return.
        self.closing = False
        # A restore of the weights is under way: a sync waits for it, so that the previous
        # weights never land after the sync's.
        self.restoring_weights = False
        # The loops the run keeps going beside its steps (the TrainingWorkflow starts them).
        self.feeder: asyncio.Task[None] | None = None
        self.brancher: asyncio.Task[None] | None = None
        self.weight_guard: asyncio.Task[None] | None = None

    # --- the loops -----------------------------------------------------------------------

    def feeding_loops(self) -> list[asyncio.Task[None]]:
        """The loops that start rollouts: their failure is the run's."""
        return [loop for loop in (self.feeder, self.brancher) if loop is not None]

    def feeding_failed(self) -> bool:
        return any(loop.done() and loop.exception() is not None for loop in self.feeding_loops())

    def raise_feeding_failure(self) -> None:
        """Reading or starting the next tasks (or branches) failed for good (a dataset that
        went away, a row that cannot be a rollout): raise that failure as the run's."""
        for loop in self.feeding_loops():
            if loop.done():
                loop.result()

    async def stop_loops(self) -> None:
        """Start nothing more, and wait for each loop to return."""
        self.closing = True
        if self.feeder is not None:
            await self.feeder
        if self.brancher is not None:
            await self.brancher
        if self.weight_guard is not None:
            await self.weight_guard

    # --- step records --------------------------------------------------------------------

    async def record_step(self, record: StepRecord) -> None:
        state = self.state
        # The trainer's own figures only in the last record the state keeps (every record
        # has them in metrics.jsonl): the state stays within its budget.
        kept = [r.model_copy(update={"trainer": {}}) for r in state.recent_steps]
        state.recent_steps = [*kept, record][-RECENT_STEPS:]
        state.unwritten_records.append(record)
        await self.flush_records()
        self.publish()

    async def flush_records(self) -> None:
        """Write step records (and their validation results, which come later) to disk."""
        state = self.state
        while state.unwritten_records:
            await workflow.execute_activity(
                RECORD_STEP,
                RecordStepRequest(
                    run_id=self.config.run_id,
                    run_dir=self.config.run_dir,
                    record=state.unwritten_records[0],
                ),
                start_to_close_timeout=START_TO_CLOSE[RECORD_STEP],
                heartbeat_timeout=HEARTBEAT,
                retry_policy=RETRY_WITHOUT_LIMIT,
            )
            state.unwritten_records.pop(0)

    def publish(self) -> None:
        """The run's phase, step and last reward as search attributes (the Web UI's columns)."""
        state = self.state
        last = state.recent_steps[-1] if state.recent_steps else None
        workflow.upsert_search_attributes(
            [
                sa.RUN.value_set(self.config.run_id),
                sa.MODE.value_set("trainer"),
                sa.STATUS.value_set(self.phase.value),
                sa.STEP.value_set(state.step),
                sa.POLICY_VERSION.value_set(state.policy_version),
                *([sa.REWARD.value_set(last.reward_mean)] if last else []),
            ]
        )

    # --- rollouts not heard from ---------------------------------------------------------

    async def wait_for_reports(self, condition: Callable[[], bool], seconds: float) -> None:
        """Wait for rollouts to report until `condition`; those still silent after `seconds`
        are looked up."""
        try:
            await workflow.wait_condition(condition, timeout=timedelta(seconds=seconds))
        except TimeoutError:
            await self.reconcile()

    async def reconcile(self) -> None:
        """Look up rollouts not heard from: one that ended without its report reaching us
        (terminated by hand, a report lost) is recorded from what Temporal knows of it."""
        pending = self.book.pending_rollouts()
        if not pending:
            return
        found: list[RolloutLookup] = []
        for batch in in_batches(pending):
            found += await workflow.execute_activity(
                CHECK_ROLLOUTS,
                batch,
                result_type=list[RolloutLookup],
                start_to_close_timeout=START_TO_CLOSE[CHECK_ROLLOUTS],
                heartbeat_timeout=HEARTBEAT,
                retry_policy=RETRY_WITHOUT_LIMIT,
            )
        for lookup in found:
            if lookup.result is not None:
                self.state.counters.reconciled_rollouts += 1
                self.book.record(lookup.result)
            elif lookup.closed_as is not None:
                self.state.counters.reconciled_rollouts += 1
                self.book.record_lost(lookup.rollout_id, f"rollout {lookup.closed_as}")
