"""Branching GRPO groups (`groups.mode: branch`, issue 26) on the trainer's side: the GroupBook
opens a seed, then its branches with the seed's prefix; each `branch_at` rule picks its k;
broken branches are dropped or kept; a seed that cannot branch makes an ordinary group; the
state survives continue-as-new as data; the config refuses what cannot work; the surprisal
activity reads the seed from a real store; and the trainer's rows mask the prefix, token for
token."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from pydantic import ValidationError
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from darl.activities.training_activities import TrainerActivities
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.trainer.aggregation import (
    AggregationCounters,
    AggregationSettings,
    RolloutSample,
    rollout_rows,
)
from darl.workflows.contracts import (
    HttpAgentSpec,
    PrefixSpec,
    RolloutMode,
    RolloutOutcome,
    RolloutResult,
)
from darl.workflows.names import BRANCH_POINT_ERROR
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.training_config import (
    BackendSpec,
    DatasetSpec,
    GroupsSpec,
    RolloutSettings,
    TrainingConfig,
    TrainingMode,
    WeightSyncSettings,
)
from darl.workflows.training_groups import GroupBook, can_branch
from darl.workflows.training_messages import BranchPointRequest
from darl.workflows.training_state import Counters, Knobs, TaskRow, TrainingState
from tests.unit.test_aggregation import conversation, tokens_of

GROUP = 4
GROUP_ID = "r.e0.t0"
SEED = f"{GROUP_ID}.0"
BRANCHES = [f"{GROUP_ID}.{k}" for k in range(1, GROUP)]


def config(**overrides: Any) -> TrainingConfig:
    values: dict[str, Any] = {
        "run_id": "r",
        "dataset": DatasetSpec(path="tasks.jsonl"),
        "rollout": RolloutSettings(agent=HttpAgentSpec(url="http://127.0.0.1:9/agent")),
        "backend": BackendSpec(model_dir="model"),
        "weight_sync": WeightSyncSettings(
            gateway_admin_url="http://127.0.0.1:9", policy_servers=["http://127.0.0.1:9"]
        ),
        "group_size": GROUP,
        "batch_size": 1,
        "mode": TrainingMode.ASYNC,
        "groups": GroupsSpec(mode="branch", branch_at="fraction"),
    }
    values.update(overrides)
    return TrainingConfig(**values)


def book(**overrides: Any) -> GroupBook:
    c = config(**overrides)
    return GroupBook(c, TrainingState(knobs=c.knobs))


def open_group(b: GroupBook, position: int = 0) -> list[str]:
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
    calls: int = 5,
    status: RolloutStatus = RolloutStatus.SUCCEEDED,
    prefix_calls: int = 0,
    diverged_at: int | None = None,
    attempts: int = 1,
) -> RolloutOutcome:
    return RolloutResult(
        run_id="r",
        rollout_id=rollout_id,
        group_id=rollout_id.rsplit(".", 1)[0],
        mode=RolloutMode.TRAIN,
        status=status,
        reward=reward,
        attempts=attempts,
        calls=calls,
        completion_tokens=3,
        call_ids=[f"{rollout_id}-c{i}" for i in range(calls)],
        prefix_calls=prefix_calls,
        prefix_diverged_at=diverged_at,
    ).outcome()


def assert_accounted(c: Counters, inflight: int = 0) -> None:
    assert c.ended() + inflight == c.rollouts_started, c


def branch(b: GroupBook, at: int | None) -> list[str]:
    """As the workflow's brancher does once the seed has reported."""
    assert b.to_branch() == [GROUP_ID]
    specs = b.open_branches(GROUP_ID, at)
    return [s.rollout_id for s in specs]


# --- the group's way: seed, then branches -----------------------------------------------


