"""TrainingWorkflow with branching groups (`groups.mode: branch`) against real Temporal servers,
with stub activities and a stub rollout that acts a branch out: a group starts its seed, then
its branches from the seed's prefix; each member's masked calls reach train_step; a seed
that fails makes an ordinary group; the surprisal rule asks its activity; and a chain of
continue-as-new loses no group waiting for its branches."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from temporalio import activity, workflow
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from darl.workflows.names import ROLLOUT_FINISHED_SIGNAL, ROLLOUT_WORKFLOW
from tests.accounting import assert_accounted
from tests.workflow.test_training_workflow import TIMEOUT, Harness, harness, tasks
from tests.workflow.training_stubs import StubTrainerActivities

with workflow.unsafe.imports_passed_through():
    from darl.workflows.contracts import RolloutResult, RolloutSpec
    from darl.workflows.rollout_status import RolloutStatus
    from darl.workflows.training_config import (
        GroupsSpec,
        TrainingConfig,
    )
    from darl.workflows.training_messages import (
        BranchPoint,
        BranchPointRequest,
        TrainingSummary,
    )
    from darl.workflows.training_workflow import TrainingWorkflow

SURPRISING_CALL = 2


@workflow.defn(name=ROLLOUT_WORKFLOW)
class StubBranchingRollout:
    """A seed makes `seed_calls` calls; a branch replays its prefix and makes two calls of its
    own, or leaves the prefix at once when its member index is in `broken_members`. Rewards
    by member index; `fail_members` fail; `duration` (times `time_scale`) seconds each."""

    @workflow.run
    async def run(self, spec: RolloutSpec) -> RolloutResult:
        member = int(spec.rollout_id.rsplit(".", 1)[1])
        task = spec.task
        seconds = float(task.get("duration", 5)) * float(task.get("time_scale", 1))
        try:
            await workflow.sleep(timedelta(seconds=seconds))
        except asyncio.CancelledError:
            await self._report(spec, RolloutStatus.CANCELLED, None, 0, 0, None)
            raise
        calls, prefix_calls, diverged_at = int(task.get("seed_calls", 4)), 0, None
        if spec.prefix is not None:
            prefix_calls = spec.prefix.calls
            if member in task.get("broken_members", []):
                prefix_calls, diverged_at = 0, 0
            calls = prefix_calls + 2
        failed = member in task.get("fail_members", [])
        rewards = task.get("rewards", [0.0, 1.0])
        status = RolloutStatus.FAILED_AGENT if failed else RolloutStatus.SUCCEEDED
        reward = None if failed else rewards[member % len(rewards)]
        return await self._report(spec, status, reward, calls, prefix_calls, diverged_at)

    @staticmethod
    async def _report(
        spec: RolloutSpec,
        status: RolloutStatus,
        reward: float | None,
        calls: int,
        prefix_calls: int,
        diverged_at: int | None,
    ) -> RolloutResult:
        """As the real rollout reports (also when cancelled), but its whole result, as
        releases before outcomes did: the trainer reads it as its outcome."""
        result = RolloutResult(
            run_id=spec.run_id,
            rollout_id=spec.rollout_id,
            group_id=spec.group_id,
            mode=spec.mode,
            status=status,
            reward=reward,
            attempts=1,
            calls=calls,
            completion_tokens=3,
            call_ids=[f"{spec.rollout_id}-c{i}" for i in range(calls)],
            policy_versions=[spec.policy_version],
            prefix_calls=prefix_calls,
            prefix_diverged_at=diverged_at,
        )
        if spec.report_to:
            await workflow.get_external_workflow_handle(spec.report_to).signal(
                ROLLOUT_FINISHED_SIGNAL, result
            )
        return result


@dataclass
class BranchingTrainerActivities(StubTrainerActivities):
    """The trainer stubs plus `choose_branch_point`, which finds call 2 the most surprising."""

    asked: list[BranchPointRequest] = field(default_factory=list)

    def activities(self) -> list:
        return [*super().activities(), self.choose_branch_point]

    @activity.defn
    async def choose_branch_point(self, request: BranchPointRequest) -> BranchPoint:
        self.asked.append(request)
        figures = [1.0 if i == SURPRISING_CALL else 0.1 for i in range(request.calls)]
        return BranchPoint(at=GroupsSpec.highest_surprisal(figures), surprisal=figures)


@asynccontextmanager
async def branching_harness(env: WorkflowEnvironment, rows: list[dict]) -> AsyncIterator[Harness]:
    async with harness(env, rows, BranchingTrainerActivities, StubBranchingRollout) as h:
        yield h


def branching(h: Harness, **overrides: object) -> TrainingConfig:
    """The harness's config with branching groups."""
    return h.config(**{"groups": GroupsSpec(mode="branch"), **overrides})


