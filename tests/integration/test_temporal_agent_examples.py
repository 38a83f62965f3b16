"""The workflow agents of examples/temporal_agents end to end: the example worker, a real process
in .venv-temporal-agents as a user runs it, runs the OpenAI Agents SDK agent and the LangGraph
agent for rollouts started from the shipped specs, against the real Temporal dev server,
gateway, policy server and rollout worker. Each rollout succeeds and is scored; its model
calls, made by the agent workflow's model activities, are recorded token-exactly and merge into
one training row; SIGTERM stops the worker."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import WorkflowExecutionStatus

from darl.deploy.processes import ManagedProcess
from darl.workflows.contracts import RolloutSpec
from darl.workflows.rollout_status import RolloutStatus
from tests.integration.protocol_checks import assert_token_exact, trajectory_counters
from tests.integration.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
AGENTS_PYTHON = ROOT / ".venv-temporal-agents" / "bin" / "python"
EXAMPLES = ROOT / "examples" / "temporal_agents"
AGENTS = ("openai", "langgraph")
READY_SECONDS = 60
ROLLOUT_SECONDS = 180

pytestmark = pytest.mark.skipif(
    not AGENTS_PYTHON.exists(), reason="needs .venv-temporal-agents (make temporal-agents)"
)


def agent_worker(stack: Stack, agent: str, task_queue: str) -> ManagedProcess:
    """The example worker of `agent` on `task_queue`, started and polling."""
    argv = [str(AGENTS_PYTHON), "-m", "darl.examples.temporal_agents.worker"]
    argv += ["--address", stack.client.service_client.config.target_host]
    argv += ["--task-queue", task_queue, "--agent", agent]
    log = stack.root / "logs" / f"agent-worker-{agent}-{task_queue}.log"
    process = ManagedProcess(f"agent-worker-{agent}", argv, log, env=dict(os.environ)).start()
    deadline = time.monotonic() + READY_SECONDS
    while "worker ready" not in process.log_tail():
        if not process.running() or time.monotonic() > deadline:
            process.stop()
            raise AssertionError(f"the {agent} worker did not start:\n{process.log_tail()}")
        time.sleep(0.1)
    return process


@pytest.fixture(scope="module")
def task_queues(stack: Stack) -> Iterator[dict[str, str]]:
    """A worker per agent, on a queue of this module's own (the dev server is the session's)."""
    queues = {agent: f"calculator-{agent}-{uuid.uuid4().hex[:8]}" for agent in AGENTS}
    workers = [agent_worker(stack, agent, queue) for agent, queue in queues.items()]
    yield queues
    for worker in workers:
        worker.stop()


def shipped_spec(agent: str, task_queue: str) -> RolloutSpec:
    spec = RolloutSpec.model_validate(json.loads((EXAMPLES / f"rollout_{agent}.json").read_text()))
    return spec.model_copy(
        update={
            "rollout_id": f"{spec.rollout_id}-{uuid.uuid4().hex[:8]}",
            "agent": spec.agent.model_copy(update={"task_queue": task_queue}),
        }
    )


async def test_each_agent_workflow_runs_a_rollout_from_its_shipped_spec(
    stack: Stack, task_queues: dict[str, str]
) -> None:
    specs = [shipped_spec(agent, task_queues[agent]) for agent in AGENTS]
    handles = [await stack.start_rollout(spec) for spec in specs]
    done = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), ROLLOUT_SECONDS)

    assert [r.status for r in done] == [RolloutStatus.SUCCEEDED] * 2, [r.error for r in done]
    served = stack.policy_responses()
    for agent, spec, result in zip(AGENTS, specs, done, strict=True):
        assert result.reward in (0.0, 1.0), (agent, result)
        child = stack.client.get_workflow_handle(f"rollout/{spec.rollout_id}/agent/1")
        assert (await child.describe()).status == WorkflowExecutionStatus.COMPLETED, agent
        records = stack.store().read_sync(result.rollout_id, call_ids=result.call_ids)
        # The first call is forced to the calculator; the model answers after its result.
        assert len(records) >= 2, (agent, result)
        assert records[0].response["choices"][0]["message"]["tool_calls"], agent
        assert_token_exact(records, served)
        counters = trajectory_counters(records)
        assert (counters.rows, counters.merge_mismatches) == (1, 0), (agent, result.rollout_id)


def test_the_worker_stops_on_sigterm(stack: Stack) -> None:
    worker = agent_worker(stack, "openai", f"calculator-stop-{uuid.uuid4().hex[:8]}")
    assert worker.stop(grace=30) == 0, worker.log_tail()
    assert "worker stopped" in worker.log_tail()
