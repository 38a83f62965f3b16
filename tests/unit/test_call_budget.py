"""An attempt's budget of model calls (MAX_CALLS_PER_ATTEMPT, issue 45): the store refuses the
call that would take the attempt past it, replayed calls counted, whichever replica writes it
(both backends; the cap lowered to 3 here); the gateway's registry turns the refusal into a
400 `calls_exhausted` and refuses the attempt's later calls before any policy server is
asked."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from darl.gateway.calls.rollouts import RolloutRegistry, calls_exhausted
from darl.gateway.errors import CallsExhaustedError
from darl.gateway.store.base import CallBudgetSpentError, TrajectoryStore
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.s3 import S3TrajectoryStore
from darl.workflows import contracts
from tests.unit.test_replay import record, request

CAP = 3


@pytest.fixture(autouse=True)
def small_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contracts, "MAX_CALLS_PER_ATTEMPT", CAP)


@pytest.fixture(params=["directory", "s3"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], TrajectoryStore]:
    """Opens a store over one place; each call is another replica sharing it."""
    if request.param == "directory":
        return lambda: DirectoryTrajectoryStore(tmp_path)
    bucket = request.getfixturevalue("s3_emulator").new_bucket()
    return lambda: S3TrajectoryStore(bucket, "budget")


def call(n: int, **fields: Any):
    return record(f"c{n}", request(f"turn {n}"), **fields)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_the_store_refuses_the_call_past_the_budget(
    open_store: Callable[[], TrajectoryStore],
) -> None:
    store = open_store()
    stored = [run(store.append(call(n))) for n in range(CAP)]
    assert [r.sequence for r in stored] == list(range(CAP))
    with pytest.raises(CallBudgetSpentError, match=f"holds {CAP} calls"):
        run(store.append(call(CAP)))
    assert [r.call_id for r in run(store.read("r", 1))] == ["c0", "c1", "c2"]
    # Another attempt has its own budget.
    assert run(store.append(call(9, attempt=2))).sequence == 0


def test_replayed_calls_count_and_replicas_share_the_budget(
    open_store: Callable[[], TrajectoryStore],
) -> None:
    a, b = open_store(), open_store()
    run(a.append(call(0, attempt=2, replayed_from="old0")))
    run(b.append(call(1, attempt=2, replayed_from="old1")))
    run(a.append(call(2, attempt=2)))
    # b's view of the attempt is one call behind: the store decides at the sequence.
    for replica, n in ((b, 3), (a, 4)):
        with pytest.raises(CallBudgetSpentError):
            run(replica.append(call(n, attempt=2)))
    assert len(run(open_store().read("r", 2))) == CAP


class NoTemporal:
    def get_workflow_handle(self, workflow_id: str) -> object:
        raise AssertionError("not asked in this test")


async def test_the_gateway_answers_calls_exhausted_and_then_refuses_before_the_policy(
    tmp_path: Path,
) -> None:
    store = DirectoryTrajectoryStore(tmp_path)
    this = RolloutRegistry(NoTemporal(), store)  # type: ignore[arg-type]
    other = RolloutRegistry(NoTemporal(), store)  # type: ignore[arg-type]
    await this.opened("r", 1)
    await other.opened("r", 1)
    numbers = itertools.count()
    for _ in range(CAP - 1):
        this.check_budget("r", 1)
        await this.record_call(call(next(numbers)))
    await other.record_call(call(next(numbers)))  # the last one, through another replica
    # This replica has not seen the store give out the last call: its check lets the call
    # through, and the store refuses it.
    this.check_budget("r", 1)
    with pytest.raises(CallsExhaustedError) as refused:
        await this.record_call(call(next(numbers)))
    err = refused.value
    assert (err.status, err.code) == (400, "calls_exhausted")
    assert err.message == (
        f"attempt 1 of rollout r made its {CAP:,} model calls, the most an attempt may make"
    )
    # From now on both refuse before any policy server would be asked.
    for registry in (this, other):
        with pytest.raises(CallsExhaustedError):
            registry.check_budget("r", 1)
    assert len(await store.read("r", 1)) == CAP


def test_the_real_budget_is_said_with_its_thousands_separated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(contracts, "MAX_CALLS_PER_ATTEMPT", 4096)
    assert calls_exhausted("rollout-7", 2).message == (
        "attempt 2 of rollout rollout-7 made its 4,096 model calls, the most an attempt may make"
    )