async def run(
    h: Harness, config: TrainingConfig, seconds: float = TIMEOUT
) -> tuple[WorkflowHandle, TrainingSummary]:
    handle = await h.start(config)
    return handle, await asyncio.wait_for(handle.result(), seconds)


def started(h: Harness) -> dict[str, RolloutSpec]:
    return {s.rollout_id: s for s in h.stubs.started}


async def test_a_group_starts_its_seed_then_branches_from_its_prefix(
    time_skipping_env: WorkflowEnvironment,
):
    async with branching_harness(time_skipping_env, tasks(10, seed_calls=5)) as h:
        _, summary = await run(h, branching(h, total_steps=2))
    specs = started(h)
    order = [s.rollout_id for s in h.stubs.started]
    assert summary.steps == 2
    for request in h.stubs.steps:
        for group in request.groups:
            seed = specs[f"{group.group_id}.0"]
            assert seed.prefix is None
            assert order.index(seed.rollout_id) < order.index(f"{group.group_id}.1")
            branches = [specs[f"{group.group_id}.{k}"] for k in range(1, 4)]
            prefixes = {b.prefix for b in branches}
            assert len(prefixes) == 1
            (prefix,) = prefixes
            assert prefix is not None and prefix.rollout_id == seed.rollout_id
            assert prefix.attempt == 1 and 1 <= prefix.calls <= 4
            # The prefix is masked in every member, the seed's own included.
            assert [m.masked_calls for m in group.members] == [prefix.calls] * 4
    c = summary.counters
    assert c.groups_branched >= 4 and c.seeds_not_branched == 0 and c.branches_broken == 0
    assert c.branch_calls_replayed == sum(
        s.prefix.calls for s in h.stubs.started if s.prefix is not None
    )
    assert h.stubs.asked == []  # uniform asks no activity
    assert_accounted(c)


async def test_surprisal_asks_the_store_and_broken_branches_are_dropped(
    time_skipping_env: WorkflowEnvironment,
):
    rows = tasks(10, broken_members=[3], rewards=[0.0, 1.0, 0.0, 1.0])
    async with branching_harness(time_skipping_env, rows) as h:
        config = branching(
            h,
            total_steps=1,
            min_group_size=3,
            groups=GroupsSpec(mode="branch", branch_at="surprisal"),
        )
        _, summary = await run(h, config)
    assert h.stubs.asked and all(a.calls == 4 for a in h.stubs.asked)
    branches = [s for s in h.stubs.started if s.prefix is not None]
    assert branches and {s.prefix.calls for s in branches if s.prefix} == {SURPRISING_CALL}
    (request,) = h.stubs.steps
    for group in request.groups:
        assert sorted(m.rollout_id.rsplit(".", 1)[1] for m in group.members) == ["0", "1", "2"]
    c = summary.counters
    assert c.branches_broken >= 2 and c.rollouts_broken_branches == c.branches_broken
    assert_accounted(c)


async def test_a_seed_that_fails_makes_an_ordinary_group(time_skipping_env: WorkflowEnvironment):
    rows = tasks(10, fail_members=[0], rewards=[0.0, 1.0, 0.0, 1.0])
    async with branching_harness(time_skipping_env, rows) as h:
        _, summary = await run(h, branching(h, total_steps=1, min_group_size=3))
    assert all(s.prefix is None for s in h.stubs.started)
    (request,) = h.stubs.steps
    assert all(len(g.members) == 3 for g in request.groups)
    assert all(m.masked_calls == 0 for g in request.groups for m in g.members)
    c = summary.counters
    assert c.seeds_not_branched >= 2 and c.groups_branched == 0 and c.rollouts_failed >= 2
    assert_accounted(c)


@dataclass
class BrokenBranchPoints(BranchingTrainerActivities):
    """`choose_branch_point` fails every try (`answer` "fails": the store is away, a record
    will not read), answers a point outside the seed's calls ("outside"), or finds none
    ("none": the store does not hold the seed's calls as it committed them)."""

    answer: str = "fails"

    @activity.defn(name="choose_branch_point")
    async def choose_branch_point(self, request: BranchPointRequest) -> BranchPoint:
        self.asked.append(request)
        if self.answer == "fails":
            raise RuntimeError("the store is away")
        at = request.calls + 5 if self.answer == "outside" else None
        return BranchPoint(at=at, surprisal=[])


