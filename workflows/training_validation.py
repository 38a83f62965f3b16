"""A step's validation, pure: its rollouts (one per validation task, each its own group to
its workflow, together one book group with a tally in the run's state), the tally they report
into, and the step's record given the tally's figures once the last of them has reported."""

from __future__ import annotations

from darl.workflows.contracts import RolloutMode, RolloutOutcome
from darl.workflows.training_batches import trainable
from darl.workflows.training_group_ids import rollout_id, validation_group_id, validation_id
from darl.workflows.training_messages import RolloutStart
from darl.workflows.training_state import GroupState, Member, TaskRow, TrainingState, ValTally


def open_validation(
    run_id: str, state: TrainingState, rows: list[TaskRow], size: int, now: float
) -> tuple[list[RolloutStart], GroupState | None]:
    """The rollouts that validate step `state.step` on `rows`, and the book group they
    report into (None when there are none)."""
    validation = validation_id(run_id, state.step)
    starts = [
        RolloutStart(
            rollout_id=rollout_id(validation_group_id(validation, row.position), k),
            group_id=validation_group_id(validation, row.position),
            mode=RolloutMode.VAL,
            row=row,
        )
        for row in rows
        for k in range(size)
    ]
    if not starts:
        return starts, None
    group = GroupState(
        group_id=validation,
        mode=RolloutMode.VAL,
        step=state.step,
        policy_version=state.policy_version,
        pending=[s.rollout_id for s in starts],
        started_at=now,
        tally=ValTally(),
    )
    return starts, group


def count_validation(
    tally: ValTally, result: RolloutOutcome | Member, success_threshold: float
) -> None:
    """Add a validation rollout's outcome to its step's `tally`."""
    tally.results += 1
    if trainable(result):
        reward = float(result.reward or 0.0)
        tally.rewarded += 1
        tally.reward_sum += reward
        tally.successes += reward >= success_threshold


def finish_validation(state: TrainingState, step: int, success_threshold: float) -> None:
    """A validation step is done when its last group is (complete groups wait in the state
    until then): its groups leave the state, and its outcome joins the step's record, to be
    written again."""
    groups = [g for g in state.groups.values() if g.mode == RolloutMode.VAL and g.step == step]
    if any(g.pending for g in groups):
        return
    tally = ValTally()
    for group in groups:
        # A validation group carried with members rather than a tally counts them here.
        for member in group.results:
            count_validation(tally, member, success_threshold)
        if group.tally is not None:
            tally.results += group.tally.results
            tally.rewarded += group.tally.rewarded
            tally.reward_sum += group.tally.reward_sum
            tally.successes += group.tally.successes
        del state.groups[group.group_id]
    for i, record in enumerate(state.recent_steps):
        if record.step == step:
            updated = record.model_copy(
                update={
                    "val_reward_mean": tally.reward_sum / tally.rewarded if tally.rewarded else 0.0,
                    "val_success_rate": tally.successes / tally.results if tally.results else 0.0,
                }
            )
            state.recent_steps[i] = updated
            state.unwritten_records.append(updated)
