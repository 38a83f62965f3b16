"""Agents written as Temporal workflows (OpenAI Agents, LangGraph) run on a worker with DARL's
plugin, started as DARL starts them: each model request goes to its attempt's gateway with its
token and an Idempotency-Key that a retry of the activity repeats; the workflows an agent
starts carry the attempt on; a workflow DARL did not start is left as it is."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from darl.temporal_agents import AgentAttempt, DarlModelProvider
from tests.temporal_agents import agent_workflows as wf
from tests.temporal_agents.agent_activities import add, attempt_seen
from tests.temporal_agents.conftest import AgentWorker, agent_plugins
from tests.temporal_agents.stub_gateway import SeenRequest, StubGateway


def attempt_for(gateway: StubGateway, rollout_id: str, attempt: int = 1) -> AgentAttempt:
    return AgentAttempt(
        base_url=gateway.base_url(rollout_id),
        token=f"darl1.{rollout_id}.{attempt}",
        rollout_id=rollout_id,
        attempt=attempt,
    )


async def run_agent(
    worker: AgentWorker, workflow: str, argument: Any, attempt: AgentAttempt | None
) -> wf.AgentOutcome:
    return await worker.client.execute_workflow(
        wf.RolloutStandIn.run,
        wf.StartAgent(workflow, worker.task_queue, argument, attempt),
        id=f"rollout-{uuid.uuid4().hex[:8]}",
        task_queue=worker.task_queue,
    )


def keys(seen: list[SeenRequest]) -> list[tuple[str, str, int]]:
    """Each request's Idempotency-Key split in its workflow run, activity and request number."""
    split = []
    for request in seen:
        assert request.idempotency_key is not None, request
        run_id, activity_id, n = request.idempotency_key.split("/")
        split.append((run_id, activity_id, int(n)))
    return split


def assert_all_for(seen: list[SeenRequest], attempt: AgentAttempt) -> None:
    assert seen
    for request in seen:
        assert request.path == f"/rollouts/{attempt.rollout_id}/v1/chat/completions", request
        assert request.authorization == f"Bearer {attempt.token}", request


def error_chain(error: BaseException | None) -> list[BaseException]:
    chain = []
    while error is not None:
        chain.append(error)
        error = error.__cause__
    return chain


async def test_an_openai_agent_calls_its_attempts_gateway(
    agent_worker: AgentWorker, gateway: StubGateway
) -> None:
    attempt = attempt_for(gateway, "r-openai")
    outcome = await run_agent(agent_worker, "OpenAIAgentWorkflow", "What is 2 + 3?", attempt)
    # The tool activity saw the attempt too.
    assert outcome.result == "answer to 5 for rollout r-openai"
    assert_all_for(gateway.seen, attempt)
    assert [request.status for request in gateway.seen] == [200, 200]
    (run_1, activity_1, n_1), (run_2, activity_2, n_2) = keys(gateway.seen)
    assert run_1 == run_2 == outcome.agent_run_id
    assert activity_1 != activity_2
    assert n_1 == n_2 == 1


async def test_a_retried_model_activity_repeats_its_key(
    agent_worker: AgentWorker, gateway: StubGateway
) -> None:
    attempt = attempt_for(gateway, "r-openai-retry")
    gateway.fail_next(1)
    outcome = await run_agent(agent_worker, "OpenAIAgentWorkflow", "What is 2 + 3?", attempt)
    assert outcome.result == "answer to 5 for rollout r-openai-retry"
    assert_all_for(gateway.seen, attempt)
    assert [request.status for request in gateway.seen] == [500, 200, 200]
    first_try, retry, second_call = (request.idempotency_key for request in gateway.seen)
    assert first_try == retry
    assert second_call != retry


