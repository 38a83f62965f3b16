"""TrainingWorkflow's state machine on Temporal's time-skipping server, with stub activities
and stub rollouts (tests/workflow/training_stubs.py): sync and async modes, staleness, failed
members and min_group_size, pause/resume/stop, the knob update, continue-as-new."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from darl.workflows.contracts import HttpAgentSpec, RolloutMode
from darl.workflows.training_config import (
    BackendSpec,
    DatasetSpec,
    RolloutSettings,
    TrainingConfig,
    WeightSyncSettings,
    training_workflow_id,
)
from darl.workflows.training_groups import GroupBook
from darl.workflows.training_messages import (
    KnobUpdate,
    StopRequest,
    TrainingPhase,
    TrainingProgress,
    TrainingSummary,
)
from darl.workflows.training_workflow import TrainingWorkflow
from tests.accounting import assert_accounted
from tests.workflow.training_stubs import StubRolloutWorkflow, StubTrainerActivities

TIMEOUT = 120


@dataclass
class Harness:
    env: WorkflowEnvironment
    stubs: StubTrainerActivities
    trainer_queue: str
    rollout_queue: str

    def config(self, **overrides: object) -> TrainingConfig:
        values: dict = {
            "run_id": f"t-{uuid.uuid4().hex[:8]}",
            "dataset": DatasetSpec(path="stub"),
            "rollout": RolloutSettings(
                agent=HttpAgentSpec(url="http://127.0.0.1:9/stub"), task_queue=self.rollout_queue
            ),
            "backend": BackendSpec(model_dir="stub"),
            "weight_sync": WeightSyncSettings(
                gateway_admin_url="http://127.0.0.1:9", policy_servers=["http://127.0.0.1:9"]
            ),
            "group_size": 4,
            "batch_size": 2,
        }
        values.update(overrides)
        return TrainingConfig(**values)

    async def start(self, config: TrainingConfig) -> WorkflowHandle:
        return await self.env.client.start_workflow(
            TrainingWorkflow.run,
            config,
            id=training_workflow_id(config.run_id),
            task_queue=self.trainer_queue,
        )

    async def status(self, handle: WorkflowHandle) -> TrainingProgress:
        return await handle.query(TrainingWorkflow.status)


@asynccontextmanager
async def harness(
    env: WorkflowEnvironment,
    tasks: list[dict],
    stubs: type[StubTrainerActivities] = StubTrainerActivities,
    rollout_workflow: type = StubRolloutWorkflow,
) -> AsyncIterator[Harness]:
    """Workers for a TrainingWorkflow on `env`: the trainer's activities as `stubs` over
    `tasks`, and `rollout_workflow` standing in for the RolloutWorkflow."""
    trainer_queue, rollout_queue = f"trainer-{uuid.uuid4().hex}", f"rollouts-{uuid.uuid4().hex}"
    activities = stubs(env.client, tasks)
    async with (
        Worker(
            env.client,
            task_queue=trainer_queue,
            workflows=[TrainingWorkflow],
            activities=activities.activities(),
        ),
        Worker(env.client, task_queue=rollout_queue, workflows=[rollout_workflow]),
    ):
        yield Harness(env, activities, trainer_queue, rollout_queue)


def tasks(count: int, **fields: object) -> list[dict]:
    return [{"id": i, **fields} for i in range(count)]


async def result(handle: WorkflowHandle) -> TrainingSummary:
    return await asyncio.wait_for(handle.result(), TIMEOUT)


async def test_sync_mode_trains_on_policy_steps_in_order(time_skipping_env: WorkflowEnvironment):
    async with harness(time_skipping_env, tasks(20)) as h:
        config = h.config(total_steps=3)
        summary = await result(await h.start(config))
    assert summary.steps == 3 and summary.policy_version == 3
    assert [s.step for s in h.stubs.steps] == [1, 2, 3]
    assert h.stubs.syncs == [0, 1, 2, 3]  # the initial policy, then one sync per step
    for request in h.stubs.steps:
        assert len(request.groups) == 2
        assert all(len(g.members) == 4 for g in request.groups)
    # On-policy: every rollout of step s was started at policy version s - 1.
    versions = {s.group_id: s.policy_version for s in h.stubs.started}
    for request in h.stubs.steps:
        assert {versions[g.group_id] for g in request.groups} == {request.step - 1}
    assert sorted(h.stubs.records) == [1, 2, 3]
    record = h.stubs.records[3].record
    assert record.reward_mean == pytest.approx(0.5) and record.paused_seconds == 0.05
    assert summary.counters.rollouts_trained == 24
    assert_accounted(summary.counters)


async def test_failed_members_keep_a_group_down_to_min_group_size(
    time_skipping_env: WorkflowEnvironment,
):
    # Tasks alternate: one member fails (group kept at 3 >= 3), or two fail (dropped).
    rows = [{"id": i, "fail_members": [0] if i % 2 == 0 else [0, 1]} for i in range(8)]
    async with harness(time_skipping_env, rows) as h:
        config = h.config(min_group_size=3, batch_size=2, epochs=1)
        summary = await result(await h.start(config))
    assert summary.reason == "dataset exhausted"
    trained = [g for s in h.stubs.steps for g in s.groups]
    assert len(trained) == 4 and all(len(g.members) == 3 for g in trained)
    assert all(g.group_id.endswith(("t0", "t2", "t4", "t6")) for g in trained)
    c = summary.counters
    assert c.groups_dropped_small == 4 and c.rollouts_failed == 4 + 8
    assert c.rollouts_in_dropped_groups == 8
    assert_accounted(summary.counters)


async def test_equal_reward_groups_are_dropped_or_trained_by_config(
    time_skipping_env: WorkflowEnvironment,
):
    rows = [{"id": i, "rewards": [1.0] if i % 2 else [0.0, 1.0]} for i in range(8)]
    async with harness(time_skipping_env, rows) as h:
        dropped = await result(await h.start(h.config(epochs=1)))
        kept = await result(await h.start(h.config(epochs=1, equal_reward_groups="train")))
    assert dropped.counters.groups_dropped_equal == 4 and dropped.counters.groups_trained == 4
    assert kept.counters.groups_dropped_equal == 0 and kept.counters.groups_trained == 8
    assert_accounted(dropped.counters)
    assert_accounted(kept.counters)


async def test_async_mode_keeps_rollouts_going_and_drops_stale_groups(
    time_skipping_env: WorkflowEnvironment,
):
    # Every fourth task is slow: its group finishes several policy versions later.
    rows = [{"id": i, "duration": 300 if i % 4 == 3 else 5} for i in range(64)]
    async with harness(time_skipping_env, rows) as h:
        config = h.config(mode="async", total_steps=6, knobs={"max_inflight": 16})
        summary = await result(await h.start(config))
    assert summary.steps == 6
    c = summary.counters
    assert c.groups_dropped_stale > 0, c
    # Rollouts ran across syncs: groups trained at step s started at versions up to s-1-1.
    versions = {s.group_id: s.policy_version for s in h.stubs.started}
    lags = [s.step - 1 - versions[g.group_id] for s in h.stubs.steps for g in s.groups]
    assert max(lags) <= 1 and min(lags) == 0
    assert any(lag == 1 for lag in lags), "async mode never trained an off-policy group"
    # In-flight rollouts at the end were cancelled and reported as such.
    assert c.rollouts_cancelled > 0 and len(h.stubs.cancelled) >= c.rollouts_cancelled
    assert_accounted(summary.counters)


async def test_pause_holds_new_rollouts_and_resume_and_stop_follow(
    time_skipping_env: WorkflowEnvironment,
):
    async with harness(time_skipping_env, tasks(200)) as h:
        handle = await h.start(h.config())
        await h.env.sleep(30)
        await handle.signal(TrainingWorkflow.pause)
        await h.env.sleep(60)  # rollouts out when paused finish
        paused = await h.status(handle)
        started = len(h.stubs.started)
        await h.env.sleep(300)
        assert len(h.stubs.started) == started
        still = await h.status(handle)
        assert still.step == paused.step and still.paused and still.phase == "paused"
        await handle.signal(TrainingWorkflow.resume)
        await h.env.sleep(60)
        assert (await h.status(handle)).step > still.step
        assert len(h.stubs.started) > started
        await handle.signal(TrainingWorkflow.stop, StopRequest(cancel_inflight=True))
        summary = await result(handle)
        assert (await h.status(handle)).phase == "finished"
    assert summary.stopped and summary.reason == "stopped by request"
    assert_accounted(summary.counters)


async def test_stop_that_finishes_waits_for_rollouts_within_its_grace(
    time_skipping_env: WorkflowEnvironment,
):
    """`darl stop --finish`: rollouts out finish (within the request's grace) instead of
    being cancelled, whatever the config's stop_grace_seconds (0 by default)."""
    async with harness(time_skipping_env, tasks(40, duration=200)) as h:
        waited = await h.start(h.config())
        cut = await h.start(h.config())
        await h.env.sleep(30)
        assert (await h.status(waited)).inflight_rollouts > 0
        await waited.signal(
            TrainingWorkflow.stop, StopRequest(cancel_inflight=False, grace_seconds=600)
        )
        await cut.signal(
            TrainingWorkflow.stop, StopRequest(cancel_inflight=False, grace_seconds=60)
        )
        finished, cancelled = await result(waited), await result(cut)
    assert finished.stopped and finished.inflight_at_end == 0
    assert finished.counters.rollouts_cancelled == 0 and finished.counters.rollouts_left_over > 0
    # A grace shorter than the rollouts: those still out are cancelled after it.
    assert cancelled.counters.rollouts_cancelled > 0
    assert finished.seconds is not None and finished.seconds >= 200
    assert_accounted(finished.counters)
    assert_accounted(cancelled.counters)


async def test_a_cancelling_stop_cuts_a_finishing_stops_wait_short(
    time_skipping_env: WorkflowEnvironment,
):
    """`darl stop --finish`, then a plain `darl stop`: the second stop cancels what is out
    at once rather than after the first one's grace."""
    async with harness(time_skipping_env, tasks(40, duration=200)) as h:
        handle = await h.start(h.config())
        await h.env.sleep(30)
        assert (await h.status(handle)).inflight_rollouts > 0
        await handle.signal(
            TrainingWorkflow.stop, StopRequest(cancel_inflight=False, grace_seconds=600)
        )
        await h.env.sleep(10)
        await handle.signal(TrainingWorkflow.stop, StopRequest(cancel_inflight=True))
        summary = await result(handle)
    assert summary.stopped and summary.counters.rollouts_cancelled > 0
    # Cancelled before the rollouts' 200 s were up, let alone the 600 s grace.
    assert summary.seconds is not None and summary.seconds < 200
    assert_accounted(summary.counters)


async def test_knob_update_is_validated_and_reaches_train_step(
    time_skipping_env: WorkflowEnvironment,
):
    async with harness(time_skipping_env, tasks(200)) as h:
        handle = await h.start(h.config(total_steps=4))
        for update, why in (
            (KnobUpdate(max_inflight=2), "cannot hold one group"),
            (KnobUpdate(), "changes no knob"),
            # What the temporal CLI sends as --input: pydantic's rule, naming the field.
            ({"max_inflight": 0}, "max_inflight: Input should be greater than or equal to 1"),
            ({"max_inflght": 4}, "max_inflght: Extra inputs are not permitted"),
        ):
            with pytest.raises(WorkflowUpdateFailedError) as failed:
                await handle.execute_update(TrainingWorkflow.update_knobs, update)
            cause = failed.value.cause
            assert isinstance(cause, ApplicationError) and why in cause.message, cause
            # A refused update is refused again: it says so (`retryable: false`).
            assert cause.non_retryable and cause.type == "KnobUpdateError"
        knobs = await handle.execute_update(
            TrainingWorkflow.update_knobs, KnobUpdate(learning_rate=0.005)
        )
        assert knobs.learning_rate == 0.005 and knobs.max_inflight == 64
        await result(handle)
    assert h.stubs.steps[-1].learning_rate == 0.005


async def test_validation_runs_every_k_steps_and_joins_the_step_record(
    time_skipping_env: WorkflowEnvironment,
):
    async with harness(time_skipping_env, tasks(40)) as h:
        config = h.config(total_steps=4, validation={"every_steps": 2, "tasks": 3})
        summary = await result(await h.start(config))
    val = [s for s in h.stubs.started if s.mode == RolloutMode.VAL]
    assert len(val) == 6 and {s.policy_version for s in val} == {2, 4}
    record = h.stubs.records[2].record
    assert record.val_reward_mean == 0.0 and record.val_success_rate == 0.0  # member 0 gets 0
    assert h.stubs.records[1].record.val_reward_mean is None
    assert_accounted(summary.counters)


# On the real (dev) server, in real time: Temporal's time-skipping test server refuses a
# workflow task completion that cancels a timer which fired while the task was with the worker
# ("invalid history builder state for action", temporalio/sdk-java#2606) and never hands the
# task out again (sdk-java#3088), so the chain stalled there now and then. The real server
# takes that cancel, and TrainingWorkflow makes it at every step (its silence timer) and at
# every continue-as-new (the weight guard's timer). Durations are scaled to tenths of seconds.
async def test_continue_as_new_loses_no_rollout_across_runs(dev_env: WorkflowEnvironment):
    """1,000+ rollouts through many runs of the chain; reports arrive at any moment,
    including while a run hands over to the next. Every rollout is accounted for."""
    rows = [{"id": i, "duration": 1 + (i * 7) % 13, "time_scale": 0.02} for i in range(300)]
    async with harness(dev_env, rows) as h:
        config = h.config(
            mode="async",
            group_size=4,
            batch_size=4,
            total_steps=70,
            knobs={"max_inflight": 32, "max_staleness": 2},
            continue_as_new_after_events=400,
            epochs=3,
        )
        handle = await h.start(config)
        summary = await asyncio.wait_for(handle.result(), 600)
        status = await h.status(handle)
    assert summary.steps == 70
    assert status.runs > 3, "the run never continued as new"
    assert [s.step for s in h.stubs.steps] == list(range(1, 71))
    trained = [m.rollout_id for s in h.stubs.steps for g in s.groups for m in g.members]
    assert len(trained) == len(set(trained)) >= 1000
    c = summary.counters
    assert c.rollouts_started == len(h.stubs.started) >= 1000
    assert c.duplicate_reports == 0 and c.unknown_reports == 0
    assert_accounted(summary.counters)
    assert status.history_length < 1000


async def test_once_initialized_a_run_says_it_is_rolling_out(
    time_skipping_env: WorkflowEnvironment,
):
    """Once the run is initialized its rollouts go, and its status says so before its first
    step (it had said "starting" until then, and a run continued as new, which skips the
    initialization, said "starting" until its own first step)."""
    rows = [{"id": i, "duration": 3600} for i in range(8)]  # no report while the test looks
    async with harness(time_skipping_env, rows) as h:
        handle = await h.start(h.config(group_size=4, batch_size=2, total_steps=1))
        async with asyncio.timeout(TIMEOUT):
            while not h.stubs.started:
                await asyncio.sleep(0.05)
        status = await h.status(handle)
        await handle.terminate("the test has seen what it needed")
    assert status.phase == TrainingPhase.ROLLING_OUT, status.phase


async def test_rollouts_whose_reports_are_lost_are_looked_up(
    time_skipping_env: WorkflowEnvironment,
):
    """Every other task's reports never arrive; the trainer finds their results in Temporal
    after `reconcile_after_seconds` of silence, and one terminated by hand counts as failed."""
    rows = [{"id": i, "silent": i % 2 == 1, "duration": 5 + 45 * (i % 2)} for i in range(8)]
    async with harness(time_skipping_env, rows) as h:
        config = h.config(epochs=1, reconcile_after_seconds=100)
        handle = await h.start(config)
        await h.env.sleep(20)
        silent = next(s for s in h.stubs.started if s.task["silent"])
        await h.env.client.get_workflow_handle(f"rollout/{silent.rollout_id}").terminate()
        summary = await result(handle)
    c = summary.counters
    assert h.stubs.lookups > 0
    assert c.reconciled_rollouts == 16 and c.rollouts_failed == 1
    assert c.groups_trained + c.groups_dropped_small == 8
    assert_accounted(summary.counters)


def test_group_book_accounts_a_report_for_an_unknown_rollout():
    config = TrainingConfig(
        run_id="r",
        dataset=DatasetSpec(path="x"),
        rollout=RolloutSettings(agent=HttpAgentSpec(url="http://x")),
        backend=BackendSpec(model_dir="m"),
        weight_sync=WeightSyncSettings(gateway_admin_url="http://g", policy_servers=["http://p"]),
    )
    from darl.workflows.contracts import RolloutResult
    from darl.workflows.rollout_status import RolloutStatus
    from darl.workflows.training_state import TrainingState

    book = GroupBook(config, TrainingState())
    book.record(
        RolloutResult(
            run_id="r",
            rollout_id="nobody.0",
            group_id="nobody",
            mode=RolloutMode.TRAIN,
            status=RolloutStatus.SUCCEEDED,
            reward=1.0,
            attempts=1,
        ).outcome()
    )
    assert book.state.counters.unknown_reports == 1
