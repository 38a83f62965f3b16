"""RolloutWorkflow on Temporal's time-skipping test server, when things go wrong that are not
the agent's doing (rule 7) and when its input cannot work (rule 9): an agent that failed
after DARL's gateway failed it gets a fresh attempt; a workflow under another id, or with a
spec that does not validate, fails at once with the reason (it never loops on a failing task).
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from darl.workflows.contracts import AgentExit, AgentReport, RewardSpec, RolloutTimeouts
from darl.workflows.names import ROLLOUT_WORKFLOW
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.rollout_workflow import RolloutWorkflow
from tests.workflow.failures import validation_failure
from tests.workflow.test_rollout_workflow import TIMEOUT, StubAgents, spec, start, stub_worker

OUTAGE = "the gateway gateway was killed and was down 3.2s from 10:00:00"


def retrying_spec(**overrides: object):
    values: dict = {
        "reward": RewardSpec(missing_reward=0.0),
        "timeouts": RolloutTimeouts(agent_seconds=30, heartbeat_seconds=2, retry_backoff_seconds=5),
    }
    return spec(**{**values, **overrides})


@pytest.mark.parametrize(
    "failed",
    [
        AgentExit(exit_code=1, log_tail="ConnectError", infra_incidents=[OUTAGE]),
        AgentExit(exit_code=0, infra_incidents=["503 the gateway stayed paused for more than 5s"]),
    ],
    ids=["crashed-in-an-outage", "no-reward-after-a-gateway-503"],
)
async def test_an_agent_failed_by_darl_gets_a_fresh_attempt(
    time_skipping_env: WorkflowEnvironment, failed: AgentExit
) -> None:
    stubs = StubAgents()
    stubs.exits = {1: failed}
    stubs.release.set()
    s = retrying_spec(reward=RewardSpec())  # the agent reports its reward itself
    stubs.exit_report = AgentReport(reward=1.0)
    async with stub_worker(time_skipping_env, stubs) as queue:
        handle = await start(time_skipping_env, s, queue)
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
    assert [a for _, a in stubs.launches] == [1, 2]
    assert result.status == RolloutStatus.SUCCEEDED
    assert (result.attempts, result.reward) == (2, 1.0)


async def test_an_agent_that_fails_on_its_own_is_not_retried(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """The control: the same failure with no incident is the agent's result."""
    stubs = StubAgents()
    stubs.exits = {1: AgentExit(exit_code=1, log_tail="ValueError")}
    stubs.release.set()
    async with stub_worker(time_skipping_env, stubs) as queue:
        result = await asyncio.wait_for(
            (await start(time_skipping_env, retrying_spec(), queue)).result(), TIMEOUT
        )
    assert [a for _, a in stubs.launches] == [1]
    assert result.status == RolloutStatus.FAILED_AGENT


async def test_failed_by_darl_on_every_attempt_is_an_infra_failure(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    stubs = StubAgents()
    stubs.exits = {a: AgentExit(exit_code=1, infra_incidents=[OUTAGE]) for a in (1, 2)}
    stubs.release.set()
    async with stub_worker(time_skipping_env, stubs) as queue:
        result = await asyncio.wait_for(
            (await start(time_skipping_env, retrying_spec(max_attempts=2), queue)).result(),
            TIMEOUT,
        )
    assert result.status == RolloutStatus.FAILED_INFRA
    assert result.attempts == 2
    assert OUTAGE in (result.error or "")
    assert result.reward is None


async def test_a_rollout_under_another_workflow_id_fails_at_once(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    stubs = StubAgents()
    s = spec()
    async with stub_worker(time_skipping_env, stubs) as queue:
        handle = await time_skipping_env.client.start_workflow(
            RolloutWorkflow.run, s, id=f"my-own-id-{uuid.uuid4().hex[:6]}", task_queue=queue
        )
        with pytest.raises(WorkflowFailureError) as failure:
            await asyncio.wait_for(handle.result(), TIMEOUT)
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "WrongWorkflowId"
    assert f"rollout/{s.rollout_id}" in cause.message
    assert stubs.launches == []  # no agent ran


async def test_a_spec_that_does_not_validate_fails_at_once(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """What `temporal workflow start --input` could send: plain JSON, missing fields."""
    stubs = StubAgents()
    async with stub_worker(time_skipping_env, stubs) as queue:
        handle = await time_skipping_env.client.start_workflow(
            ROLLOUT_WORKFLOW,
            {"run_id": "bad", "task": {}, "agent": {"kind": "local"}},
            id="rollout/bad-spec",
            task_queue=queue,
        )
        cause = await validation_failure(handle, TIMEOUT)
    assert "rollout_id" in cause.message and "Field required" in cause.message
    assert "exactly one of 'command' and 'entrypoint'" in cause.message
    assert stubs.launches == []


async def test_a_rollout_stops_retrying_before_its_history_outgrows_temporals_limit(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """Attempts failed by DARL, each leaving ~1.9 MB in the history (incidents at the edge
    of a payload): the rollout ends with its failure once another attempt could carry the
    history past Temporal's 50 MB, where the server would have ended it, report and all."""
    big = OUTAGE + "; " + "x" * 1_900_000
    stubs = StubAgents()
    stubs.exits = {a: AgentExit(exit_code=1, infra_incidents=[big]) for a in range(1, 21)}
    stubs.release.set()
    async with stub_worker(time_skipping_env, stubs) as queue:
        handle = await start(time_skipping_env, retrying_spec(max_attempts=20), queue)
        result = await asyncio.wait_for(handle.result(), TIMEOUT * 4)
        size = (await handle.describe()).raw_description.workflow_execution_info.history_size_bytes
    assert result.status == RolloutStatus.FAILED_INFRA
    assert 2 < result.attempts < 20, result.attempts
    assert f"no attempt after {result.attempts}: the rollout's history holds" in (
        result.error or ""
    )
    assert size < 50 * 1024 * 1024
    assert len(result.error or "") < 2_000  # the incidents it quotes, cut
