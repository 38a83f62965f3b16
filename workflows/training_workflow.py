"""TrainingWorkflow: one RL training run, durable from the first rollout to the last step.

Reads as the story of a run: put the initial policy on the servers (`training_step`), keep
rollouts going (the feeder, `training_feeding`; the brancher, `training_branching`; both
start them through `training_rollout_starts`) and the servers' weights current (the weight
guard, `training_weights`), and whenever a batch of complete groups is ready, train a step
(`training_step`), until the run finishes or continues as new (`training_ending`). What to do
next is `training_next_action`; what the loops share, `training_run`. Rollouts report back by
signal on the run's workflow id, so a report reaches whichever run of a continue-as-new chain
is current (rule 6).

A history replays under later code through `workflow.patched` markers, each naming a change
of the command sequence (a rollout's own sequence is its `RolloutSpec.revision` instead, the
table in workflows/contracts/revisions.py):

    "a-cancelling-stop-cuts-the-grace"   a stop that cancels rollouts ends the wait of an
                                         earlier stop's grace (`training_ending`)
    "rollouts-in-batches"                more than BATCH rollouts are started, or looked up,
                                         by several activities of BATCH each
                                         (`training_activity_options.in_batches`)
    "branch-groups-independently"        each branching group's branch point and branches
                                         on their own (`training_branching`), not one group
                                         at a time
"""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from darl.workflows.contracts import RolloutOutcome
    from darl.workflows.errors import one_line
    from darl.workflows.names import (
        METRICS_QUERY,
        PAUSE_SIGNAL,
        RESUME_SIGNAL,
        ROLLOUT_FINISHED_SIGNAL,
        ROLLOUTS_FINISHED_SIGNAL,
        STATUS_QUERY,
        STOP_SIGNAL,
        TRAINING_WORKFLOW,
        UPDATE_KNOBS,
    )
    from darl.workflows.training_branching import branch
    from darl.workflows.training_config import TrainingConfig
    from darl.workflows.training_ending import continue_as_new, finish
    from darl.workflows.training_feeding import feed
    from darl.workflows.training_messages import (
        KnobUpdate,
        StopRequest,
        TrainingPhase,
        TrainingProgress,
        TrainingSummary,
    )
    from darl.workflows.training_next_action import NextAction, wait_for_work
    from darl.workflows.training_run import TrainingRun
    from darl.workflows.training_state import Knobs, StepRecord
    from darl.workflows.training_step import initialize, train_step
    from darl.workflows.training_weights import guard_weights


# A knob update refused (by its fields' rules or the run's): sending it again cannot help.
KNOB_UPDATE_ERROR = "KnobUpdateError"


# A ValidationError is input no retry can fix (a TrainingConfig the temporal CLI sent that
# does not validate): the workflow fails at once with pydantic's message (rule 9).
@workflow.defn(name=TRAINING_WORKFLOW, failure_exception_types=[ValidationError])
class TrainingWorkflow:
    @workflow.init
    def __init__(self, config: TrainingConfig) -> None:
        self._run = TrainingRun(config)

    @workflow.run
    async def run(self, config: TrainingConfig) -> TrainingSummary:
        run = self._run
        if not run.state.started_at:
            run.state.started_at = workflow.time()
        run.publish()
        if not run.state.initialized:
            await initialize(run)
        # The loops beside the steps, until the run ends or continues as new: the feeder keeps
        # rollouts going, the brancher starts seeded groups' branches, the weight guard puts
        # the run's weights back on a server that lost them.
        run.feeder = asyncio.create_task(feed(run))
        if run.config.groups.mode == "branch":
            run.brancher = asyncio.create_task(branch(run))
        run.weight_guard = asyncio.create_task(guard_weights(run))
        while True:
            await run.flush_records()
            action, reason = await wait_for_work(run)
            if action is NextAction.TRAIN:
                await train_step(run)
            elif action is NextAction.CONTINUE_AS_NEW:
                await continue_as_new(run)
            elif action is NextAction.FEEDING_FAILED:
                run.raise_feeding_failure()
            elif action is NextAction.FAIL:
                await finish(run, NextAction.FAIL.value)
                raise ApplicationError(run.book.failing_message(), non_retryable=True)
            elif action is NextAction.FINISH:
                return await finish(run, reason)

    # --- signals, updates, queries -----------------------------------------------------

    @workflow.signal(name=ROLLOUT_FINISHED_SIGNAL)
    def rollout_finished(self, result: RolloutOutcome) -> None:
        """One rollout's report (rollouts of revisions 1 and 2)."""
        self._run.book.record(result)

    @workflow.signal(name=ROLLOUTS_FINISHED_SIGNAL)
    def rollouts_finished(self, results: list[RolloutOutcome]) -> None:
        """Reports a rollout worker batched (rollouts of revision 3)."""
        for result in results:
            self._run.book.record(result)

    @workflow.signal(name=PAUSE_SIGNAL)
    def pause(self) -> None:
        self._run.state.paused = True

    @workflow.signal(name=RESUME_SIGNAL)
    def resume(self) -> None:
        self._run.state.paused = False

    @workflow.signal(name=STOP_SIGNAL)
    def stop(self, request: StopRequest | None = None) -> None:
        request = request or StopRequest()
        state = self._run.state
        state.stop_requested = True
        state.stop_cancels_inflight = request.cancel_inflight
        state.stop_grace_seconds = request.grace_seconds

    # The update takes what the sender sent as a dict when it is no KnobUpdate, so that the
    # validator refuses it with pydantic's message (a KnobUpdate that failed to decode would
    # be refused by the SDK as a retryable ValidationError, naming no rule).
    @workflow.update(name=UPDATE_KNOBS)
    def update_knobs(self, update: KnobUpdate | dict[str, Any]) -> Knobs:
        state = self._run.state
        changes = _knob_update(update).model_dump(exclude_none=True)
        state.knobs = state.knobs.model_copy(update=changes)
        return state.knobs

    @update_knobs.validator
    def _check_knobs(self, update: KnobUpdate | dict[str, Any]) -> None:
        knobs = _knob_update(update)
        if not knobs.model_dump(exclude_none=True):
            _refuse("the update changes no knob (learning_rate, max_inflight, max_staleness)")
        group_size = self._run.config.group_size
        inflight = knobs.max_inflight
        if inflight is not None and inflight < group_size:
            _refuse(f"max_inflight {inflight} cannot hold one group of {group_size}")
        if self._run.state.stop_requested:
            _refuse("the run is stopping")

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> TrainingProgress:
        run, state = self._run, self._run.state
        phase = TrainingPhase.PAUSED if state.paused else run.phase
        return TrainingProgress(
            run_id=run.config.run_id,
            phase=phase,
            step=state.step,
            policy_version=state.policy_version,
            epoch=state.epoch,
            cursor=state.cursor,
            inflight_rollouts=run.book.inflight(),
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
        return list(self._run.state.recent_steps)


def _knob_update(update: KnobUpdate | dict[str, Any]) -> KnobUpdate:
    if isinstance(update, KnobUpdate):
        return update
    try:
        return KnobUpdate.model_validate(update)
    except ValidationError as err:
        _refuse(f"invalid knob update: {one_line(err.errors())}")


def _refuse(why: str) -> NoReturn:
    raise ApplicationError(why, type=KNOB_UPDATE_ERROR, non_retryable=True)
