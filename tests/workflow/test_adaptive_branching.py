"""TrainingWorkflow with adaptive seeds (`groups.seed: adaptive`) against the time-skipping
server, with stub activities and a stub rollout whose reward is set per epoch and member: a
task's first group runs whole; each later one branches, all its members, from the run's
latest recorded success of the task when its recent pass rate was under 0.5 and from its
latest failure otherwise; the prefix is masked in every member; and the record crosses
continue-as-new."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta

import pytest
from temporalio import activity, workflow
from temporalio.testing import WorkflowEnvironment

from darl.workflows.names import ROLLOUT_WORKFLOW
from tests.accounting import assert_accounted
from tests.workflow.test_branching_training import (
    SURPRISING_CALL,
    BranchingTrainerActivities,
    StubBranchingRollout,
)
from tests.workflow.test_training_workflow import TIMEOUT, Harness, harness

with workflow.unsafe.imports_passed_through():
    from darl.activities.trainer_rollouts import rollout_specs
    from darl.workflows.contracts import PrefixSpec, RolloutResult, RolloutSpec
    from darl.workflows.rollout_status import RolloutStatus
    from darl.workflows.training_config import GroupsSpec
    from darl.workflows.training_messages import (
        ReadTasksRequest,
        StartRolloutsRequest,
        TaskBatch,
        TrainingSummary,
    )
    from darl.workflows.training_state import TaskRow
    from darl.workflows.training_workflow import TrainingWorkflow

GROUP = 4
WHOLE_CALLS = 4
# Rewards by task, then epoch, then member. Task 0 is hard at first (1 of 4 pass), task 1
# easy (3 of 4); each group then passes the other way round.
REWARDS = {
    0: [[0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 1.0]],
    1: [[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]],
}


@workflow.defn(name=ROLLOUT_WORKFLOW)
class StubOutcomeRollout:
    """Reports `rewards[epoch][member]` after 1 + member seconds (so members report in
    order): WHOLE_CALLS calls when whole, a branch its prefix and two calls of its own."""

    @workflow.run
    async def run(self, spec: RolloutSpec) -> RolloutResult:
        group, member = spec.rollout_id.rsplit(".", 1)
        epoch = int(group.rsplit(".", 2)[1].removeprefix("e"))
        await workflow.sleep(timedelta(seconds=1 + int(member)))
        prefix_calls = spec.prefix.calls if spec.prefix is not None else 0
        reward = spec.task["rewards"][epoch][int(member)]
        return await StubBranchingRollout._report(
            spec, RolloutStatus.SUCCEEDED, reward, stub_calls(spec.prefix), prefix_calls, None
        )


def stub_calls(prefix: PrefixSpec | None) -> int:
    """The calls StubOutcomeRollout reports: WHOLE_CALLS when whole, a branch its prefix
    and two calls of its own."""
    return WHOLE_CALLS if prefix is None else prefix.calls + 2


@dataclass
class IndexedRowActivities(BranchingTrainerActivities):
    """The branching stubs with rows by reference, as the real `read_tasks` reads them: a
    task is known by its index in the dataset."""

    @activity.defn
    async def read_tasks(self, request: ReadTasksRequest) -> TaskBatch:
        epoch, cursor, rows = request.epoch, request.cursor, []
        while len(rows) < request.count and epoch < request.epochs:
            digest = hashlib.sha256(repr(self.tasks[cursor]).encode()).hexdigest()
            rows.append(TaskRow(epoch=epoch, position=cursor, index=cursor, digest=digest))
            cursor += 1
            if cursor == len(self.tasks):
                epoch, cursor = epoch + 1, 0
        return TaskBatch(rows=rows, epoch=epoch, cursor=cursor, exhausted=epoch >= request.epochs)

    @activity.defn
    async def start_rollouts(self, request: StartRolloutsRequest) -> None:
        for spec in rollout_specs(request, lambda start: self.tasks[start.row.index]):
            await self.client.start_workflow(
                ROLLOUT_WORKFLOW,
                spec,
                id=f"rollout/{spec.rollout_id}",
                task_queue=request.task_queue,
            )
            self.started.append(spec)


@asynccontextmanager
async def adaptive_harness(env: WorkflowEnvironment) -> AsyncIterator[Harness]:
    rows = [{"id": task, "rewards": REWARDS[task]} for task in sorted(REWARDS)]
    async with harness(env, rows, IndexedRowActivities, StubOutcomeRollout) as h:
        yield h


async def train(h: Harness, branch_at: str = "uniform", **overrides: object) -> TrainingSummary:
    config = h.config(
        group_size=GROUP,
        batch_size=2,
        epochs=3,
        groups=GroupsSpec(mode="branch", seed="adaptive", branch_at=branch_at),
        **overrides,
    )
    handle = await h.start(config)
    summary = await asyncio.wait_for(handle.result(), TIMEOUT)
    if overrides:
        status = await handle.query(TrainingWorkflow.status)
        assert status.runs > 1, "the run never continued as new"
    return summary


def expected_seeds(run_id: str) -> dict[str, str]:
    """The rollout each later group must branch from, worked out from REWARDS by hand.
    Task 0: epoch 0 passes 1 of 4 (hard: its success, member 2); with epoch 1's branches
    (3 of 4) its last 8 pass 4 (balanced: its latest failure, epoch 1's member 2). Task 1:
    epoch 0 passes 3 of 4 (easy: its failure, member 2); then 4 of 8 (its latest failure,
    epoch 1's member 3, the last to report)."""
    return {
        f"{run_id}.e1.t0": f"{run_id}.e0.t0.2",
        f"{run_id}.e2.t0": f"{run_id}.e1.t0.2",
        f"{run_id}.e1.t1": f"{run_id}.e0.t1.2",
        f"{run_id}.e2.t1": f"{run_id}.e1.t1.3",
    }


def check_the_seeds_follow_outcomes(
    h: Harness, summary: TrainingSummary, branch_at: str = "uniform"
) -> None:
    run_id = h.stubs.started[0].run_id
    by_group: dict[str, list[RolloutSpec]] = {}
    for spec in h.stubs.started:
        by_group.setdefault(spec.group_id, []).append(spec)
    assert len(by_group) == 6 and all(len(specs) == GROUP for specs in by_group.values())
    seeds = expected_seeds(run_id)

    def calls_of(rollout_id: str) -> int:
        (own_prefix,) = {s.prefix for s in by_group[rollout_id.rsplit(".", 1)[0]]}
        return stub_calls(own_prefix)

    for group_id, specs in by_group.items():
        prefixes = {s.prefix for s in specs}
        if ".e0." in group_id:
            assert prefixes == {None}, "a task with no outcome yet makes an ordinary group"
            continue
        (prefix,) = prefixes  # every member branches from the same prefix
        assert prefix is not None and prefix.rollout_id == seeds[group_id], group_id
        # A seed of epoch 0 ran whole; one of epoch 1 is itself a branch, with more calls.
        assert prefix.attempt == 1 and 1 <= prefix.calls < calls_of(prefix.rollout_id)
        if branch_at == "surprisal":
            assert prefix.calls == SURPRISING_CALL
    masked = {
        g.group_id: [m.masked_calls for m in g.members] for s in h.stubs.steps for g in s.groups
    }
    for group_id, specs in by_group.items():
        calls = specs[0].prefix.calls if specs[0].prefix is not None else 0
        assert masked[group_id] == [calls] * GROUP, group_id
    c = summary.counters
    assert summary.steps == 3 and c.groups_branched == 4 and c.seeds_not_branched == 0
    if branch_at == "surprisal":
        # The store is asked of the seed each group branches from, by its own calls.
        asked = {(a.rollout_id, a.calls) for a in h.stubs.asked}
        assert {seed for seed, _ in asked} == set(expected_seeds(run_id).values())
    else:
        assert h.stubs.asked == []  # uniform asks no activity
    assert_accounted(c)


@pytest.mark.parametrize("branch_at", ["uniform", "surprisal"])
async def test_a_later_group_branches_from_a_success_or_a_failure_by_pass_rate(
    time_skipping_env: WorkflowEnvironment, branch_at: str
):
    async with adaptive_harness(time_skipping_env) as h:
        summary = await train(h, branch_at)
    check_the_seeds_follow_outcomes(h, summary, branch_at)


async def test_the_record_of_outcomes_crosses_continue_as_new(
    time_skipping_env: WorkflowEnvironment,
):
    async with adaptive_harness(time_skipping_env) as h:
        summary = await train(h, continue_as_new_after_events=100)
    check_the_seeds_follow_outcomes(h, summary)
