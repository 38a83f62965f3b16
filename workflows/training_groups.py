"""The trainer's book of GRPO groups: which rollouts are out, which groups are complete and
trainable, and where every rollout ended up. Pure and deterministic (no Temporal calls): it
works on the TrainingState, which survives continue-as-new as data."""

from __future__ import annotations

from enum import StrEnum

from temporalio.exceptions import ApplicationError

from darl.workflows.contracts import (
    PrefixSpec,
    RolloutMode,
    RolloutOutcome,
)
from darl.workflows.names import BRANCH_POINT_ERROR
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.training_adaptive_seeds import TaskRecord
from darl.workflows.training_batches import BatchStats, batch_stats, train_group, trainable
from darl.workflows.training_config import TrainingConfig, TrainingMode
from darl.workflows.training_group_ids import closed_group, rollout_id, train_group_id
from darl.workflows.training_messages import RolloutStart, TrainGroup
from darl.workflows.training_state import (
    MAX_HELD,
    GroupState,
    Member,
    TaskRow,
    TrainingState,
)
from darl.workflows.training_validation import (
    count_validation,
    finish_validation,
    open_validation,
)


class Dropped(StrEnum):
    """Why a complete train group is not trained."""

    # Rolled out by weights more than `max_staleness` versions behind.
    STALE = "stale"
    # Fewer trainable members than `min_group_size`.
    TOO_SMALL = "too small"
    # Every member got the same reward (no advantage to learn from), with
    # `equal_reward_groups: drop`.
    EQUAL_REWARDS = "equal rewards"


def can_branch(seed: Member) -> bool:
    """A seed's branches start from its prefix only if it has one to give: a trained
    trajectory (a failed seed's calls are no state worth comparing continuations of) with
    a call after the prefix's first."""
    return trainable(seed) and seed.calls >= 2


