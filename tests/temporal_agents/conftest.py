"""Fixtures of the workflow-agent tests: Temporal's time-skipping test server (default data
converter, as an agent's worker has), a stub gateway, and one worker with the SDK's OpenAI
Agents and LangGraph plugins and DARL's plugin. They run in .venv-temporal-agents; the main
suite's venv lacks the SDK's integrations and leaves these files to that run."""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

if importlib.util.find_spec("temporalio.openai_agents") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    # The SDK's trace exporter would send the attempt's token to api.openai.com.
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    import pytest
    from temporalio.client import Client
    from temporalio.langgraph import LangGraphPlugin
    from temporalio.openai_agents import ModelActivityParameters, OpenAIAgentsPlugin
    from temporalio.testing import WorkflowEnvironment
    from temporalio.worker import Worker

    from darl.temporal_agents import DarlModelProvider, DarlPlugin
    from tests.temporal_agents import agent_workflows as wf
    from tests.temporal_agents.agent_activities import add, answer_graph, attempt_seen
    from tests.temporal_agents.stub_gateway import StubGateway

    @dataclass(frozen=True)
    class AgentWorker:
        client: Client
        task_queue: str

    @pytest.fixture
    async def time_skipping_env() -> AsyncIterator[WorkflowEnvironment]:
        """One per test, as the main suite's: a shared one can carry a time-skipping lock one
        test left held into the next."""
        env = await WorkflowEnvironment.start_time_skipping(
            test_server_existing_path=str(Path(sys.executable).parent / "temporal-test-server")
        )
        yield env
        await env.shutdown()

    @pytest.fixture
    def gateway() -> Iterator[StubGateway]:
        stub = StubGateway().start()
        yield stub
        stub.stop()

    @pytest.fixture
    async def model_provider() -> AsyncIterator[DarlModelProvider]:
        """No retries in the OpenAI client: a failed request fails its activity."""
        provider = DarlModelProvider(max_retries=0)
        yield provider
        await provider.aclose()

    def agent_plugins(model_provider: DarlModelProvider, *, darl: bool = True) -> list[object]:
        """The SDK's two agent plugins (their model provider DARL's) and, unless told, DARL's."""
        openai_agents = OpenAIAgentsPlugin(
            model_params=ModelActivityParameters(start_to_close_timeout=timedelta(seconds=30)),
            model_provider=model_provider,
        )
        langgraph = LangGraphPlugin(graphs={wf.GRAPH_NAME: answer_graph()})
        return [openai_agents, langgraph, *([DarlPlugin()] if darl else [])]

    @pytest.fixture
    async def agent_worker(
        time_skipping_env: WorkflowEnvironment, model_provider: DarlModelProvider
    ) -> AsyncIterator[AgentWorker]:
        """One worker, on its own queue, for the agents and the rollout stand-in."""
        config = time_skipping_env.client.config()
        client = Client(**{**config, "plugins": agent_plugins(model_provider)})
        task_queue = f"agents-{uuid.uuid4().hex[:8]}"
        async with Worker(
            client,
            task_queue=task_queue,
            workflows=[
                wf.OpenAIAgentWorkflow,
                wf.LangGraphAgentWorkflow,
                wf.AttemptProbeWorkflow,
                wf.ContinuingProbeWorkflow,
                wf.RolloutStandIn,
            ],
            activities=[add, attempt_seen],
        ):
            yield AgentWorker(client, task_queue)
