"""The test agents as Temporal workflows (run in the SDK's sandbox), and a stand-in for DARL's
RolloutWorkflow that starts one as its child with the attempt in its memo, as DARL does."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio import workflow

# Imported in the sandbox on purpose: darl.temporal_agents must be importable by workflow code.
from darl.temporal_agents import AgentAttempt
from darl.workflows.names import AGENT_ATTEMPT_MEMO

with workflow.unsafe.imports_passed_through():
    from agents import Agent, Runner
    from temporalio.langgraph import graph
    from temporalio.openai_agents.workflow import activity_as_tool

    from tests.temporal_agents.agent_activities import add, attempt_seen

GRAPH_NAME = "answer"
_SHORT = timedelta(seconds=30)


@workflow.defn
class OpenAIAgentWorkflow:
    @workflow.run
    async def run(self, question: str) -> str:
        agent = Agent(
            name="adder",
            instructions="Add with the tool, then answer.",
            model="policy",
            tools=[activity_as_tool(add, start_to_close_timeout=_SHORT)],
        )
        result = await Runner.run(agent, question)
        return str(result.final_output)


@workflow.defn
class LangGraphAgentWorkflow:
    @workflow.run
    async def run(self, question: str) -> str:
        state = await graph(GRAPH_NAME).compile().ainvoke({"question": question, "answer": ""})
        return str(state["answer"])


@workflow.defn
class AttemptProbeWorkflow:
    """The attempt its activity and local activity see, and its child's (depth > 0)."""

    @workflow.run
    async def run(self, depth: int) -> list[dict[str, Any] | None]:
        seen = [
            await workflow.execute_activity(attempt_seen, start_to_close_timeout=_SHORT),
            await workflow.execute_local_activity(attempt_seen, start_to_close_timeout=_SHORT),
        ]
        if depth > 0:
            seen += await workflow.execute_child_workflow(
                AttemptProbeWorkflow.run, depth - 1, id=f"{workflow.info().workflow_id}/probe"
            )
        return seen


@workflow.defn
class ContinuingProbeWorkflow:
    """Continues as new once, with a memo of its own in place of DARL's, then reports the
    attempt its activity sees."""

    @workflow.run
    async def run(self, continued: bool) -> dict[str, Any] | None:
        if not continued:
            workflow.continue_as_new(True, memo={"mine": 1})
        seen: dict[str, Any] | None = await workflow.execute_activity(
            attempt_seen, start_to_close_timeout=_SHORT
        )
        return seen


@dataclass(frozen=True)
class StartAgent:
    workflow: str
    task_queue: str
    argument: Any
    attempt: AgentAttempt | None


@dataclass(frozen=True)
class AgentOutcome:
    result: Any
    agent_run_id: str


@workflow.defn
class RolloutStandIn:
    """Starts the agent workflow as DARL's RolloutWorkflow does: its child, with the attempt in
    its memo (none: a workflow DARL did not start)."""

    @workflow.run
    async def run(self, start: StartAgent) -> AgentOutcome:
        attempt = start.attempt
        handle = await workflow.start_child_workflow(
            start.workflow,
            start.argument,
            id=(
                f"rollout/{attempt.rollout_id}/agent/{attempt.attempt}"
                if attempt
                else f"{workflow.info().workflow_id}/agent"
            ),
            task_queue=start.task_queue,
            memo={AGENT_ATTEMPT_MEMO: attempt.to_value()} if attempt else None,
        )
        return AgentOutcome(await handle, handle.first_execution_run_id or "")
