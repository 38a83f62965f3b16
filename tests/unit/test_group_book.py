"""GroupBook, the TrainingWorkflow's pure book of GRPO groups, on its own: where each rollout
ends up (trained, dropped with its group and why, failed, cancelled, validated, left over),
duplicate and unknown reports, the room for new groups, batches and their statistics, and
the count of failures in a row. The workflow tests drive it through Temporal; these pin each
rule directly."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from darl.workflows import training_groups
from darl.workflows.contracts import HttpAgentSpec, RolloutMode, RolloutOutcome, RolloutResult
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.training_config import (
    BackendSpec,
    DatasetSpec,
    RolloutSettings,
    TrainingConfig,
    TrainingMode,
    WeightSyncSettings,
)
from darl.workflows.training_groups import GroupBook
from darl.workflows.training_state import Counters, Knobs, TaskRow, TrainingState

GROUP = 4


def config(**overrides: object) -> TrainingConfig:
    values: dict[str, object] = {
        "run_id": "r",
        "dataset": DatasetSpec(path="tasks.jsonl"),
        "rollout": RolloutSettings(agent=HttpAgentSpec(url="http://127.0.0.1:9/agent")),
        "backend": BackendSpec(model_dir="model"),
        "weight_sync": WeightSyncSettings(
            gateway_admin_url="http://127.0.0.1:9", policy_servers=["http://127.0.0.1:9"]
        ),
        "group_size": GROUP,
        "batch_size": 2,
        "mode": TrainingMode.ASYNC,
    }
    values.update(overrides)
    return TrainingConfig(**values)  # type: ignore[arg-type]


def book(**overrides: object) -> GroupBook:
    c = config(**overrides)
    # As the workflow starts a run: the knobs begin as the config's.
    return GroupBook(c, TrainingState(knobs=c.knobs))


def open_train_group(b: GroupBook, position: int = 0) -> list[str]:
    specs = b.open_groups(
        [TaskRow(epoch=0, position=position, task={"q": position})],
        RolloutMode.TRAIN,
        GROUP,
        now=0.0,
    )
    return [s.rollout_id for s in specs]


def result(
    rollout_id: str,
    reward: float | None = 1.0,
    status: RolloutStatus = RolloutStatus.SUCCEEDED,
    mode: RolloutMode = RolloutMode.TRAIN,
) -> RolloutOutcome:
    return RolloutResult(
        run_id="r",
        rollout_id=rollout_id,
        group_id=rollout_id.rsplit(".", 1)[0],
        mode=mode,
        status=status,
        reward=reward,
        attempts=1,
        completion_tokens=3,
    ).outcome()


def assert_accounted(c: Counters, inflight: int = 0) -> None:
    assert c.ended() + inflight == c.rollouts_started, c


def test_a_group_is_ready_when_its_last_member_reports_and_trains_once():
    b = book()
    ids = open_train_group(b)
    assert b.state.counters.rollouts_started == GROUP and b.inflight() == GROUP
    for rollout_id, reward in zip(ids[:-1], [0.0, 1.0, 0.5], strict=True):
        b.record(result(rollout_id, reward))
    assert b.state.ready == [] and b.inflight() == 1
    b.record(result(ids[-1], 1.0))
    assert b.state.ready == ["r.e0.t0"] and b.inflight() == 0
    assert not b.batch_ready()
    open_train_group(b, position=1)
    for rollout_id in b.pending_rollouts():
        b.record(result(rollout_id, 0.0 if rollout_id.endswith(".0") else 1.0))
    assert b.batch_ready()
    groups, stats = b.take_batch()
    assert [g.group_id for g in groups] == ["r.e0.t0", "r.e0.t1"]
    assert [len(g.members) for g in groups] == [GROUP, GROUP]
    assert stats.rollouts == 2 * GROUP and stats.groups == 2
    assert stats.reward_mean == pytest.approx((2.5 + 3.0) / 8)
    assert stats.success_rate == pytest.approx(5 / 8)
    assert stats.response_tokens_mean == 3 and stats.staleness_mean == 0
    assert b.state.ready == [] and b.state.groups == {}
    assert b.state.counters.rollouts_trained == 2 * GROUP
    assert_accounted(b.state.counters)


def test_failed_members_are_counted_never_trained_as_reward_zero():
    b = book(min_group_size=3, batch_size=1)
    ids = open_train_group(b)
    b.record(result(ids[0], None, RolloutStatus.FAILED_AGENT))
    for rollout_id in ids[1:]:
        b.record(result(rollout_id, 1.0 if rollout_id.endswith(".1") else 0.0))
    assert b.state.ready == ["r.e0.t0"]
    assert b.state.counters.rollouts_failed == 1
    groups, _ = b.take_batch()
    assert [m.rollout_id for m in groups[0].members] == ids[1:]


@pytest.mark.parametrize(
    ("rewards", "overrides", "counter"),
    [
        ([1.0, None, None, 0.0], {}, "groups_dropped_small"),
        ([1.0, 1.0, 1.0, 1.0], {}, "groups_dropped_equal"),
    ],
)
def test_a_group_too_small_or_with_equal_rewards_is_dropped(rewards, overrides, counter):
    b = book(**overrides)
    ids = open_train_group(b)
    for rollout_id, reward in zip(ids, rewards, strict=True):
        status = RolloutStatus.SUCCEEDED if reward is not None else RolloutStatus.TIMED_OUT
        b.record(result(rollout_id, reward, status))
    counters = b.state.counters
    assert b.state.ready == [] and b.state.groups == {}
    assert getattr(counters, counter) == 1
    assert counters.rollouts_in_dropped_groups == sum(r is not None for r in rewards)
    assert_accounted(counters)


def test_equal_rewards_train_when_the_config_says_so():
    b = book(equal_reward_groups="train")
    for rollout_id in open_train_group(b):
        b.record(result(rollout_id, 1.0))
    assert b.state.ready == ["r.e0.t0"] and b.state.counters.groups_dropped_equal == 0


def test_a_group_older_than_max_staleness_is_dropped_when_ready_and_when_it_completes():
    b = book(knobs=Knobs(max_staleness=1))
    first = open_train_group(b)
    for rollout_id in first:
        b.record(result(rollout_id, float(rollout_id.endswith(".0"))))
    second = open_train_group(b, position=1)
    b.state.policy_version = 2
    b.drop_stale()
    assert b.state.ready == [] and b.state.counters.groups_dropped_stale == 1
    for rollout_id in second:
        b.record(result(rollout_id, float(rollout_id.endswith(".0"))))
    assert b.state.counters.groups_dropped_stale == 2
    assert_accounted(b.state.counters)


def test_sync_mode_keeps_no_group_from_an_earlier_version():
    b = book(mode=TrainingMode.SYNC)
    for rollout_id in open_train_group(b):
        b.record(result(rollout_id, float(rollout_id.endswith(".0"))))
    b.state.policy_version = 1
    b.drop_stale()
    assert b.state.counters.groups_dropped_stale == 1


def test_duplicate_and_unknown_reports_change_nothing_but_their_counters():
    b = book()
    ids = open_train_group(b)
    b.record(result(ids[0]))
    b.record(result(ids[0]))
    b.record(result("r.e9.t9.0"))
    counters = b.state.counters
    assert counters.duplicate_reports == 1 and counters.unknown_reports == 1
    assert b.inflight() == GROUP - 1
    assert counters.ended() == 0 and counters.rollouts_started == GROUP


def test_a_report_again_after_its_group_trained_is_a_duplicate_not_a_stranger():
    """A rollout's last workflow task retried after its report went out reports again, maybe
    after its group was trained: the book knows the group by its id (behind the cursor)."""
    b = book()
    ids = open_train_group(b, position=0)
    b.state.epoch, b.state.cursor = 0, 1  # as read_tasks leaves it
    for rollout_id in ids:
        b.record(result(rollout_id, float(rollout_id.endswith(".0"))))
    b.take_batch()
    assert "r.e0.t0" not in b.state.groups
    b.record(result(ids[1]))
    b.record(result("r.e0.t1.0"))  # not read yet: a stranger
    b.record(result("r.v0.t0.0", mode=RolloutMode.VAL))  # step 0 was validated
    b.record(result("r.v1.t0.0", mode=RolloutMode.VAL))  # step 1 is to come
    b.record(result("other.e0.t0.0"))
    counters = b.state.counters
    assert counters.duplicate_reports == 2 and counters.unknown_reports == 3


def test_a_rollout_lost_without_a_report_is_an_infra_failure():
    b = book()
    ids = open_train_group(b)
    b.record_lost(ids[0], "terminated")
    b.record_lost("r.e9.t9.0", "a stranger: ignored")
    assert b.state.counters.rollouts_failed == 1
    assert "terminated" in (b.state.last_failure or "")
    assert b.inflight() == GROUP - 1


def test_cancelled_rollouts_and_left_over_groups_are_accounted():
    b = book()
    ids = open_train_group(b)
    for rollout_id in ids[:2]:
        b.record(result(rollout_id, 0.0 if rollout_id.endswith(".0") else 1.0))
    for rollout_id in ids[2:]:
        b.record(result(rollout_id, None, RolloutStatus.CANCELLED))
    counters = b.state.counters
    assert counters.rollouts_cancelled == 2 and counters.rollouts_failed == 0
    ready = open_train_group(b, position=1)
    for rollout_id in ready:
        b.record(result(rollout_id, float(rollout_id.endswith(".0"))))
    b.close()
    assert counters.rollouts_left_over == GROUP and b.state.groups == {}
    assert_accounted(counters)


def test_validation_groups_count_as_validated_and_join_their_steps_record():
    b = book()
    specs = b.open_groups([TaskRow(epoch=0, position=0, task={})], RolloutMode.VAL, 2, now=0)
    assert [s.rollout_id for s in specs] == ["r.v0.t0.0", "r.v0.t0.1"]
    for spec in specs:
        b.record(result(spec.rollout_id, 1.0, mode=RolloutMode.VAL))
    assert b.state.counters.rollouts_validated == 2 and b.state.groups == {}
    assert b.inflight(RolloutMode.TRAIN) == 0


def test_room_follows_the_knobs_the_mode_and_pause():
    b = book(knobs=Knobs(max_inflight=10))
    assert b.room(busy=False) == 10 // GROUP
    open_train_group(b)
    assert b.room(busy=True) == (10 - GROUP) // GROUP
    b.state.paused = True
    assert b.room(busy=False) == 0
    s = book(mode=TrainingMode.SYNC)
    assert s.room(busy=False) == 2
    open_train_group(s)
    assert s.room(busy=False) == 1 and s.room(busy=True) == 0
    done = book(total_steps=3)
    done.state.step = 3
    assert done.room(busy=False) == 0


def test_the_state_holds_at_most_max_held_rollouts_whatever_the_knobs(
    monkeypatch: pytest.MonkeyPatch,
):
    """Rollouts out, and rollouts back waiting for their group's step, all count against the
    state's budget (MAX_HELD): past it no group starts, until a step takes its batch."""
    monkeypatch.setattr(training_groups, "MAX_HELD", 3 * GROUP)
    b = book(knobs=Knobs(max_inflight=100 * GROUP), batch_size=2)
    ids = open_train_group(b)
    for rollout_id in ids:
        b.record(result(rollout_id, float(rollout_id.endswith(".1"))))
    assert b.state.ready == ["r.e0.t0"] and b.inflight() == 0
    assert b.room(busy=False) == 2
    open_train_group(b, position=1)
    open_train_group(b, position=2)
    assert b.room(busy=False) == 0
    for rollout_id in b.pending_rollouts():
        b.record(result(rollout_id, float(rollout_id.endswith(".1"))))
    assert b.room(busy=False) == 0 and b.batch_ready()
    b.take_batch()
    assert b.room(busy=False) == 2