def test_a_group_opens_its_seed_then_its_branches_from_the_seeds_prefix():
    b = book()
    assert open_group(b) == [SEED]
    counters = b.state.counters
    assert counters.rollouts_started == 1 and b.inflight() == 1
    assert b.to_branch() == [] and b.awaiting_branches()
    b.record(result(SEED, 1.0, calls=5, attempts=2))
    assert b.inflight() == 0 and b.state.ready == [] and b.to_branch() == [GROUP_ID]
    specs = b.open_branches(GROUP_ID, 2)
    assert [s.rollout_id for s in specs] == BRANCHES
    for spec in specs:
        assert spec.prefix == PrefixSpec(rollout_id=SEED, attempt=2, calls=2)
        assert spec.row.task == {"q": 0} and spec.group_id == GROUP_ID
    assert b.state.groups[GROUP_ID].branch_point == 2
    assert counters.rollouts_started == GROUP and counters.groups_branched == 1
    assert b.to_branch() == [] and not b.awaiting_branches()
    for rollout_id, reward in zip(BRANCHES, [0.0, 1.0, 0.0], strict=True):
        b.record(result(rollout_id, reward, prefix_calls=2))
    assert b.state.ready == [GROUP_ID] and counters.branch_calls_replayed == 6
    groups, stats = b.take_batch()
    masked = {m.rollout_id: m.masked_calls for m in groups[0].members}
    assert masked == {SEED: 2, **dict.fromkeys(BRANCHES, 2)}
    assert stats.rollouts == GROUP
    assert_accounted(counters)


def test_the_seeds_prefix_trains_when_the_config_says_so():
    b = book(groups=GroupsSpec(mode="branch", train_seed_prefix=True))
    open_group(b)
    b.record(result(SEED, 1.0))
    for rollout_id in branch(b, 3):
        b.record(result(rollout_id, 0.0, prefix_calls=3))
    groups, _ = b.take_batch()
    assert [m.masked_calls for m in groups[0].members] == [0, 3, 3, 3]


def test_independent_groups_are_as_before():
    b = book(groups=GroupsSpec())
    ids = open_group(b)
    assert ids == [SEED, *BRANCHES] and not b.awaiting_branches()
    for rollout_id in ids:
        b.record(result(rollout_id, float(rollout_id.endswith(".0"))))
    groups, _ = b.take_batch()
    assert [m.masked_calls for m in groups[0].members] == [0] * GROUP


def test_validation_groups_never_branch():
    b = book(groups=GroupsSpec(mode="branch"))
    specs = b.open_groups([TaskRow(epoch=0, position=0, task={})], RolloutMode.VAL, 2, now=0)
    assert [s.rollout_id for s in specs] == ["r.v0.t0.0", "r.v0.t0.1"]
    assert not b.awaiting_branches()


# --- the branch point ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "calls", "k"),
    [(0.5, 6, 3), (0.5, 5, 2), (0.1, 5, 1), (0.99, 4, 3), (0.6, 2, 1), (0.75, 8, 6)],
)
def test_fraction_is_the_share_of_the_seeds_calls_rounded_within_one_and_n_minus_one(
    fraction: float, calls: int, k: int
):
    spec = GroupsSpec(mode="branch", branch_at="fraction", fraction=fraction)
    assert spec.branch_point(calls, random.Random(0)) == k


def test_uniform_draws_every_call_but_the_first_from_the_random_it_is_given():
    spec = GroupsSpec(mode="branch", branch_at="uniform")
    drawn = [spec.branch_point(5, random.Random(seed)) for seed in range(200)]
    assert set(drawn) == {1, 2, 3, 4}
    assert drawn == [spec.branch_point(5, random.Random(seed)) for seed in range(200)]
    assert spec.branch_point(2, random.Random(7)) == 1


def test_surprisal_picks_the_most_surprising_call_after_the_first_earliest_on_a_tie():
    pick = GroupsSpec.highest_surprisal
    assert pick([9.0, 0.1, 0.7, 0.3]) == 2  # the first call is no branch point
    assert pick([0.0, 0.5, 0.5, 0.2]) == 1
    assert pick([0.3, 0.0]) == 1
    with pytest.raises(ValueError, match="1 calls cannot branch"):
        pick([1.0])
    with pytest.raises(ValueError, match="chosen from the seed's records"):
        GroupsSpec(mode="branch", branch_at="surprisal").branch_point(4, random.Random(0))


