"""Adaptive seeds (`groups.seed: adaptive`, issue 49) on the trainer's side: the record of a
task's outcomes (its pass rate over a bounded window, its latest success and failure), the
choice of a success's prefix for a task mostly failed and a failure's for one mostly passed,
an ordinary group where there is nothing to branch from, the bounds on tasks kept, the state
within its continue-as-new budget, and the config that refuses what cannot work."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from darl.workflows.contracts import RolloutMode, RolloutOutcome
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.training_adaptive_seeds import (
    MAX_TASKS,
    OUTCOME_WINDOW,
    TaskRecord,
    choose_seed,
    pass_rate,
)
from darl.workflows.training_config import GroupsSpec
from darl.workflows.training_groups import GroupBook
from darl.workflows.training_state import Member, TaskOutcomes, TaskRow, TrainingState
from tests.unit.test_branch_groups import config, result
from tests.unit.test_payload_budgets import PAYLOAD_LIMIT, carried, payload_bytes

GROUP = 4
ADAPTIVE = GroupsSpec(mode="branch", seed="adaptive", branch_at="fraction")


def row(index: int, epoch: int = 0, position: int | None = None) -> TaskRow:
    return TaskRow(
        epoch=epoch,
        position=index if position is None else position,
        index=index,
        digest="d" * 64,
    )


def member(rollout_id: str, reward: float | None = 1.0, calls: int = 4, **fields: Any) -> Member:
    return Member.model_validate(result(rollout_id, reward, calls, **fields).model_dump())


def adaptive_book(**overrides: Any) -> GroupBook:
    c = config(groups=ADAPTIVE, **overrides)
    return GroupBook(c, TrainingState(knobs=c.knobs))


def open_task(b: GroupBook, index: int, epoch: int) -> list[str]:
    starts = b.open_groups([row(index, epoch)], RolloutMode.TRAIN, GROUP, now=0.0)
    return [s.rollout_id for s in starts]


def report(b: GroupBook, group_id: str, rewards: list[float], **fields: Any) -> None:
    for k, reward in enumerate(rewards):
        b.record(result(f"{group_id}.{k}", reward, **fields))


# --- the choice ---------------------------------------------------------------------------


def test_a_task_mostly_failed_branches_from_its_latest_success():
    success, later_success = member("a.0", 1.0), member("a.5", 1.0)
    outcomes = TaskOutcomes(recent="0010", success=success, failure=member("a.1", 0.0))
    assert pass_rate(outcomes) == 0.25
    assert choose_seed(outcomes) == success
    assert choose_seed(outcomes.model_copy(update={"success": later_success})) == later_success


def test_a_task_mostly_passed_or_balanced_branches_from_a_failure():
    failure = member("a.1", 0.0)
    for recent in ("1101", "10"):
        outcomes = TaskOutcomes(recent=recent, success=member("a.0"), failure=failure)
        assert choose_seed(outcomes) == failure


def test_nothing_to_branch_from_makes_an_ordinary_group():
    assert choose_seed(None) is None
    assert choose_seed(TaskOutcomes()) is None
    # Never passed: no success to start nearer to.
    assert choose_seed(TaskOutcomes(recent="000", failure=member("a.1", 0.0))) is None
    # Always passed: no failure to start from.
    assert choose_seed(TaskOutcomes(recent="11", success=member("a.0"))) is None


# --- the record ---------------------------------------------------------------------------


def test_the_record_keeps_a_window_of_outcomes_and_the_latest_of_each():
    record = TaskRecord({}, success_threshold=1.0)
    for k in range(OUTCOME_WINDOW + 3):
        record.record(row(7), member(f"g.{k}", 1.0 if k % 4 == 0 else 0.5))
    task = record.outcomes[7]
    assert len(task.recent) == OUTCOME_WINDOW
    # The oldest three (k = 0, 1, 2) are gone: k = 3 .. 18, successes at 4, 8, 12, 16.
    assert task.recent == "".join("1" if k % 4 == 0 else "0" for k in range(3, 19))
    assert task.success is not None and task.success.rollout_id == "g.16"
    assert task.failure is not None and task.failure.rollout_id == "g.18"


def test_what_is_no_outcome_of_the_task_is_not_recorded():
    record = TaskRecord({}, success_threshold=1.0)
    record.record(row(1), member("g.0", None, status=RolloutStatus.FAILED_AGENT))
    record.record(row(1), member("g.1", 1.0, prefix_calls=0, diverged_at=0))
    record.record(TaskRow(epoch=0, position=0, task={"q": 1}), member("g.2"))
    record.record(None, member("g.3"))
    assert record.outcomes == {}


def test_an_outcome_without_a_prefix_to_give_counts_but_seeds_nothing():
    record = TaskRecord({}, success_threshold=1.0)
    record.record(row(1), member("g.0", 1.0, calls=1))
    assert record.outcomes[1].recent == "1" and record.outcomes[1].success is None


def test_the_least_recently_recorded_task_is_forgotten_past_the_bound():
    record = TaskRecord({}, success_threshold=1.0)
    for index in range(MAX_TASKS):
        record.record(row(index), member(f"g{index}.0"))
    record.record(row(0), member("g0.1", 0.0))  # task 0 recorded again: now the newest
    record.record(row(MAX_TASKS), member("new.0"))
    assert len(record.outcomes) == MAX_TASKS
    assert 1 not in record.outcomes and 0 in record.outcomes
    assert list(record.outcomes)[-2:] == [0, MAX_TASKS]


# --- the book -----------------------------------------------------------------------------


def test_a_first_group_of_a_task_runs_whole_and_a_later_one_branches_by_outcome():
    b = adaptive_book()
    first = open_task(b, index=3, epoch=0)
    assert first == [f"r.e0.t3.{k}" for k in range(GROUP)]
    report(b, "r.e0.t3", [0.0, 0.0, 1.0, 0.0])  # pass rate 0.25: hard
    assert b.state.task_outcomes[3].recent == "0010"

    assert open_task(b, index=3, epoch=1) == []  # all its members wait to branch
    (group_id,) = b.to_branch()
    assert group_id == "r.e1.t3"
    seed = b.seed_result(group_id)
    assert seed.rollout_id == "r.e0.t3.2"
    starts = b.open_branches(group_id, at=2)
    assert [s.rollout_id for s in starts] == [f"r.e1.t3.{k}" for k in range(GROUP)]
    assert {s.prefix.rollout_id for s in starts if s.prefix} == {"r.e0.t3.2"}
    assert all(s.prefix is not None and s.prefix.calls == 2 for s in starts)
    assert b.state.counters.groups_branched == 1

    # The branches pass 3 of 4: the window is now 4 of 8, balanced, so a failure's prefix.
    report(b, "r.e1.t3", [1.0, 1.0, 0.0, 1.0], prefix_calls=2)
    assert b.state.task_outcomes[3].recent == "00101101"
    open_task(b, index=3, epoch=2)
    assert b.seed_result("r.e2.t3").rollout_id == "r.e1.t3.2"


def test_an_easy_task_branches_from_a_failure_and_other_tasks_are_apart():
    b = adaptive_book()
    open_task(b, index=0, epoch=0)
    open_task(b, index=1, epoch=0)
    report(b, "r.e0.t0", [1.0, 0.0, 1.0, 1.0])
    report(b, "r.e0.t1", [0.0, 0.0, 0.0, 1.0])
    open_task(b, index=0, epoch=1)
    open_task(b, index=1, epoch=1)
    assert b.seed_result("r.e1.t0").rollout_id == "r.e0.t0.1"
    assert b.seed_result("r.e1.t1").rollout_id == "r.e0.t1.3"


def test_a_branched_member_masks_its_prefix_and_no_member_is_a_seed():
    b = adaptive_book(equal_reward_groups="train")
    open_task(b, index=0, epoch=0)
    report(b, "r.e0.t0", [1.0, 0.0, 0.0, 0.0])
    open_task(b, index=0, epoch=1)
    b.open_branches("r.e1.t0", at=3)
    report(b, "r.e1.t0", [1.0, 0.0, 1.0, 0.0], calls=5, prefix_calls=3)
    first, _ = b.take_batch()
    (group,) = b.take_batch()[0]  # batch_size 1: the whole group first, then the branched
    assert [g.group_id for g in first] == ["r.e0.t0"] and group.group_id == "r.e1.t0"
    assert [m.masked_calls for m in group.members] == [3] * GROUP


def test_a_task_never_passed_stays_ordinary():
    b = adaptive_book()
    open_task(b, index=0, epoch=0)
    report(b, "r.e0.t0", [0.0] * GROUP)
    assert len(open_task(b, index=0, epoch=1)) == GROUP
    assert b.to_branch() == []


def test_outcomes_survive_continue_as_new_as_data():
    b = adaptive_book()
    open_task(b, index=5, epoch=0)
    report(b, "r.e0.t5", [0.0, 1.0, 0.0, 0.0])
    state = TrainingState.model_validate_json(b.state.model_dump_json())
    again = GroupBook(b.config, state)
    open_task(again, index=5, epoch=1)
    assert again.seed_result("r.e1.t5").rollout_id == "r.e0.t5.1"


def test_the_own_seed_mode_records_no_outcomes():
    b = GroupBook(config(), TrainingState())
    b.open_groups([row(0)], RolloutMode.TRAIN, GROUP, now=0.0)
    b.record(result("r.e0.t0.0", 1.0))
    assert b.state.task_outcomes == {}
    assert "seed_from" not in b.state.groups["r.e0.t0"].model_dump()


# --- budgets and config -------------------------------------------------------------------


def longest_seed(reward: float) -> Member:
    return Member(
        rollout_id="r" * 64 + f".e{10**9}.t{10**9}.1023",
        status=RolloutStatus.SUCCEEDED,
        reward=reward / 3,
        attempts=20,
        calls=10**9,
        completion_tokens=10**9,
        events_digest="f" * 64,
        prefix_calls=10**9,
    )


@pytest.mark.parametrize("waiting", [False, True], ids=["groups back", "groups to branch"])
def test_the_carried_state_with_every_task_recorded_is_within_its_budget(waiting: bool):
    """The continue-as-new worst case (tests/unit/test_payload_budgets.py, groups of 2, every
    member back) plus MAX_TASKS tasks, each with a full window and a success and a failure of
    the longest ids; or with every group instead waiting for its branch point, the rollout
    it branches from in its state."""
    c = carried(2)
    state = c.carried_state
    assert state is not None
    if waiting:
        for group in state.groups.values():
            if group.mode == RolloutMode.TRAIN:
                group.unopened = [m.rollout_id for m in group.results]
                group.results, group.seed, group.seed_from = [], None, longest_seed(1)
        state.ready = []
    state.task_outcomes = {
        10**9 + i: TaskOutcomes(
            recent="1" * OUTCOME_WINDOW, success=longest_seed(1), failure=longest_seed(0)
        )
        for i in range(MAX_TASKS)
    }
    size = payload_bytes(c.model_copy(update={"carried_state": state}))
    assert size <= PAYLOAD_LIMIT, f"{size:,} bytes"


def test_the_state_forgets_the_seed_once_the_branches_start():
    b = adaptive_book()
    open_task(b, index=0, epoch=0)
    report(b, "r.e0.t0", [1.0, 0.0, 0.0, 0.0])
    open_task(b, index=0, epoch=1)
    assert b.state.groups["r.e1.t0"].seed_from is not None
    b.open_branches("r.e1.t0", at=1)
    assert b.state.groups["r.e1.t0"].seed_from is None


def test_adaptive_needs_branching_groups():
    with pytest.raises(ValidationError, match=r"groups\.seed .adaptive. needs groups\.mode"):
        config(groups=GroupsSpec(mode="independent", seed="adaptive"))
    assert config(groups=ADAPTIVE).groups.seed == "adaptive"
    assert GroupsSpec().seed == "own"


def test_outcome_reports_count_once():
    b = adaptive_book()
    open_task(b, index=0, epoch=0)
    outcome: RolloutOutcome = result("r.e0.t0.0", 1.0)
    b.record(outcome)
    b.record(outcome)  # a duplicate report
    assert b.state.task_outcomes[0].recent == "1"
