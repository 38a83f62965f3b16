"""A rollout whose agent is a Temporal workflow (`agent.kind: workflow`), on Temporal's
time-skipping test server with DARL's real rollout worker: the agent workflow runs as the
rollout's child on a worker of its own task queue (the user's), gets the attempt in its memo,
and its result is the agent's report. Its timeouts, failures and the rollout's cancellation
end it as they end a process agent."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from darl.activities.worker import RolloutWorkerSettings, build_worker
from darl.workflows import search_attributes as sa
from darl.workflows.contracts import (
    RewardSpec,
    RolloutResult,
    RolloutSpec,
    RolloutTimeouts,
    WorkflowAgentSpec,
    rollout_workflow_id,
)
from darl.workflows.names import AGENT_ATTEMPT_MEMO
from darl.workflows.rollout_agent_workflow import agent_workflow_id, exit_of_result
from darl.workflows.rollout_token import decode_claims
from darl.workflows.rollout_workflow import RolloutWorkflow

TIMEOUT = 60
SECRET = b"test"


@workflow.defn(name="EchoAgent")
class EchoAgent:
    """A stand-in agent workflow: answers from its input and the memo DARL gave it, or fails,
    or never ends, as the question says."""

    @workflow.run
    async def run(self, question: Any) -> Any:
        attempt = workflow.memo_value(AGENT_ATTEMPT_MEMO, type_hint=dict)
        if question == "fail":
            raise ApplicationError("the agent's tool broke", non_retryable=True)
        if question == "hang":
            await workflow.wait_condition(lambda: False)
        if question == "huge":
            return {"final": {"answer": 7}, "reward": 10**400}
        if question == "unreadable":
            # A payload no converter of DARL's can read.
            return RawValue(Payload(metadata={"encoding": b"binary/darl-test"}, data=b"?"))
        return {"final": {"answer": 7, "echo": question}, "reward": 0.5, "attempt": attempt}


def agent_spec(**overrides: Any) -> WorkflowAgentSpec:
    values: dict[str, Any] = {
        "workflow": "EchoAgent",
        "task_queue": "user-agents",
        "input_field": "question",
        "answer_field": "final.answer",
    }
    values.update(overrides)
    return WorkflowAgentSpec(**values)


def spec(question: Any = "3 + 4", **overrides: Any) -> RolloutSpec:
    values: dict[str, Any] = {
        "run_id": "wf-agent",
        "rollout_id": f"r-{uuid.uuid4().hex[:10]}",
        "task": {"question": question, "answer": "7"},
        "agent": agent_spec(),
        "reward": RewardSpec(function="numeric_match"),
        "timeouts": RolloutTimeouts(agent_seconds=30, heartbeat_seconds=2),
    }
    values.update(overrides)
    return RolloutSpec(**values)


@asynccontextmanager
async def workers(env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[str]:
    """DARL's rollout worker, and the user's worker running the agent workflow."""
    queue = f"darl-{uuid.uuid4().hex[:8]}"
    settings = RolloutWorkerSettings(
        gateway_url="http://127.0.0.1:9",  # the stand-in agent makes no model calls
        token_secret=SECRET,
        agents_dir=tmp_path / "agents",
        task_queue=queue,
    )
    async with (
        build_worker(env.client, settings),
        # The user's worker; unsandboxed, as this test module is no module a sandbox loads.
        Worker(
            env.client,
            task_queue="user-agents",
            workflows=[EchoAgent],
            workflow_runner=UnsandboxedWorkflowRunner(),
        ),
    ):
        yield queue


async def start(
    env: WorkflowEnvironment, queue: str, s: RolloutSpec
) -> WorkflowHandle[Any, RolloutResult]:
    return await env.client.start_workflow(
        RolloutWorkflow.run, s, id=rollout_workflow_id(s.rollout_id), task_queue=queue
    )


async def run(env: WorkflowEnvironment, queue: str, s: RolloutSpec) -> RolloutResult:
    return await asyncio.wait_for((await start(env, queue, s)).result(), TIMEOUT)


async def test_the_agent_workflow_runs_as_the_rollouts_child_and_its_result_is_scored(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    env = time_skipping_env
    async with workers(env, tmp_path) as queue:
        s = spec()
        result = await run(env, queue, s)
        assert result.status == "succeeded", result.error
        assert result.reward == 1.0 and result.answer == "7"
        child = env.client.get_workflow_handle(agent_workflow_id(s.rollout_id, 1))
        described = await child.describe()
        # The Web UI shows it as the rollout's child.
        assert described.parent_id == rollout_workflow_id(s.rollout_id)
        assert described.workflow_type == "EchoAgent" and described.task_queue == "user-agents"
        output = await child.result()
        assert output["final"]["echo"] == "3 + 4"
        # The memo holds the attempt as a process agent's environment would.
        attempt = output["attempt"]
        assert attempt["base_url"] == f"http://127.0.0.1:9/rollouts/{s.rollout_id}/v1"
        assert (attempt["rollout_id"], attempt["attempt"]) == (s.rollout_id, 1)
        claims = decode_claims(attempt["token"])
        assert (claims.rollout_id, claims.attempt) == (s.rollout_id, 1)


async def test_a_reward_the_agent_workflow_reports_is_the_rollouts_reward(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    async with workers(time_skipping_env, tmp_path) as queue:
        s = spec(
            agent=agent_spec(input_field=None, answer_field="final", reward_field="reward"),
            reward=RewardSpec(),
        )
        result = await run(time_skipping_env, queue, s)
        assert result.status == "succeeded", result.error
        assert result.reward == 0.5
        # A value that is no string is the answer as JSON; the whole task was the input.
        assert result.answer is not None and '"answer": 7' in result.answer
        assert '"question": "3 + 4"' in result.answer


@pytest.mark.parametrize(
    ("agent", "why"),
    [
        (agent_spec(answer_field="final.missing"), "result has no field 'missing'"),
        (agent_spec(reward_field="final.echo"), "reward 'final.echo' is not a finite number"),
    ],
)
async def test_a_result_without_what_the_spec_names_is_the_agents_failure(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path, agent: WorkflowAgentSpec, why: str
) -> None:
    async with workers(time_skipping_env, tmp_path) as queue:
        result = await run(time_skipping_env, queue, spec(agent=agent))
        assert result.status == "failed_agent" and result.attempts == 1
        assert why in (result.error or "")


@pytest.mark.parametrize(
    ("question", "why"),
    [
        ("huge", "reward 'reward' is not a finite number"),
        ("unreadable", "the agent workflow's result is unreadable"),
    ],
)
async def test_a_result_the_rollout_cannot_use_ends_the_attempt_as_the_agents_failure(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path, question: str, why: str
) -> None:
    """Whatever the agent workflow returns, the rollout ends (never a workflow task that
    fails again and again)."""
    async with workers(time_skipping_env, tmp_path) as queue:
        s = spec(question, agent=agent_spec(reward_field="reward"))
        result = await run(time_skipping_env, queue, s)
        assert result.status == "failed_agent" and result.attempts == 1
        assert why in (result.error or "")


async def test_an_agent_workflow_that_fails_is_the_agents_failure_not_retried(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    async with workers(time_skipping_env, tmp_path) as queue:
        result = await run(time_skipping_env, queue, spec("fail"))
        assert result.status == "failed_agent" and result.attempts == 1
        assert "the agent's tool broke" in (result.error or "")


async def test_an_agent_workflow_past_the_rollout_timeout_times_out_and_is_ended(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    env = time_skipping_env
    async with workers(env, tmp_path) as queue:
        s = spec("hang", timeouts=RolloutTimeouts(agent_seconds=600, heartbeat_seconds=2))
        result = await run(env, queue, s)
        assert result.status == "timed_out", result.error
        child = await env.client.get_workflow_handle(agent_workflow_id(s.rollout_id, 1)).describe()
        assert child.status == WorkflowExecutionStatus.TIMED_OUT


async def running_child(env: WorkflowEnvironment, s: RolloutSpec) -> WorkflowHandle[Any, Any]:
    child = env.client.get_workflow_handle(agent_workflow_id(s.rollout_id, 1))
    async with asyncio.timeout(TIMEOUT):
        while True:
            with contextlib.suppress(RPCError):  # not started yet
                if (await child.describe()).status == WorkflowExecutionStatus.RUNNING:
                    return child
            await asyncio.sleep(0.05)


async def test_an_agent_workflow_cancelled_by_someone_else_is_the_agents_failure(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """Only the rollout's own cancellation cancels the rollout: an agent whose workflow was
    cancelled from outside ended without its work, which counts (no retry)."""
    env = time_skipping_env
    async with workers(env, tmp_path) as queue:
        s = spec("hang")
        handle = await start(env, queue, s)
        await (await running_child(env, s)).cancel()
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
        assert result.status == "failed_agent" and result.attempts == 1
        assert "the agent workflow was cancelled" in (result.error or "")


async def test_cancelling_the_rollout_cancels_its_agent_workflow(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    env = time_skipping_env
    async with workers(env, tmp_path) as queue:
        s = spec("hang")
        handle = await start(env, queue, s)
        child = await running_child(env, s)
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), TIMEOUT)
        # The rollout's own cancellation, not the agent's failure: cancelled, its attempt
        # closed (stop_agent closes it at the gateway).
        described = await handle.describe()
        assert described.status == WorkflowExecutionStatus.CANCELED
        assert described.typed_search_attributes.get(sa.STATUS) == "cancelled"
        history = await handle.fetch_history()
        scheduled = [
            e.activity_task_scheduled_event_attributes.activity_type.name
            for e in history.events
            if e.HasField("activity_task_scheduled_event_attributes")
        ]
        assert scheduled[-1] == "stop_agent", scheduled
        async with asyncio.timeout(TIMEOUT):
            while (await child.describe()).status == WorkflowExecutionStatus.RUNNING:
                await asyncio.sleep(0.05)
        assert (await child.describe()).status in (
            WorkflowExecutionStatus.CANCELED,
            WorkflowExecutionStatus.TERMINATED,
        )


def test_an_input_field_the_task_lacks_is_refused_when_the_spec_is_made() -> None:
    with pytest.raises(ValueError, match="input_field 'prompt' is not in the task"):
        spec(agent=agent_spec(input_field="prompt"))


def test_a_workflow_agent_cannot_be_graded_in_a_sandbox() -> None:
    with pytest.raises(ValueError, match="grader"):
        spec(reward=RewardSpec(grader={"kind": "command", "command": ["true"]}), revision=3)


async def test_the_child_timeout_is_the_rollout_timeout(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    env = time_skipping_env
    async with workers(env, tmp_path) as queue:
        s = spec(timeouts=RolloutTimeouts(agent_seconds=123, heartbeat_seconds=2))
        await run(env, queue, s)
        described = await env.client.get_workflow_handle(
            agent_workflow_id(s.rollout_id, 1)
        ).describe()
        timeout = described.raw_description.execution_config.workflow_execution_timeout
        assert timeout.ToTimedelta() == timedelta(seconds=123)


@pytest.mark.parametrize(
    "reward", [10**400, float("inf"), float("nan"), True, "1.0", [1], None], ids=repr
)
def test_a_reported_reward_that_is_no_finite_number_is_the_agents_failure(reward: Any) -> None:
    """Read as the workflow reads a completed child's result: never an exception that would
    fail the rollout's workflow task (and retry it forever)."""
    agent = agent_spec(answer_field="answer", reward_field="reward")
    ended = exit_of_result(agent, 1, {"answer": "7", "reward": reward})
    assert ended.exit_code == 1 and ended.report is None
    assert "reward 'reward' is not a finite number" in ended.log_tail


def test_a_reported_reward_and_answer_are_the_agents_report() -> None:
    agent = agent_spec(answer_field="out.0", reward_field="score")
    ended = exit_of_result(agent, 2, {"out": [42], "score": 1})
    assert ended.exit_code == 0 and ended.report is not None
    assert (ended.report.answer, ended.report.reward, ended.report.attempt) == ("42", 1.0, 2)
