"""An attempt's budget of model calls over HTTP (MAX_CALLS_PER_ATTEMPT, issue 45): the real
gateway and policy server, the attempt's earlier calls written into the shared store as
another replica would have written them. The call past the budget is a 400
`calls_exhausted`, answered before the policy server is asked once the gateway has seen the
store give out the attempt's last call."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.workflows.contracts import MAX_CALLS_PER_ATTEMPT
from tests.integration.stack import Stack
from tests.unit.test_replay import record, request

pytestmark = pytest.mark.integration

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.gateway_url, timeout=60) as client:
        yield client


async def written_elsewhere(stack: Stack, rollout_id: str, attempt: int, calls: int) -> None:
    """`calls` calls of the attempt in the store, their events delivered, as another replica
    leaves them."""
    store = DirectoryTrajectoryStore(stack.store_dir)
    for n in range(calls):
        call = record(f"elsewhere-{n}", request(f"turn {n}"), attempt, rollout_id=rollout_id)
        await store.append(call)
    await store.mark_delivered(rollout_id, attempt, calls - 1)


def ask(stack: Stack, http: httpx.Client, rollout_id: str, attempt: int) -> httpx.Response:
    return http.post(
        f"/rollouts/{rollout_id}/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {stack.token(rollout_id, attempt)}"},
    )


def check_exhausted(response: httpx.Response, rollout_id: str, attempt: int) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "calls_exhausted"
    assert error["message"] == (
        f"attempt {attempt} of rollout {rollout_id} made its {MAX_CALLS_PER_ATTEMPT:,} model "
        "calls, the most an attempt may make"
    )


async def test_the_call_past_an_attempts_budget_is_refused_before_the_policy(
    stack: Stack, http: httpx.Client
) -> None:
    rollout_id = await stack.start_idle_rollout("budget")
    await written_elsewhere(stack, rollout_id, 1, MAX_CALLS_PER_ATTEMPT - 1)
    generated = len(stack.policy_responses())

    last = ask(stack, http, rollout_id, 1)  # the attempt's last call
    assert last.status_code == 200, last.text
    assert len(stack.policy_responses()) == generated + 1
    store = DirectoryTrajectoryStore(stack.store_dir)
    assert len(await store.read(rollout_id, 1)) == MAX_CALLS_PER_ATTEMPT

    for _ in range(2):
        check_exhausted(ask(stack, http, rollout_id, 1), rollout_id, 1)
    assert len(stack.policy_responses()) == generated + 1
    assert len(await store.read(rollout_id, 1)) == MAX_CALLS_PER_ATTEMPT


async def test_a_gateway_new_to_a_spent_attempt_wastes_one_generation_at_most(
    stack: Stack, http: httpx.Client
) -> None:
    """The budget was spent through another replica: the store refuses this gateway's first
    call after its policy server answered it (the one generation the budget may cost), and
    the next is refused before the policy server is asked."""
    rollout_id = await stack.start_idle_rollout("budget-elsewhere")
    await written_elsewhere(stack, rollout_id, 1, MAX_CALLS_PER_ATTEMPT)
    generated = len(stack.policy_responses())

    check_exhausted(ask(stack, http, rollout_id, 1), rollout_id, 1)
    assert len(stack.policy_responses()) == generated + 1
    check_exhausted(ask(stack, http, rollout_id, 1), rollout_id, 1)
    assert len(stack.policy_responses()) == generated + 1
    store = DirectoryTrajectoryStore(stack.store_dir)
    assert len(await store.read(rollout_id, 1)) == MAX_CALLS_PER_ATTEMPT
