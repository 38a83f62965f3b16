"""TrainingWorkflow: one RL training run, durable from the first rollout to the last step.

Reads as the story of a run: put the initial policy on the servers, keep rollouts going (a
feeder), and whenever a batch of complete groups is ready, train a step, sync the weights and
bump the policy version. Rollouts report back by signal on the run's workflow id, so a report
reaches whichever run of a continue-as-new chain is current (rule 6).

A history replays under later code through `workflow.patched` markers, each naming a change
of the command sequence (a rollout's own sequence is its `RolloutSpec.revision` instead, the
table above CURRENT_REVISION in contracts.py):

    "a-cancelling-stop-cuts-the-grace"   a stop that cancels rollouts ends the wait of an
                                         earlier stop's grace (`_wait_for_rollouts_to_finish`)
    "rollouts-in-batches"                more than BATCH rollouts are started, or looked up,
                                         by several activities of BATCH each (`_batches`)
    "branch-groups-independently"        each branching group's branch point and branches
                                         on their own (`_branch`), not one group at a time
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import timedelta
from enum import StrEnum
from typing import Any, NamedTuple, NoReturn, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from darl.workflows import search_attributes as sa
    from darl.workflows.contracts import CURRENT_REVISION, RolloutMode, RolloutOutcome
    from darl.workflows.errors import one_line
    from darl.workflows.names import (
        CANCEL_ROLLOUTS,
        CHECK_ROLLOUTS,
        CHECK_RUN,
        CHOOSE_BRANCH_POINT,
        INITIALIZE_POLICY,
        METRICS_QUERY,
        PAUSE_SIGNAL,
        READ_TASKS,
        READ_VAL_TASKS,
        RECORD_STEP,
        RESTORE_WEIGHTS,
        RESUME_SIGNAL,
        ROLLOUT_FINISHED_SIGNAL,
        ROLLOUTS_FINISHED_SIGNAL,
        START_ROLLOUTS,
        STATUS_QUERY,
        STOP_SIGNAL,
        SYNC_WEIGHTS,
        TRAIN_STEP,
        TRAINING_CONFIG_ERROR,
        TRAINING_WORKFLOW,
        UPDATE_KNOBS,
        WEIGHT_SYNC_ERROR,
    )
    from darl.workflows.training_config import TrainingConfig
    from darl.workflows.training_groups import GroupBook, can_branch
    from darl.workflows.training_messages import (
        BranchPoint,
        BranchPointRequest,
        InitializeRequest,
        KnobUpdate,
        ReadTasksRequest,
        ReadValTasksRequest,
        RecordStepRequest,
        RestoreResult,
        RolloutLookup,
        RolloutStart,
        StartRolloutsRequest,
        StopRequest,
        SyncRequest,
        SyncResult,
        TaskBatch,
        TrainingPhase,
        TrainingProgress,
        TrainingSummary,
        TrainStepRequest,
        TrainStepResult,
    )
    from darl.workflows.training_state import Knobs, StepRecord, TaskRow, TrainingState


# Retries without limit, at most 30 s apart: what the run cannot go on without (a step, the
# next tasks, starting its rollouts) waits out any outage, and only bad input fails it.
RETRY_WITHOUT_LIMIT = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=30),
    non_retryable_error_types=[TRAINING_CONFIG_ERROR],
)
# What the run needs from the world (agent service, policy servers, gateway) gets about half
# a minute to answer at the start; then the run fails saying what did not (rule 9).
AT_START = RetryPolicy(
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
RECENT_STEPS = 50
# The most rollouts one start_rollouts or check_rollouts activity takes, and the most tasks
# one read_tasks reads: their inputs and results stay far below Temporal's 2 MB
# (docs/architecture.md, the budgets).
BATCH = 256
# A knob update refused (by its fields' rules or the run's): sending it again cannot help.
KNOB_UPDATE_ERROR = "KnobUpdateError"
_Item = TypeVar("_Item")


class Move(StrEnum):
    """What the run's loop does next (`_what_next`)."""

    WAIT = "wait"
    TRAIN = "train"
    CONTINUE_AS_NEW = "continue"
    # Reading or starting the next tasks failed for good.
    FEEDER_FAILED = "feeder failed"
    # So many rollouts failed in a row that the run cannot be working: it fails.
    FAIL = "failing"
    # Stopped, all steps done, or the dataset used up: `reason` says which.
    FINISH = "finish"