def test_a_step_must_fit_the_states_budget():
    with pytest.raises(ValidationError, match="must fit the 2,048 rollouts"):
        config(batch_size=256, group_size=8)
    config(batch_size=255, group_size=8)
    with pytest.raises(ValidationError, match="at most 64 characters"):
        config(run_id="r" * 65)


def test_failures_in_a_row_trip_the_breaker_and_a_success_resets_them():
    b = book(max_failed_rollouts_in_a_row=3)
    ids = open_train_group(b)
    for rollout_id in ids[:2]:
        b.record(result(rollout_id, None, RolloutStatus.FAILED_AGENT))
    assert not b.failing()
    b.record(result(ids[2], 1.0))
    assert b.state.failed_in_a_row == 0
    more = open_train_group(b, position=1)
    for rollout_id in more[:3]:
        b.record(result(rollout_id, None, RolloutStatus.FAILED_INFRA))
    assert b.failing() and "3 rollouts in a row failed" in b.failing_message()


def test_a_book_rebuilt_from_its_state_knows_who_is_out():
    """The state crosses continue-as-new as data: a new book over it finds every pending
    rollout's group."""
    b = book()
    ids = open_train_group(b)
    b.record(result(ids[0]))
    again = GroupBook(b.config, TrainingState.model_validate(b.state.model_dump()))
    assert sorted(again.pending_rollouts()) == sorted(ids[1:])
    for rollout_id in ids[1:]:
        again.record(result(rollout_id, float(rollout_id.endswith(".1"))))
    assert again.state.ready == ["r.e0.t0"]
    assert again.state.counters.rollouts_started == GROUP


def test_resumed_rollouts_are_counted_once():
    """Rule 10: a rollout whose final attempt replayed a lost one's calls, and whether its
    replay ended before the record did; a duplicate report counts nothing again."""
    b = book()
    ids = open_train_group(b)
    resumed = result(ids[0]).model_copy(update={"attempts": 2, "replayed_calls": 5})
    diverged = result(ids[1]).model_copy(
        update={"attempts": 2, "replayed_calls": 3, "replay_diverged_at": 3}
    )
    for report in (resumed, diverged, resumed):
        b.record(report)
    c = b.state.counters
    assert (c.rollouts_resumed, c.calls_replayed, c.replays_diverged) == (2, 8, 1)