async def test_a_langgraph_agent_calls_its_attempts_gateway(
    agent_worker: AgentWorker, gateway: StubGateway
) -> None:
    attempt = attempt_for(gateway, "r-graph", attempt=2)
    gateway.fail_next(1)
    outcome = await run_agent(agent_worker, "LangGraphAgentWorkflow", "Q", attempt)
    assert outcome.result == "answer to answer to check answer to Q"
    assert_all_for(gateway.seen, attempt)
    assert [request.status for request in gateway.seen] == [500, 200, 200, 200]
    failed, *answered = keys(gateway.seen)
    # The first node's activity failed its first request, was retried and made two; the second
    # node (a sync function, run in a thread) one, in an activity of its own.
    assert failed == answered[0]
    assert [n for _, _, n in answered] == [1, 2, 1]
    assert answered[0][1] == answered[1][1] != answered[2][1]
    assert {run_id for run_id, _, _ in answered} == {outcome.agent_run_id}


async def test_both_agents_on_one_worker_keep_their_attempts_apart(
    agent_worker: AgentWorker, gateway: StubGateway
) -> None:
    """One after the other: the time-skipping test server loses a workflow task of one of two
    parents whose children complete at the same moment (it times the parent out)."""
    openai_attempt = attempt_for(gateway, "r-one")
    graph_attempt = attempt_for(gateway, "r-two")
    await run_agent(agent_worker, "OpenAIAgentWorkflow", "What is 2 + 3?", openai_attempt)
    await run_agent(agent_worker, "LangGraphAgentWorkflow", "Q", graph_attempt)
    openai_seen, graph_seen = gateway.seen[:2], gateway.seen[2:]
    assert_all_for(openai_seen, openai_attempt)
    assert_all_for(graph_seen, graph_attempt)
    assert len(graph_seen) == 3


async def test_the_attempt_reaches_a_nested_childs_activities(
    agent_worker: AgentWorker, gateway: StubGateway
) -> None:
    attempt = attempt_for(gateway, "r-nested")
    outcome = await run_agent(agent_worker, "AttemptProbeWorkflow", 1, attempt)
    # Activity and local activity of the agent workflow, then of its child's.
    assert outcome.result == [attempt.to_value()] * 4


async def test_the_attempt_survives_a_continue_as_new_with_another_memo(
    agent_worker: AgentWorker, gateway: StubGateway
) -> None:
    attempt = attempt_for(gateway, "r-continued")
    outcome = await run_agent(agent_worker, "ContinuingProbeWorkflow", False, attempt)
    assert outcome.result == attempt.to_value()


async def test_a_workflow_darl_did_not_start_is_left_as_it_is(
    agent_worker: AgentWorker, gateway: StubGateway
) -> None:
    outcome = await run_agent(agent_worker, "AttemptProbeWorkflow", 1, None)
    assert outcome.result == [None] * 4
    with pytest.raises(WorkflowFailureError) as failure:
        await run_agent(agent_worker, "OpenAIAgentWorkflow", "What is 2 + 3?", None)
    causes = [e for e in error_chain(failure.value) if isinstance(e, ApplicationError)]
    assert "NoAgentAttempt" in [cause.type for cause in causes], causes
    assert gateway.seen == []


async def test_a_worker_without_the_plugin_says_so(
    time_skipping_env: WorkflowEnvironment, gateway: StubGateway, model_provider: DarlModelProvider
) -> None:
    plugins = agent_plugins(model_provider, darl=False)
    client = Client(**{**time_skipping_env.client.config(), "plugins": plugins})
    task_queue = f"no-darl-{uuid.uuid4().hex[:8]}"
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[wf.OpenAIAgentWorkflow, wf.RolloutStandIn],
        activities=[add, attempt_seen],
    ):
        with pytest.raises(WorkflowFailureError) as failure:
            await run_agent(
                AgentWorker(client, task_queue),
                "OpenAIAgentWorkflow",
                "What is 2 + 3?",
                attempt_for(gateway, "r-no-plugin"),
            )
    messages = [str(e) for e in error_chain(failure.value)]
    assert any("DarlPlugin" in message for message in messages), messages
    assert gateway.seen == []
