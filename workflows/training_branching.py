"""The brancher: the TrainingWorkflow's loop that starts a branching group's other members
once its seed has reported (`groups.mode: branch`), or all of them at once when its seed is
an earlier rollout of its task (`groups.seed: adaptive`), each from the seed's first calls up
to a branch point chosen by the config's rule, or whole when the seed cannot branch."""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError

from darl.workflows.names import CHOOSE_BRANCH_POINT
from darl.workflows.training_activity_options import (
    BRANCH_POINT_RETRY,
    HEARTBEAT,
    START_TO_CLOSE,
)
from darl.workflows.training_groups import can_branch
from darl.workflows.training_messages import BranchPoint, BranchPointRequest
from darl.workflows.training_rollout_starts import start_rollouts
from darl.workflows.training_run import TrainingRun


async def branch(run: TrainingRun) -> None:
    """Start the branches of each group whose seed has reported (none while paused), each
    group on its own: one whose branch point takes its time (the store slow, its retries)
    holds no other. A group is booked before its branches start, as in `start_groups`; one
    whose branches are still to start at a continue-as-new is carried in the state. A failure
    to start them is the brancher's, and so the run's."""
    if not workflow.patched("branch-groups-independently"):
        return await _branch_one_group_at_a_time(run)
    book = run.book
    opening: dict[str, asyncio.Task[None]] = {}

    def something_to_do() -> bool:
        seeded = not run.state.paused and any(g not in opening for g in book.to_branch())
        return run.closing or seeded or any(t.done() for t in opening.values())

    while True:
        await workflow.wait_condition(something_to_do)
        for group_id, opened in list(opening.items()):
            if opened.done():
                del opening[group_id]
                opened.result()
        if run.closing:
            break
        if run.state.paused:
            continue
        for group_id in book.to_branch():
            if group_id not in opening:
                opening[group_id] = asyncio.create_task(_open_branches(run, group_id))
    for opened in opening.values():
        await opened


async def _open_branches(run: TrainingRun, group_id: str) -> None:
    at = await _branch_point(run, group_id)
    await start_rollouts(run, run.book.open_branches(group_id, at))


async def _branch_one_group_at_a_time(run: TrainingRun) -> None:
    """`branch` when replaying a history without the "branch-groups-independently" marker:
    the groups in turn, each group's branches started before the next one's point is asked."""
    book = run.book
    while True:
        await workflow.wait_condition(
            lambda: run.closing or (not run.state.paused and bool(book.to_branch()))
        )
        if run.closing:
            return
        group_id = book.to_branch()[0]
        at = await _branch_point(run, group_id)
        await start_rollouts(run, book.open_branches(group_id, at))


async def _branch_point(run: TrainingRun, group_id: str) -> int | None:
    """The prefix length the group's branches start from, by the config's rule applied to
    its seed (its own, or the earlier rollout `groups.seed: adaptive` gave it); None when
    the seed cannot branch (it failed, made fewer than two calls, or the store does not hold
    them as it committed them): its members then start whole."""
    seed = run.book.seed_result(group_id)
    groups = run.config.groups
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