@pytest.mark.parametrize(
    "answer", ["fails", "outside", "none"], ids=["activity-fails", "point-outside", "no-point"]
)
async def test_a_branch_point_that_cannot_be_had_starts_the_group_whole(
    time_skipping_env: WorkflowEnvironment, answer: str
):
    """No branch point (the activity fails its few tries, names a call the seed does not
    have, or finds none): the group's members start whole and the run goes on, where the run
    had waited on the activity without end, or failed its workflow task on every retry."""
    fails = answer == "fails"
    rows = tasks(10, rewards=[0.0, 1.0, 0.0, 1.0])
    stubs = functools.partial(BrokenBranchPoints, answer=answer)
    async with harness(time_skipping_env, rows, stubs, StubBranchingRollout) as h:  # type: ignore[arg-type]
        config = branching(
            h, total_steps=1, groups=GroupsSpec(mode="branch", branch_at="surprisal")
        )
        _, summary = await run(h, config)
    assert summary.steps == 1
    c = summary.counters
    assert c.groups_branched == 0 and c.seeds_not_branched >= 1
    # Every seed asked (a failing activity its five tries); no member started from a prefix.
    assert len(h.stubs.asked) >= (5 if fails else 1) * c.seeds_not_branched
    assert all(s.prefix is None for s in h.stubs.started)
    assert_accounted(c)


@dataclass
class SlowFirstBranchPoint(BranchingTrainerActivities):
    """`choose_branch_point` holds the first seed's answer until `release` is set."""

    release: asyncio.Event = field(default_factory=asyncio.Event)

    @activity.defn(name="choose_branch_point")
    async def choose_branch_point(self, request: BranchPointRequest) -> BranchPoint:
        if request.rollout_id.endswith(".t0.0"):
            await self.release.wait()
        return await super().choose_branch_point(request)


async def test_a_group_whose_branch_point_is_slow_holds_no_other(
    time_skipping_env: WorkflowEnvironment,
):
    """Each group branches on its own: while the first seed's branch point is still being
    chosen, the other groups' branches start (one group at a time, they waited for it)."""
    rows = tasks(4, rewards=[0.0, 1.0, 0.0, 1.0])
    async with harness(time_skipping_env, rows, SlowFirstBranchPoint, StubBranchingRollout) as h:  # type: ignore[arg-type]
        config = branching(
            h,
            total_steps=1,
            batch_size=4,
            groups=GroupsSpec(mode="branch", branch_at="surprisal"),
        )
        handle = await h.start(config)

        def others_branched() -> bool:
            return any(s.prefix is not None and ".t0." not in s.rollout_id for s in h.stubs.started)

        async def until_others_branched() -> None:
            while not others_branched():
                await asyncio.sleep(0.05)

        await asyncio.wait_for(until_others_branched(), TIMEOUT)
        assert not any(s.rollout_id.startswith(f"{config.run_id}.e0.t0.1") for s in h.stubs.started)
        h.stubs.release.set()
        summary = await asyncio.wait_for(handle.result(), TIMEOUT)
    assert summary.steps == 1 and summary.counters.groups_branched == 4
    assert_accounted(summary.counters)


async def test_branching_groups_cross_continue_as_new(dev_env: WorkflowEnvironment):
    """Seeds report while runs hand over; a group waiting for its branches is carried as
    data and branched by the next run. Every rollout is accounted for."""
    rows = [{"id": i, "duration": 1 + (i * 7) % 5, "time_scale": 0.05} for i in range(60)]
    async with branching_harness(dev_env, rows) as h:
        config = branching(
            h,
            mode="async",
            batch_size=2,
            total_steps=6,
            knobs={"max_inflight": 16, "max_staleness": 3},
            continue_as_new_after_events=100,
            epochs=2,
        )
        handle, summary = await run(h, config, seconds=300)
        status = await handle.query(TrainingWorkflow.status)
    assert summary.steps == 6 and status.runs > 1, "the run never continued as new"
    trained = [m.rollout_id for s in h.stubs.steps for g in s.groups for m in g.members]
    assert len(trained) == len(set(trained)) == 48
    c = summary.counters
    assert c.rollouts_started == len(h.stubs.started)
    assert c.groups_branched >= 12 and c.duplicate_reports == 0
    assert_accounted(c)
