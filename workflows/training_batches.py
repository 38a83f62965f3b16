"""A step's batch and record, pure: which rollouts train (a reward, never a failure's 0), the
groups a step takes as the trainer reads them (`TrainGroup`: each member's calls, its reward
and the calls that are context only), the batch's figures, and the step's record."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from darl.workflows.contracts import RolloutOutcome
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.training_messages import SyncResult, TrainGroup, TrainMember, TrainStepResult
from darl.workflows.training_state import GroupState, Member, StepRecord, TrainingState

# Rollouts per minute is measured over this many steps back.
RATE_WINDOW_STEPS = 3


@dataclass(frozen=True)
class BatchStats:
    rollouts: int
    groups: int
    reward_mean: float
    reward_std: float
    success_rate: float
    response_tokens_mean: float
    staleness_mean: float


def trainable(result: RolloutOutcome | Member) -> bool:
    """Only rollouts that ended with a reward are trained: a crashed or timed-out agent is a
    result to count, never a reward of 0 to learn from."""
    return result.status == RolloutStatus.SUCCEEDED and result.reward is not None


def train_group(group: GroupState, members: list[Member], train_seed_prefix: bool) -> TrainGroup:
    """`group` as the trainer reads it: its `members` (those that train), each by its final
    attempt's committed calls."""
    return TrainGroup(
        group_id=group.group_id,
        members=[
            TrainMember(
                rollout_id=r.rollout_id,
                attempt=r.attempts,
                calls=r.calls,
                digest=r.events_digest,
                reward=float(r.reward or 0.0),
                masked_calls=masked_calls(group, r, train_seed_prefix),
            )
            for r in members
        ],
    )


def masked_calls(group: GroupState, member: Member, train_seed_prefix: bool) -> int:
    """A member's first calls that are context only: a branch's replayed prefix, and the
    seed's own prefix unless `train_seed_prefix`."""
    if member.rollout_id != group.seed:
        return member.prefix_calls
    if group.branch_point is None or train_seed_prefix:
        return 0
    return group.branch_point


def batch_stats(
    taken: list[GroupState],
    members: list[Member],
    policy_version: int,
    success_threshold: float,
) -> BatchStats:
    """The figures of a batch: the groups `taken` and their `members` that train, trained
    into `policy_version`."""
    rewards = [float(r.reward or 0.0) for r in members]
    return BatchStats(
        rollouts=len(members),
        groups=len(taken),
        reward_mean=statistics.fmean(rewards) if rewards else 0.0,
        reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        success_rate=(
            sum(1 for x in rewards if x >= success_threshold) / len(rewards) if rewards else 0.0
        ),
        response_tokens_mean=(
            statistics.fmean(r.completion_tokens for r in members) if members else 0.0
        ),
        staleness_mean=(
            statistics.fmean(policy_version - g.policy_version for g in taken) if taken else 0.0
        ),
    )


def step_record(
    state: TrainingState,
    step: int,
    stats: BatchStats,
    trained: TrainStepResult,
    synced: SyncResult,
    now: float,
) -> StepRecord:
    """The record of `step`, trained at `now`: its batch's figures, the trainer's and the
    sync's, and the rollouts ended per minute over the last RATE_WINDOW_STEPS steps."""
    ended = state.counters.ended()
    window = state.recent_steps[-RATE_WINDOW_STEPS:]
    since, ended_then = (
        (window[0].time, window[0].rollouts_ended) if window else (state.started_at, 0)
    )
    minutes = max(now - since, 1e-6) / 60
    return StepRecord(
        step=step,
        policy_version=step,
        time=now,
        rollouts=stats.rollouts,
        groups=stats.groups,
        reward_mean=stats.reward_mean,
        reward_std=stats.reward_std,
        success_rate=stats.success_rate,
        response_tokens_mean=stats.response_tokens_mean,
        staleness_mean=stats.staleness_mean,
        paused_seconds=synced.paused_seconds,
        rollouts_per_minute=(ended - ended_then) / minutes,
        rollouts_ended=ended,
        train_seconds=trained.seconds,
        trainer=trained.metrics,
    )