def test_a_branch_point_outside_the_seeds_calls_is_refused():
    """DARL's own fault (the workflow checks the points it is given): a typed, non-retryable
    failure of the run, not a plain exception that fails every workflow-task retry."""
    b = book()
    open_group(b)
    b.record(result(SEED, calls=3))
    with pytest.raises(ApplicationError, match=r"outside calls 1\.\.2") as refused:
        b.open_branches(GROUP_ID, 3)
    assert refused.value.type == BRANCH_POINT_ERROR and refused.value.non_retryable


async def test_the_surprisal_activity_reads_the_seed_from_the_store(tmp_path: Path):
    store = DirectoryTrajectoryStore(tmp_path)
    # Each answer token of call c has logprob -(c*100 + i + 1)/1000: later calls surprise
    # more, so the last call is the branch point.
    records = conversation([("fresh", [1], [2, 3]), ("extend", [4], [5]), ("extend", [6], [7])])
    for record in records:
        await store.append(record)
    async with httpx.AsyncClient() as http:
        # The activity reads the store only; it never reaches Temporal.
        activities = TrainerActivities(cast(Any, None), store, tmp_path, "key", http)
        ids = [r.call_id for r in records]
        request = BranchPointRequest(rollout_id="r1", attempt=1, calls=3, digest=digest(ids))
        point = await ActivityEnvironment().run(activities.choose_branch_point, request)
        assert point.at == 2
        assert point.surprisal == pytest.approx([0.0015, 0.101, 0.201])
        # The seed's first two calls only (a later call, recorded after its close, is not
        # part of it); then records that are not what the seed committed: no branch point.
        first_two = request.model_copy(update={"calls": 2, "digest": digest(ids[:2])})
        point = await ActivityEnvironment().run(activities.choose_branch_point, first_two)
        assert point.at == 1 and len(point.surprisal) == 2
        for lost in (
            request.model_copy(update={"calls": 4, "digest": digest([*ids, "r1-c9"])}),
            request.model_copy(update={"digest": digest([ids[1], ids[0], ids[2]])}),
        ):
            lacking = await ActivityEnvironment().run(activities.choose_branch_point, lost)
            assert lacking.at is None and lacking.surprisal == []
        # A request of an earlier release names the calls.
        named = BranchPointRequest(rollout_id="r1", attempt=1, call_ids=ids)
        point = await ActivityEnvironment().run(activities.choose_branch_point, named)
        assert point.at == 2


def digest(call_ids: list[str]) -> str:
    return hashlib.sha256("\n".join(call_ids).encode()).hexdigest()


# --- broken branches, seeds that cannot branch, the group's rules ------------------------


@pytest.mark.parametrize("broken", ["drop", "keep"])
def test_a_broken_branch_is_dropped_or_kept_with_the_calls_it_reproduced(broken: str):
    b = book(groups=GroupsSpec(mode="branch", broken_branches=broken), min_group_size=3)
    open_group(b)
    b.record(result(SEED, 1.0))
    first, second, third = branch(b, 3)
    b.record(result(first, 0.0, prefix_calls=3))
    b.record(result(second, 1.0, prefix_calls=1, diverged_at=1))
    b.record(result(third, 0.0, prefix_calls=3))
    counters = b.state.counters
    assert counters.branches_broken == 1 and counters.branch_calls_replayed == 7
    groups, _ = b.take_batch()
    masked = {m.rollout_id: m.masked_calls for m in groups[0].members}
    if broken == "drop":
        assert masked == {SEED: 3, first: 3, third: 3}
        assert counters.rollouts_broken_branches == 1
    else:
        assert masked == {SEED: 3, first: 3, second: 1, third: 3}
        assert counters.rollouts_broken_branches == 0
    assert_accounted(counters)