class GroupBook:
    """The run's groups as the TrainingState holds them, and every rule of their lives: a
    group opens, its rollouts report (or are found lost), it completes and is trained,
    dropped or tallied, and the run's end counts what is left."""

    def __init__(self, config: TrainingConfig, state: TrainingState) -> None:
        self.config = config
        self.state = state
        # Rollout id -> its group's id, for every rollout out.
        self._group_of: dict[str, str] = {
            rollout_id: group.group_id
            for group in state.groups.values()
            for rollout_id in group.pending
        }
        self.adaptive = config.groups.mode == "branch" and config.groups.seed == "adaptive"
        self.task_record = TaskRecord(state.task_outcomes, config.success_threshold)

    # --- rollouts going out and coming back -----------------------------------------------

    def room(self, busy: bool) -> int:
        """How many more train groups may start now (`busy`: a step is being trained or
        synced)."""
        state, config = self.state, self.config
        total = config.total_steps
        if state.paused or state.stop_requested or state.dataset_exhausted:
            return 0
        if total is not None and state.step >= total:
            return 0
        # The state's budget: a step always fits ((batch_size + 1) x group_size <= MAX_HELD,
        # TrainingConfig), so what is held drains into steps and room comes back.
        within_budget = (MAX_HELD - self.held()) // config.group_size
        if config.mode == TrainingMode.SYNC:
            # On-policy: one batch at a time, rolled out by the policy it will train.
            if busy or self.validating():
                return 0
            room = config.batch_size - self.inflight_groups() - len(state.ready)
        else:
            room = (state.knobs.max_inflight - self._train_rollouts_booked()) // config.group_size
        return max(0, min(room, within_budget))

    def open_groups(
        self, rows: list[TaskRow], mode: RolloutMode, size: int, now: float
    ) -> list[RolloutStart]:
        """Book a group per task row and return its rollouts to start. Ids are unique in the
        run: a task's place in its epoch, or the step it validates. A branching train group
        starts its seed (`<group>.0`) only; its other members wait for the seed's result
        (`open_branches`). With `groups.seed: adaptive` it starts none: all its members wait
        to branch from an earlier rollout of its task (`TaskRecord.seed_for`), or, with none
        to branch from, start whole at once. A step's validation rollouts are one book group
        with a tally."""
        config, state = self.config, self.state
        if mode == RolloutMode.VAL:
            val_starts, validation = open_validation(config.run_id, state, rows, size, now)
            if validation is not None:
                self.add_group(validation)
            return val_starts
        branching = config.groups.mode == "branch" and size > 1
        starts: list[RolloutStart] = []
        for row in rows:
            group_id = train_group_id(config.run_id, row.epoch, row.position)
            rollout_ids = [rollout_id(group_id, k) for k in range(size)]
            group = GroupState(
                group_id=group_id,
                policy_version=state.policy_version,
                pending=rollout_ids,
                started_at=now,
            )
            if branching and self.adaptive:
                group.row, group.seed_from = row, self.task_record.seed_for(row)
                if group.seed_from is not None:
                    group.pending, group.unopened = [], rollout_ids
            elif branching:
                group.pending, group.unopened = rollout_ids[:1], rollout_ids[1:]
                group.seed, group.row = rollout_ids[0], row
            self.add_group(group)
            starts += [
                RolloutStart(rollout_id=pending, group_id=group_id, mode=mode, row=row)
                for pending in group.pending
            ]
        return starts

    def add_group(self, group: GroupState) -> None:
        self.state.groups[group.group_id] = group
        for pending in group.pending:
            self._group_of[pending] = group.group_id
        self.state.counters.rollouts_started += len(group.pending)

    def pending_rollouts(self) -> list[str]:
        return list(self._group_of)

    def inflight(self, mode: RolloutMode | None = None) -> int:
        return sum(
            len(g.pending) for g in self.state.groups.values() if mode is None or g.mode == mode
        )

    def inflight_groups(self, mode: RolloutMode = RolloutMode.TRAIN) -> int:
        return sum(
            1 for g in self.state.groups.values() if (g.pending or g.unopened) and g.mode == mode
        )

    def _train_rollouts_booked(self) -> int:
        """Train rollouts out or booked: a branching group holds room for its branches from
        its start, so they never wait for room when their seed reports."""
        return sum(
            len(g.pending) + len(g.unopened)
            for g in self.state.groups.values()
            if g.mode == RolloutMode.TRAIN
        )

    def held(self) -> int:
        """Train rollouts the state holds: out, booked, or back and waiting for their group's
        step (at most MAX_HELD, whatever the knobs say: `room`; a validation holds its own,
        at most `validation.tasks`)."""
        return sum(
            len(g.pending) + len(g.unopened) + len(g.results)
            for g in self.state.groups.values()
            if g.mode == RolloutMode.TRAIN
        )

    def record(self, result: RolloutOutcome) -> None:
        """A rollout's report. Duplicates (a report sent again: a rollout's last workflow task
        retried after its report went out) and strangers are counted."""
        counters = self.state.counters
        group_id = self._group_of.pop(result.rollout_id, None)
        if group_id is None:
            if self._reported_before(result):
                counters.duplicate_reports += 1
            else:
                counters.unknown_reports += 1
            return
        group = self.state.groups[group_id]
        group.pending.remove(result.rollout_id)
        if group.tally is not None:
            count_validation(group.tally, result, self.config.success_threshold)
        else:
            member = Member.model_validate(result.model_dump())
            group.results.append(member)
            if self.adaptive:
                self.task_record.record(group.row, member)
        # A branch's prefix is replayed too, but that is no resumption: counted apart.
        resumed = result.replayed_calls - result.prefix_calls
        if resumed > 0:
            counters.rollouts_resumed += 1
            counters.calls_replayed += resumed
        counters.replays_diverged += (
            result.replay_diverged_at is not None and result.prefix_diverged_at is None
        )
        counters.branch_calls_replayed += result.prefix_calls
        counters.branches_broken += result.prefix_diverged_at is not None
        if result.status == RolloutStatus.CANCELLED:
            counters.rollouts_cancelled += 1
        elif not trainable(result):
            counters.rollouts_failed += 1
            self.state.failed_in_a_row += 1
            self.state.last_failure = f"{result.rollout_id} {result.status}: {result.error}"
        else:
            self.state.failed_in_a_row = 0
            counters.rollouts_broken_branches += self._broken_branch_dropped(result)
        if not group.pending and not group.unopened:
            self._complete(group)

    def _broken_branch_dropped(self, result: RolloutOutcome | Member) -> bool:
        """A branch whose prefix could not be replayed, which `broken_branches: drop` leaves
        out of its group (the agent did not rebuild the state the group compares)."""
        return (
            result.prefix_diverged_at is not None and self.config.groups.broken_branches == "drop"
        )

    def _trained_members(self, group: GroupState) -> list[Member]:
        """The group's results that train: a reward, and a branch whose prefix held (or is
        kept anyway)."""
        return [r for r in group.results if trainable(r) and not self._broken_branch_dropped(r)]

    def _reported_before(self, result: RolloutOutcome) -> bool:
        group = self.state.groups.get(result.group_id)
        if group is None:
            state = self.state
            return closed_group(
                result.group_id,
                run_id=self.config.run_id,
                epoch=state.epoch,
                cursor=state.cursor,
                step=state.step,
            )
        return any(r.rollout_id == result.rollout_id for r in group.results)

    def record_lost(self, rollout_id: str, why: str) -> None:
        """A rollout that closed without reporting (terminated by hand): an infra failure."""
        group_id = self._group_of.get(rollout_id)
        if group_id is None:
            return
        group = self.state.groups[group_id]
        self.record(
            RolloutOutcome(
                run_id=self.config.run_id,
                rollout_id=rollout_id,
                group_id=group_id,
                mode=group.mode,
                status=RolloutStatus.FAILED_INFRA,
                attempts=0,
                error=why,
            )
        )

    # --- branching groups (`groups.mode: branch`) -------------------------------------------

    def to_branch(self) -> list[str]:
        """Groups whose seed has reported and whose branches are still to start, oldest
        first."""
        return [g.group_id for g in self.state.groups.values() if g.unopened and not g.pending]

    def awaiting_branches(self) -> bool:
        return any(g.unopened for g in self.state.groups.values())

    def seed_result(self, group_id: str) -> Member:
        """The rollout the group branches from: its own seed's result, or the earlier
        rollout of its task it was given (`groups.seed: adaptive`)."""
        group = self.state.groups[group_id]
        if group.seed_from is not None:
            return group.seed_from
        return next(r for r in group.results if r.rollout_id == group.seed)

    def open_branches(self, group_id: str, at: int | None) -> list[RolloutStart]:
        """Start a seeded group's other members: branches of the seed's first `at` calls, or,
        with `at` None (the seed could not branch), ordinary rollouts. A group that went stale
        while its seed ran is dropped instead (its branches would be dropped with it)."""
        group = self.state.groups[group_id]
        counters = self.state.counters
        seed = self.seed_result(group_id)
        if self._stale(group):
            group.unopened = []
            self._drop(group, Dropped.STALE)
            return []
        prefix = None
        if at is None:
            counters.seeds_not_branched += 1
        else:
            if not 1 <= at < seed.calls:
                # DARL's own fault (the points it is given are checked): fail the run saying
                # so, not a workflow task that fails again on every retry.
                raise ApplicationError(
                    f"branch point {at} is outside calls 1..{seed.calls - 1} of seed "
                    f"{seed.rollout_id}",
                    type=BRANCH_POINT_ERROR,
                    non_retryable=True,
                )
            counters.groups_branched += 1
            group.branch_point = at
            prefix = PrefixSpec(rollout_id=seed.rollout_id, attempt=seed.attempts, calls=at)
        rollout_ids, group.unopened = group.unopened, []
        group.pending = rollout_ids
        # Its prefix is in its members' specs now; the state need not carry it.
        group.seed_from = None
        for booked in rollout_ids:
            self._group_of[booked] = group_id
        counters.rollouts_started += len(rollout_ids)
        # A group state without its row holds its task itself (`GroupState.task`).
        row = group.row
        if row is None:
            row = TaskRow(epoch=0, position=0, task=group.task)
        return [
            RolloutStart(
                rollout_id=booked, group_id=group_id, mode=group.mode, row=row, prefix=prefix
            )
            for booked in rollout_ids
        ]

    # --- complete groups ------------------------------------------------------------------

    def _complete(self, group: GroupState) -> None:
        counters = self.state.counters
        good = self._trained_members(group)
        if group.mode == RolloutMode.VAL:
            counters.rollouts_validated += len(good) + (group.tally.rewarded if group.tally else 0)
            finish_validation(self.state, group.step, self.config.success_threshold)
            return
        rewards = {r.reward for r in good}
        if self._stale(group):
            self._drop(group, Dropped.STALE)
        elif len(good) < self.config.least_group_size:
            self._drop(group, Dropped.TOO_SMALL)
        elif len(rewards) == 1 and self.config.equal_reward_groups == "drop":
            self._drop(group, Dropped.EQUAL_REWARDS)
        else:
            self.state.ready.append(group.group_id)

    def _drop(self, group: GroupState, why: Dropped) -> None:
        counters = self.state.counters
        counters.rollouts_in_dropped_groups += len(self._trained_members(group))
        match why:
            case Dropped.TOO_SMALL:
                counters.groups_dropped_small += 1
            case Dropped.EQUAL_REWARDS:
                counters.groups_dropped_equal += 1
            case Dropped.STALE:
                counters.groups_dropped_stale += 1
        self.state.groups.pop(group.group_id, None)

    def close(self) -> None:
        """The run ends: what is complete but untrained is counted as left over."""
        for group in list(self.state.groups.values()):
            if not group.pending:
                self.state.counters.rollouts_left_over += len(self._trained_members(group))
                del self.state.groups[group.group_id]
        self.state.ready.clear()

    def failing(self) -> bool:
        """Whether so many rollouts failed in a row that the run cannot be working."""
        return self.state.failed_in_a_row >= self.config.max_failed_rollouts_in_a_row

    def failing_message(self) -> str:
        return (
            f"{self.state.failed_in_a_row} rollouts in a row failed and none succeeded; "
            f"the last: {self.state.last_failure}"
        )

    # --- validation -----------------------------------------------------------------------

    def validating(self) -> bool:
        return any(g.mode == RolloutMode.VAL and g.pending for g in self.state.groups.values())

    # --- batches --------------------------------------------------------------------------

    def drop_stale(self) -> None:
        """Ready groups older than `max_staleness` versions carry an off-policy signal too
        weak to keep (sync mode keeps none from an earlier version)."""
        for group_id in list(self.state.ready):
            group = self.state.groups[group_id]
            if self._stale(group):
                self.state.ready.remove(group_id)
                self._drop(group, Dropped.STALE)

    def _stale(self, group: GroupState) -> bool:
        limit = 0 if self.config.mode == TrainingMode.SYNC else self.state.knobs.max_staleness
        return self.state.policy_version - group.policy_version > limit

    def batch_ready(self) -> bool:
        return len(self.state.ready) >= self.config.batch_size

    def take_batch(self) -> tuple[list[TrainGroup], BatchStats]:
        """The oldest `batch_size` ready groups, out of the book."""
        taken = [self.state.groups.pop(g) for g in self.state.ready[: self.config.batch_size]]
        del self.state.ready[: self.config.batch_size]
        members = [self._trained_members(group) for group in taken]
        seed_prefix = self.config.groups.train_seed_prefix
        groups = [train_group(g, good, seed_prefix) for g, good in zip(taken, members, strict=True)]
        trained = [member for good in members for member in good]
        self.state.counters.rollouts_trained += len(trained)
        self.state.counters.groups_trained += len(groups)
        stats = batch_stats(
            taken, trained, self.state.policy_version, self.config.success_threshold
        )
        return groups, stats
