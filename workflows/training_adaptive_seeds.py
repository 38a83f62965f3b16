"""Adaptive seeds (`groups.seed: adaptive`): the run's record of each task's recent outcomes,
and the choice of the earlier rollout a task's next group branches from, so that the group's
pass rate moves toward 0.5. Pure and deterministic: it works on the TrainingState."""

from __future__ import annotations

from darl.workflows.training_batches import trainable
from darl.workflows.training_state import Member, TaskOutcomes, TaskRow

OUTCOME_WINDOW = 16
"""A task's pass rate is that of its last this many outcomes (members of any group of it):
recent enough to follow the policy as it learns."""
MAX_TASKS = 256
"""The most tasks whose outcomes the state keeps; past it, the least recently recorded task
is forgotten (its next group is an ordinary one again). A task's entry is a few hundred
bytes of the state carried across continue-as-new (tests/unit/test_adaptive_branching.py
builds the worst case)."""
BALANCED = 0.5
"""The pass rate a group's seed steers toward: GRPO's advantages are largest there."""


def pass_rate(outcomes: TaskOutcomes) -> float | None:
    """The share of the task's recent outcomes that were successes; None with none yet."""
    if not outcomes.recent:
        return None
    return outcomes.recent.count("1") / len(outcomes.recent)


def choose_seed(outcomes: TaskOutcomes | None) -> Member | None:
    """The rollout the task's next group branches from: its latest success when its recent
    pass rate is under 0.5 (members start nearer a success), its latest failure otherwise
    (nearer a failure). None, for an ordinary group, when the task has no outcome yet or no
    rollout of the outcome wanted (a task never passed has no success to start from)."""
    if outcomes is None:
        return None
    rate = pass_rate(outcomes)
    if rate is None:
        return None
    return outcomes.success if rate < BALANCED else outcomes.failure


def can_seed(member: Member) -> bool:
    """A member another group can branch from: a trained trajectory with a call after the
    prefix's first, whose own prefix (if it is a branch) held."""
    return trainable(member) and member.calls >= 2 and member.prefix_diverged_at is None


class TaskRecord:
    """The run's per-task outcomes (`TrainingState.task_outcomes`, keyed by the row's index
    in the dataset), bounded to OUTCOME_WINDOW outcomes a task and MAX_TASKS tasks."""

    def __init__(self, outcomes: dict[int, TaskOutcomes], success_threshold: float) -> None:
        self.outcomes = outcomes
        self.success_threshold = success_threshold

    def seed_for(self, row: TaskRow) -> Member | None:
        """The earlier rollout a group of `row`'s task branches from (`choose_seed`); None
        for a row that carries its task (no index to know it by)."""
        if row.index is None:
            return None
        return choose_seed(self.outcomes.get(row.index))

    def record(self, row: TaskRow | None, member: Member) -> None:
        """A trained member of a group of `row`'s task reported. A member with no reward, or
        a branch whose prefix did not hold (its outcome is not of the state it was meant to
        start from), is not an outcome of the task."""
        if row is None or row.index is None or not trainable(member):
            return
        if member.prefix_diverged_at is not None:
            return
        # Re-inserted, so the dict's order is least recently recorded first.
        task = self.outcomes.pop(row.index, None) or TaskOutcomes()
        succeeded = member.reward is not None and member.reward >= self.success_threshold
        task.recent = (task.recent + ("1" if succeeded else "0"))[-OUTCOME_WINDOW:]
        if can_seed(member):
            if succeeded:
                task.success = member
            else:
                task.failure = member
        self.outcomes[row.index] = task
        while len(self.outcomes) > MAX_TASKS:
            del self.outcomes[next(iter(self.outcomes))]