def test_dropped_broken_branches_can_make_a_group_too_small():
    b = book(min_group_size=3)
    open_group(b)
    b.record(result(SEED, 1.0))
    for rollout_id in branch(b, 2):
        b.record(result(rollout_id, 0.0, prefix_calls=0, diverged_at=0))
    counters = b.state.counters
    assert b.state.ready == [] and counters.groups_dropped_small == 1
    assert counters.rollouts_in_dropped_groups == 1 and counters.rollouts_broken_branches == 3
    assert_accounted(counters)


@pytest.mark.parametrize(
    "seed",
    [
        result(SEED, 1.0, calls=1),
        result(SEED, None, calls=4, status=RolloutStatus.FAILED_AGENT),
    ],
    ids=["one call", "failed"],
)
def test_a_seed_that_cannot_branch_makes_an_ordinary_group(seed: RolloutOutcome):
    """The workflow passes no branch point for such a seed (`can_branch`): its members start
    whole, and the group trains as an independent one."""
    b = book(min_group_size=3)
    open_group(b)
    b.record(seed)
    assert not can_branch(seed)
    specs = b.open_branches(GROUP_ID, None)
    assert [s.prefix for s in specs] == [None] * 3
    for spec, reward in zip(specs, [0.0, 1.0, 1.0], strict=True):
        b.record(result(spec.rollout_id, reward))
    counters = b.state.counters
    assert counters.seeds_not_branched == 1 and counters.groups_branched == 0
    groups, _ = b.take_batch()
    members = groups[0].members
    assert all(m.masked_calls == 0 for m in members)
    assert len(members) == (4 if seed.reward is not None else 3)
    assert_accounted(counters)


def test_a_group_that_went_stale_while_its_seed_ran_is_dropped_unbranched():
    b = book(knobs=Knobs(max_staleness=1))
    open_group(b)
    b.record(result(SEED, 1.0))
    b.state.policy_version = 2
    assert b.open_branches(GROUP_ID, 2) == []
    counters = b.state.counters
    assert counters.groups_dropped_stale == 1 and counters.rollouts_in_dropped_groups == 1
    assert b.state.groups == {} and not b.awaiting_branches()
    assert_accounted(counters)


def test_a_branching_group_holds_room_for_its_branches_from_its_start():
    b = book(knobs=Knobs(max_inflight=9))
    assert b.room(busy=False) == 2
    open_group(b)
    assert b.inflight() == 1 and b.room(busy=False) == 1
    b.record(result(SEED, 1.0))
    assert b.inflight() == 0 and b.room(busy=False) == 1
    branch(b, 1)
    assert b.room(busy=False) == (9 - 4) // GROUP  # 3 branches out, the seed back
    s = book(mode=TrainingMode.SYNC, batch_size=2)
    open_group(s)
    s.record(result(SEED, 1.0))
    assert s.inflight_groups() == 1 and s.room(busy=False) == 1


def test_a_run_that_ends_before_the_branches_start_counts_the_seed_left_over():
    b = book()
    open_group(b)
    b.record(result(SEED, 1.0))
    b.close()
    counters = b.state.counters
    assert counters.rollouts_left_over == 1 and b.state.groups == {}
    assert_accounted(counters)


def test_the_book_survives_continue_as_new_as_data():
    """The state goes through Temporal as JSON: a group waiting for its branches, one with
    its branches out, and the branch point, all come back."""
    b = book()
    open_group(b)
    open_group(b, position=1)
    b.record(result(SEED, 1.0, calls=6))
    b.record(result("r.e0.t1.0", 1.0, calls=4))
    specs = b.open_branches("r.e0.t1", 3)
    carried = TrainingState.model_validate_json(b.state.model_dump_json())
    again = GroupBook(b.config, carried)
    assert again.to_branch() == [GROUP_ID]
    assert sorted(again.pending_rollouts()) == sorted(s.rollout_id for s in specs)
    assert carried.groups["r.e0.t1"].branch_point == 3
    assert [s.prefix for s in again.open_branches(GROUP_ID, 4)] == [
        PrefixSpec(rollout_id=SEED, attempt=1, calls=4)
    ] * 3
    for rollout_id in again.pending_rollouts():
        again.record(result(rollout_id, float(rollout_id.endswith(".1")), prefix_calls=2))
    assert again.state.ready == ["r.e0.t1", GROUP_ID]
    branched = {g.group_id: g.branch_point for g in again.state.groups.values()}
    assert branched == {GROUP_ID: 4, "r.e0.t1": 3}
    trained = [again.take_batch()[0][0] for _ in range(2)]
    assert [[m.masked_calls for m in g.members] for g in trained] == [[3, 2, 2, 2], [4, 2, 2, 2]]
    assert again.state.counters.groups_branched == 2
    assert_accounted(again.state.counters)