class Next(NamedTuple):
    move: Move
    # Why the run finishes (FINISH): the TrainingSummary's reason.
    reason: str = ""


# A ValidationError is input no retry can fix (a TrainingConfig the temporal CLI sent that
# does not validate): the workflow fails at once with pydantic's message (rule 9).
@workflow.defn(name=TRAINING_WORKFLOW, failure_exception_types=[ValidationError])
class TrainingWorkflow:
    @workflow.init
    def __init__(self, config: TrainingConfig) -> None:
        self._config = config.model_copy(update={"carried_state": None})
        self._state = config.carried_state or TrainingState(knobs=config.knobs)
        self._book = GroupBook(config, self._state)
        # Once initialized, rollouts go: a run continued as new (never mid-step) is rolling out.
        self._phase = (
            TrainingPhase.ROLLING_OUT if self._state.initialized else TrainingPhase.STARTING
        )
        self._closing = False
        self._feeder: asyncio.Task[None] | None = None
        self._brancher: asyncio.Task[None] | None = None
        self._guard: asyncio.Task[None] | None = None
        self._restoring = False

    # --- the story ---------------------------------------------------------------------

    @workflow.run
    async def run(self, config: TrainingConfig) -> TrainingSummary:
        if not self._state.started_at:
            self._state.started_at = workflow.time()
        self._publish()
        if not self._state.initialized:
            await self._initialize()
        self._feeder = asyncio.create_task(self._feed())
        if self._config.groups.mode == "branch":
            self._brancher = asyncio.create_task(self._branch())
        self._guard = asyncio.create_task(self._guard_weights())
        while True:
            await self._flush_records()
            move, reason = await self._wait_for_work()
            if move is Move.TRAIN:
                await self._train_step()
            elif move is Move.CONTINUE_AS_NEW:
                await self._continue_as_new()
            elif move is Move.FEEDER_FAILED:
                # Reading or starting the next tasks (or branches) failed for good (a dataset
                # that went away, a row that cannot be a rollout): that failure is the run's.
                for loop in self._feeding_loops():
                    if loop.done():
                        loop.result()
            elif move is Move.FAIL:
                await self._finish(Move.FAIL.value)
                raise ApplicationError(self._book.failing_message(), non_retryable=True)
            elif move is Move.FINISH:
                return await self._finish(reason)

    async def _initialize(self) -> None:
        """Check that the run can work at all (its data, reward, agent service, policy
        servers, gateway; a run id trains once), then put step 0 on the policy servers, so
        every rollout of the run knows what it ran."""
        await workflow.execute_activity(
            CHECK_RUN,
            self._config,
            start_to_close_timeout=START_TO_CLOSE[CHECK_RUN],
            heartbeat_timeout=HEARTBEAT,
            retry_policy=AT_START,
        )
        start = await workflow.execute_activity(
            INITIALIZE_POLICY,
            InitializeRequest(
                run_id=self._config.run_id,
                run_dir=self._config.run_dir,
                backend=self._config.backend,
            ),
            result_type=TrainStepResult,
            start_to_close_timeout=START_TO_CLOSE[INITIALIZE_POLICY],
            heartbeat_timeout=HEARTBEAT,
            retry_policy=RETRY_WITHOUT_LIMIT,
        )
        await self._sync(start.policy_path, start.step)
        self._state.step = self._state.policy_version = start.step
        self._state.policy_path = start.policy_path
        self._state.initialized = True
        self._phase = TrainingPhase.ROLLING_OUT
        self._publish()

    async def _wait_for_work(self) -> Next:
        """Wait until there is something to do: train, continue as new, or finish (with the
        reason). A long silence from rollouts makes the trainer look them up."""
        try:
            await workflow.wait_condition(
                lambda: (
                    self._what_next().move is not Move.WAIT or bool(self._state.unwritten_records)
                ),
                timeout=timedelta(seconds=self._config.reconcile_after_seconds),
            )
        except TimeoutError:
            await self._reconcile()
        return self._what_next()

    def _what_next(self) -> Next:
        state, book = self._state, self._book
        if any(loop.done() and loop.exception() is not None for loop in self._feeding_loops()):
            return Next(Move.FEEDER_FAILED)
        if book.failing():
            return Next(Move.FAIL)
        if state.stop_requested:
            return Next(Move.FINISH, "stopped by request")
        total = self._config.total_steps
        if total is not None and state.step >= total:
            return Next(Move.FINISH, f"completed {total} steps")
        if state.paused:
            return Next(Move.WAIT)
        if self._continue_as_new_due():
            return Next(Move.CONTINUE_AS_NEW)
        if book.batch_ready():
            return Next(Move.TRAIN)
        if state.dataset_exhausted and not book.inflight() and not book.awaiting_branches():
            return Next(Move.TRAIN) if state.ready else Next(Move.FINISH, "dataset exhausted")
        return Next(Move.WAIT)

    async def _train_step(self) -> None:
        state = self._state
        self._phase = TrainingPhase.TRAINING
        groups, stats = self._book.take_batch()
        step = state.step + 1
        trained = await workflow.execute_activity(
            TRAIN_STEP,
            TrainStepRequest(
                run_id=self._config.run_id,
                run_dir=self._config.run_dir,
                step=step,
                backend=self._config.backend,
                aggregation=self._config.aggregation,
                groups=groups,
                learning_rate=state.knobs.learning_rate,
            ),
            result_type=TrainStepResult,
            start_to_close_timeout=START_TO_CLOSE[TRAIN_STEP],
            # A trainer worker that dies mid-step is noticed by its missing heartbeat; the
            # retry resumes from the last checkpoint and never applies a step twice (rule 5).
            heartbeat_timeout=timedelta(seconds=self._config.train_heartbeat_seconds),
            retry_policy=RETRY_WITHOUT_LIMIT,
        )
        self._phase = TrainingPhase.SYNCING
        synced = await self._sync(trained.policy_path, step)
        state.step = state.policy_version = step
        state.policy_path = trained.policy_path
        self._book.drop_stale()
        await self._record(
            self._book.step_record(step, stats, trained, synced, now=workflow.time())
        )
        self._phase = TrainingPhase.ROLLING_OUT
        every = self._config.validation.every_steps
        if every and step % every == 0:
            await self._start_validation(step)

    async def _sync(self, policy_path: str, version: int) -> SyncResult:
        # A restore of the previous weights must not land after this sync's load.
        await workflow.wait_condition(lambda: not self._restoring)
        result: SyncResult = await workflow.execute_activity(
            SYNC_WEIGHTS,
            SyncRequest(
                weight_sync=self._config.weight_sync,
                policy_path=policy_path,
                policy_version=version,
            ),
            result_type=SyncResult,
            start_to_close_timeout=START_TO_CLOSE[SYNC_WEIGHTS]
            + timedelta(seconds=self._config.weight_sync.drain_timeout_seconds),
            heartbeat_timeout=HEARTBEAT,
            retry_policy=SYNC_RETRY,
        )
        return result

    async def _finish(self, reason: str) -> TrainingSummary:
        """No new rollouts; the ones out finish (within the grace) or are cancelled. Every
        step is already checkpointed, so the summary is all that is left to write."""
        self._phase = TrainingPhase.STOPPING
        await self._stop_feeding()
        if not self._state.stop_requested and self._book.validating():
            # The last step's validation is part of the run's result.
            await self._wait_for(
                lambda: not self._book.validating(), self._config.rollout.timeouts.agent_seconds
            )
        grace = self._state.stop_grace_seconds
        if grace is None:
            grace = self._config.stop_grace_seconds
        if self._book.inflight() and grace and not self._state.stop_cancels_inflight:
            await self._wait_for_rollouts_to_finish(grace)
        pending = self._book.pending_rollouts()
        if pending:
            await workflow.execute_activity(
                CANCEL_ROLLOUTS,
                pending,
                start_to_close_timeout=START_TO_CLOSE[CANCEL_ROLLOUTS],
                heartbeat_timeout=HEARTBEAT,
                retry_policy=RETRY_WITHOUT_LIMIT,
            )
            await self._wait_out_cancelled()
        self._book.close()
        await self._flush_records()
        self._phase = TrainingPhase.FINISHED
        self._publish()
        await workflow.wait_condition(workflow.all_handlers_finished)
        state = self._state
        return TrainingSummary(
            run_id=self._config.run_id,
            steps=state.step,
            policy_version=state.policy_version,
            stopped=state.stop_requested,
            reason=reason,
            counters=state.counters,
            inflight_at_end=self._book.inflight(),
            last=state.recent_steps[-1] if state.recent_steps else None,
            run_dir=self._config.run_dir,
            seconds=workflow.time() - state.started_at,
        )

    async def _wait_out_cancelled(self) -> None:
        """Every cancelled rollout reports (or is found closed by a lookup) before the run
        ends, within `cancel_wait_seconds`; what is still out then is in the summary."""
        deadline = workflow.time() + self._config.cancel_wait_seconds
        while self._book.inflight() and workflow.time() < deadline:
            await self._wait_for_rollouts(min(60.0, max(deadline - workflow.time(), 1.0)))

    async def _wait_for_rollouts(self, seconds: float) -> None:
        await self._wait_for(lambda: not self._book.inflight(), seconds)

    async def _wait_for_rollouts_to_finish(self, grace: float) -> None:
        """A stop that lets rollouts finish: they finish within the grace, or a later stop
        that cancels cuts the wait short (a patched marker: the module docstring)."""
        if workflow.patched("a-cancelling-stop-cuts-the-grace"):
            await self._wait_for(
                lambda: not self._book.inflight() or self._state.stop_cancels_inflight, grace
            )
        else:
            await self._wait_for_rollouts(grace)

    async def _wait_for(self, condition: Callable[[], bool], seconds: float) -> None:
        """Wait for rollouts to report; those still silent after `seconds` are looked up."""
        try:
            await workflow.wait_condition(condition, timeout=timedelta(seconds=seconds))
        except TimeoutError:
            await self._reconcile()

    async def _continue_as_new(self) -> None:
        """Hand the state to a fresh run: nothing is out mid-start, every handler is done;
        rollouts still running report to the workflow id and reach the next run."""
        await self._stop_feeding()
        await workflow.wait_condition(workflow.all_handlers_finished)
        self._state.runs += 1
        workflow.continue_as_new(self._config.model_copy(update={"carried_state": self._state}))

    def _continue_as_new_due(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self._config.continue_as_new_after_events
        )

    # --- the feeder: keeps rollouts going ----------------------------------------------

    async def _feed(self) -> None:
        while True:
            await workflow.wait_condition(lambda: self._closing or self._room() > 0)
            if self._closing:
                return
            batch = await workflow.execute_activity(
                READ_TASKS,
                ReadTasksRequest(
                    dataset=self._config.dataset,
                    epoch=self._state.epoch,
                    cursor=self._state.cursor,
                    count=min(self._room(), BATCH),
                    epochs=self._config.epochs,
                ),
                result_type=TaskBatch,
                start_to_close_timeout=START_TO_CLOSE[READ_TASKS],
                heartbeat_timeout=HEARTBEAT,
                retry_policy=RETRY_WITHOUT_LIMIT,
            )
            self._state.epoch, self._state.cursor = batch.epoch, batch.cursor
            self._state.dataset_exhausted = batch.exhausted
            await self._start_groups(batch.rows, RolloutMode.TRAIN, self._config.group_size)
            if batch.exhausted:
                return

    def _room(self) -> int:
        busy = self._phase in (TrainingPhase.TRAINING, TrainingPhase.SYNCING)
        return self._book.room(busy)

    async def _start_groups(self, rows: list[TaskRow], mode: RolloutMode, size: int) -> None:
        """Book the groups first, then start their rollouts (idempotent by workflow id), so a
        report can never arrive for a rollout the book does not know."""
        await self._start_rollouts(self._book.open_groups(rows, mode, size, now=workflow.time()))

    async def _start_rollouts(self, starts: list[RolloutStart]) -> None:
        """Start rollouts booked at the current policy version, in batches (each a few
        hundred bytes: the tasks go by reference)."""
        settings, version = self._config.rollout, self._state.policy_version
        for batch in _batches(starts):
            await workflow.execute_activity(
                START_ROLLOUTS,
                StartRolloutsRequest(
                    task_queue=settings.task_queue,
                    run_id=self._config.run_id,
                    settings=settings,
                    dataset=self._config.dataset.path,
                    val_dataset=self._config.validation.path or self._config.dataset.path,
                    policy_version=version,
                    report_to=workflow.info().workflow_id,
                    revision=CURRENT_REVISION,
                    rollouts=batch,
                ),
                start_to_close_timeout=START_TO_CLOSE[START_ROLLOUTS],
                heartbeat_timeout=HEARTBEAT,
                retry_policy=RETRY_WITHOUT_LIMIT,
            )

    async def _stop_feeding(self) -> None:
        self._closing = True
        if self._feeder is not None:
            await self._feeder
        if self._brancher is not None:
            await self._brancher
        if self._guard is not None:
            await self._guard

    def _feeding_loops(self) -> list[asyncio.Task[None]]:
        return [loop for loop in (self._feeder, self._brancher) if loop is not None]

    # --- the brancher: a branching group's members start once its seed has reported ----

    async def _branch(self) -> None:
        """Start the branches of each group whose seed has reported (none while paused),
        each group on its own: one whose branch point takes its time (the store slow, its
        retries) holds no other. A group is booked before its branches start, as in
        `_start_groups`; one whose branches are still to start at a continue-as-new is
        carried in the state. A failure to start them is the brancher's, and so the run's."""
        if not workflow.patched("branch-groups-independently"):
            return await self._branch_one_at_a_time()
        book, opening = self._book, dict[str, asyncio.Task[None]]()

        def more() -> bool:
            waiting = not self._state.paused and any(g not in opening for g in book.to_branch())
            return self._closing or waiting or any(t.done() for t in opening.values())

        while True:
            await workflow.wait_condition(more)
            for group_id, opened in list(opening.items()):
                if opened.done():
                    del opening[group_id]
                    opened.result()
            if self._closing:
                break
            if self._state.paused:
                continue
            for group_id in book.to_branch():
                if group_id not in opening:
                    opening[group_id] = asyncio.create_task(self._open_branches(group_id))
        for opened in opening.values():
            await opened

    async def _open_branches(self, group_id: str) -> None:
        at = await self._branch_point(group_id)
        await self._start_rollouts(self._book.open_branches(group_id, at))

    async def _branch_one_at_a_time(self) -> None:
        """`_branch` in a history from before the "branch-groups-independently" marker."""
        book = self._book
        while True:
            await workflow.wait_condition(
                lambda: self._closing or (not self._state.paused and bool(book.to_branch()))
            )
            if self._closing:
                return
            group_id = book.to_branch()[0]
            at = await self._branch_point(group_id)
            await self._start_rollouts(book.open_branches(group_id, at))

    async def _branch_point(self, group_id: str) -> int | None:
        """The prefix length the group's branches start from, by the config's rule; None when
        the seed cannot branch (it failed, made fewer than two calls, or the store does not
        hold them as it committed them): its members then start whole."""
        seed = self._book.seed_result(group_id)
        groups = self._config.groups
        if not can_branch(seed):
            return None
        if groups.branch_at != "surprisal":
            return groups.branch_point(seed.calls, workflow.random())
        try:
            point: BranchPoint = await workflow.execute_activity(
                CHOOSE_BRANCH_POINT,
                BranchPointRequest(
                    rollout_id=seed.rollout_id,
                    attempt=seed.attempts,
                    calls=seed.calls,
                    digest=seed.events_digest,
                ),
                result_type=BranchPoint,
                start_to_close_timeout=START_TO_CLOSE[CHOOSE_BRANCH_POINT],
                heartbeat_timeout=HEARTBEAT,
                retry_policy=BRANCH_POINT_RETRY,
            )
        except ActivityError as err:
            workflow.logger.warning(
                "no branch point for seed %s, its group starts whole: %s",
                seed.rollout_id,
                err.cause,
            )
            return None
        if point.at is None:
            return None
        if not 1 <= point.at < seed.calls:
            workflow.logger.warning(
                "branch point %d is outside calls 1..%d of seed %s, its group starts whole",
                point.at,
                seed.calls - 1,
                seed.rollout_id,
            )
            return None
        return point.at

    async def _guard_weights(self) -> None:
        """Between syncs, every `check_every_seconds`: a policy server that lost the run's
        weights (restarted on others, rule 8) gets them loaded again. It served no call
        meanwhile: the gateway holds calls for a server behind the run."""
        every = timedelta(seconds=self._config.weight_sync.check_every_seconds)
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(lambda: self._closing, timeout=every)
            if self._closing or self._phase == TrainingPhase.SYNCING:
                continue
            path = self._state.policy_path
            if path is None:
                continue
            self._restoring = True
            try:
                found = await self._restore(path)
            except ActivityError as err:
                # A server gone for good fails the run's rollouts, and so the run; until
                # then, the next round tries again.
                workflow.logger.warning("restoring the run's weights failed: %s", err.cause)
                continue
            finally:
                self._restoring = False
            if found.restored:
                workflow.logger.warning("loaded the run's weights again on %s", found.restored)

    async def _restore(self, path: str) -> RestoreResult:
        result: RestoreResult = await workflow.execute_activity(
            RESTORE_WEIGHTS,
            SyncRequest(
                weight_sync=self._config.weight_sync,
                policy_path=path,
                policy_version=self._state.policy_version,
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

    # --- validation and bookkeeping ----------------------------------------------------

    async def _start_validation(self, step: int) -> None:
        self._phase = TrainingPhase.VALIDATING
        rows = await workflow.execute_activity(
            READ_VAL_TASKS,
            ReadValTasksRequest(dataset=self._config.dataset, validation=self._config.validation),
            result_type=list[TaskRow],
            start_to_close_timeout=START_TO_CLOSE[READ_VAL_TASKS],
            heartbeat_timeout=HEARTBEAT,
            retry_policy=RETRY_WITHOUT_LIMIT,
        )
        await self._start_groups(rows, RolloutMode.VAL, 1)
        self._phase = TrainingPhase.ROLLING_OUT

    async def _record(self, record: StepRecord) -> None:
        state = self._state
        # The trainer's own figures only in the last record the state keeps (every record
        # has them in metrics.jsonl): the state stays within its budget.
        kept = [r.model_copy(update={"trainer": {}}) for r in state.recent_steps]
        state.recent_steps = [*kept, record][-RECENT_STEPS:]
        state.unwritten_records.append(record)
        await self._flush_records()
        self._publish()

    async def _flush_records(self) -> None:
        """Write step records (and their validation results, which come later) to disk."""
        state = self._state
        while state.unwritten_records:
            await workflow.execute_activity(
                RECORD_STEP,
                RecordStepRequest(
                    run_id=self._config.run_id,
                    run_dir=self._config.run_dir,
                    record=state.unwritten_records[0],
                ),
                start_to_close_timeout=START_TO_CLOSE[RECORD_STEP],
                heartbeat_timeout=HEARTBEAT,
                retry_policy=RETRY_WITHOUT_LIMIT,
            )
            state.unwritten_records.pop(0)

    async def _reconcile(self) -> None:
        """Look up rollouts not heard from: one that ended without its report reaching us
        (terminated by hand, a report lost) is recorded from what Temporal knows of it."""
        pending = self._book.pending_rollouts()
        if not pending:
            return
        found: list[RolloutLookup] = []
        for batch in _batches(pending):
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
                self._state.counters.reconciled_rollouts += 1
                self._book.record(lookup.result)
            elif lookup.closed_as is not None:
                self._state.counters.reconciled_rollouts += 1
                self._book.record_lost(lookup.rollout_id, f"rollout {lookup.closed_as}")

    def _publish(self) -> None:
        state = self._state
        last = state.recent_steps[-1] if state.recent_steps else None
        workflow.upsert_search_attributes(
            [
                sa.RUN.value_set(self._config.run_id),
                sa.MODE.value_set("trainer"),
                sa.STATUS.value_set(self._phase.value),
                sa.STEP.value_set(state.step),
                sa.POLICY_VERSION.value_set(state.policy_version),
                *([sa.REWARD.value_set(last.reward_mean)] if last else []),
            ]
        )

    # --- signals, updates, queries -----------------------------------------------------

    @workflow.signal(name=ROLLOUT_FINISHED_SIGNAL)
    def rollout_finished(self, result: RolloutOutcome) -> None:
        """One rollout's report (rollouts of revisions before 3)."""
        self._book.record(result)

    @workflow.signal(name=ROLLOUTS_FINISHED_SIGNAL)
    def rollouts_finished(self, results: list[RolloutOutcome]) -> None:
        """Reports a rollout worker batched (rollouts of revision 3)."""
        for result in results:
            self._book.record(result)

    @workflow.signal(name=PAUSE_SIGNAL)
    def pause(self) -> None:
        self._state.paused = True

    @workflow.signal(name=RESUME_SIGNAL)
    def resume(self) -> None:
        self._state.paused = False

    @workflow.signal(name=STOP_SIGNAL)
    def stop(self, request: StopRequest | None = None) -> None:
        request = request or StopRequest()
        self._state.stop_requested = True
        self._state.stop_cancels_inflight = request.cancel_inflight
        self._state.stop_grace_seconds = request.grace_seconds

    # The update takes what the sender sent as a dict when it is no KnobUpdate, so that the
    # validator refuses it with pydantic's message (a KnobUpdate that failed to decode would
    # be refused by the SDK as a retryable ValidationError, naming no rule).
    @workflow.update(name=UPDATE_KNOBS)
    def update_knobs(self, update: KnobUpdate | dict[str, Any]) -> Knobs:
        changes = _knob_update(update).model_dump(exclude_none=True)
        self._state.knobs = self._state.knobs.model_copy(update=changes)
        return self._state.knobs

    @update_knobs.validator
    def _check_knobs(self, update: KnobUpdate | dict[str, Any]) -> None:
        knobs = _knob_update(update)
        if not knobs.model_dump(exclude_none=True):
            _refuse("the update changes no knob (learning_rate, max_inflight, max_staleness)")
        inflight = knobs.max_inflight
        if inflight is not None and inflight < self._config.group_size:
            _refuse(f"max_inflight {inflight} cannot hold one group of {self._config.group_size}")
        if self._state.stop_requested:
            _refuse("the run is stopping")

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> TrainingProgress:
        state = self._state
        phase = TrainingPhase.PAUSED if state.paused else self._phase
        return TrainingProgress(
            run_id=self._config.run_id,
            phase=phase,
            step=state.step,
            policy_version=state.policy_version,
            epoch=state.epoch,
            cursor=state.cursor,
            inflight_rollouts=self._book.inflight(),
            ready_groups=len(state.ready),
            paused=state.paused,
            knobs=state.knobs,
            counters=state.counters,
            runs=state.runs,
            history_length=workflow.info().get_current_history_length(),
            last=state.recent_steps[-1] if state.recent_steps else None,
        )

    @workflow.query(name=METRICS_QUERY)
    def metrics(self) -> list[StepRecord]:
        return list(self._state.recent_steps)


def _knob_update(update: KnobUpdate | dict[str, Any]) -> KnobUpdate:
    if isinstance(update, KnobUpdate):
        return update
    try:
        return KnobUpdate.model_validate(update)
    except ValidationError as err:
        _refuse(f"invalid knob update: {one_line(err.errors())}")


def _batches(items: list[_Item]) -> list[list[_Item]]:
    """`items` in batches of BATCH (one batch, whatever its size, in a history from before the
    "rollouts-in-batches" marker)."""
    if len(items) <= BATCH or not workflow.patched("rollouts-in-batches"):
        return [items] if items else []
    return [items[i : i + BATCH] for i in range(0, len(items), BATCH)]


def _refuse(why: str) -> NoReturn:
    raise ApplicationError(why, type=KNOB_UPDATE_ERROR, non_retryable=True)