# --- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"group_size": 1, "min_group_size": None}, "groups.mode 'branch' needs group_size 2"),
        ({"groups": {"mode": "branch", "fraction": 1.0}}, "less than 1"),
        ({"groups": {"mode": "branch", "fraction": 0}}, "greater than 0"),
        ({"groups": {"mode": "tree"}}, "'independent' or 'branch'"),
        ({"groups": {"mode": "branch", "branch_at": "entropy"}}, "'uniform', 'surprisal'"),
        ({"groups": {"mode": "branch", "broken": "drop"}}, "Extra inputs are not permitted"),
    ],
)
def test_the_config_refuses_groups_that_cannot_work(overrides: dict, message: str):
    with pytest.raises(ValidationError, match=message):
        config(**overrides)


def test_the_default_groups_are_independent():
    plain = config(groups=GroupsSpec())
    assert plain.groups == GroupsSpec(mode="independent")
    assert TrainingConfig.model_validate_json(plain.model_dump_json()) == plain


# --- the trainer's rows mask the prefix, token for token --------------------------------


def masked_sample(masked: int) -> tuple[RolloutSample, list]:
    records = conversation(
        [
            ("fresh", [1, 2], [3, 4]),
            ("extend", [5], [6]),
            ("extend", [7], [8, 9]),
            ("extend", [10], [11]),
        ],
        rollout="b1",
    )
    return RolloutSample("b1", "g", 1.0, records, masked_calls=masked), records


def test_trajectory_rows_keep_the_prefix_as_context_never_trained():
    """The prefix's calls make no row: the first call after them starts the row, its prompt
    holding them as context, so they take no room in the response."""
    sample, records = masked_sample(2)
    counters = AggregationCounters()
    (row,) = rollout_rows(sample, AggregationSettings(max_response_length=1000), counters)
    lp = [r.completion_logprobs() for r in records]
    assert row.prompt_ids == records[2].prompt_token_ids == [10000, 1, 2, 3, 4, 5, 6, 7]
    assert tokens_of(row) == [
        (8, 1, lp[2][0]), (9, 1, lp[2][1]),  # call 2: sampled again, trained
        (10, 0, 0.0),
        (11, 1, lp[3][0]),
    ]  # fmt: skip
    assert counters.prefix_masked_calls == 2 and counters.empty_rows == 0
    assert counters.merge_mismatches == 0
    # The same tokens as the unmasked row, in the prompt instead of the response.
    (unmasked,) = rollout_rows(
        RolloutSample("b1", "g", 1.0, records), AggregationSettings(), AggregationCounters()
    )
    assert row.prompt_ids + row.response_ids == unmasked.prompt_ids + unmasked.response_ids


def test_transition_rows_make_no_row_of_a_masked_call():
    sample, records = masked_sample(3)
    counters = AggregationCounters()
    rows = rollout_rows(sample, AggregationSettings(mode="transition"), counters)
    (row,) = rows
    assert row.prompt_ids == records[3].prompt_token_ids
    assert tokens_of(row) == [(11, 1, records[3].completion_logprobs()[0])]  # type: ignore[index]
    assert counters.prefix_masked_calls == 3 and counters.empty_rows == 0
    assert counters.calls == 4 and counters.rows == 1


def test_a_fully_masked_rollout_makes_no_row_and_no_empty_row():
    sample, _ = masked_sample(4)
    counters = AggregationCounters()
    assert rollout_rows(sample, AggregationSettings(), counters) == []
    assert counters.prefix_masked_calls == 4 and counters.empty_rows == 0
