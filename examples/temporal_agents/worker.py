"""The agent workflows' worker, as a user runs their own: a Temporal client with the SDK's
plugin for the agent's framework, and DARL's plugin beside it. Run it in .venv-temporal-agents
(`make temporal-agents`), next to the stack that trains the agent:

    python -m darl.examples.temporal_agents.worker --task-queue calculator-openai --agent openai

SIGINT or SIGTERM stops it. The OpenAI Agents SDK's tracing is off: it would send the agents'
traces to api.openai.com.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio.client import Client, Plugin
from temporalio.langgraph import LangGraphPlugin
from temporalio.openai_agents import ModelActivityParameters, OpenAIAgentsPlugin
from temporalio.worker import Worker

from darl.examples.temporal_agents.calculator import calculator
from darl.examples.temporal_agents.langgraph_agent import (
    GRAPH,
    CalculatorGraphWorkflow,
    build_graph,
)
from darl.examples.temporal_agents.openai_agent import CalculatorAgentWorkflow
from darl.temporal_agents import DarlModelProvider, DarlPlugin


@dataclass(frozen=True)
class AgentWorker:
    """What a worker of one agent registers."""

    plugins: Sequence[Plugin]
    workflows: Sequence[type]
    activities: Sequence[Callable[..., Any]]


def openai_agent() -> AgentWorker:
    # Read by the trace provider the OpenAI Agents plugin installs while the worker runs (so
    # not `set_tracing_disabled`, which tells the provider it replaces).
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    plugins = [
        OpenAIAgentsPlugin(
            model_provider=DarlModelProvider(),  # DARL: model calls go to the attempt's gateway
            # The model activity heartbeats: a worker lost mid-call has it retried in seconds.
            model_params=ModelActivityParameters(
                start_to_close_timeout=timedelta(seconds=60),
                heartbeat_timeout=timedelta(seconds=10),
            ),
        ),
        DarlPlugin(),  # DARL: the attempt, from the agent workflow's memo to its activities
    ]
    return AgentWorker(plugins, [CalculatorAgentWorkflow], [calculator])


def langgraph_agent() -> AgentWorker:
    plugins = [
        LangGraphPlugin(graphs={GRAPH: build_graph()}),
        DarlPlugin(),  # DARL: the attempt, from the agent workflow's memo to its activities
    ]
    return AgentWorker(plugins, [CalculatorGraphWorkflow], [])


AGENTS = {"openai": openai_agent, "langgraph": langgraph_agent}


async def serve(address: str, namespace: str, task_queue: str, agent: AgentWorker) -> None:
    """Run the worker until SIGINT or SIGTERM, then stop it (activities in flight are
    cancelled, and Temporal retries them on the next worker of the queue)."""
    # The default data converter: the OpenAI Agents plugin sets its own and refuses others.
    client = await Client.connect(address, namespace=namespace, plugins=agent.plugins)
    worker = Worker(
        client, task_queue=task_queue, workflows=agent.workflows, activities=agent.activities
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with worker:
        names = [w.__name__ for w in agent.workflows]
        print(f"worker ready: {names} on {task_queue!r}", flush=True)
        await stop.wait()
    print("worker stopped", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="127.0.0.1:7233", help="Temporal's frontend")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--task-queue", required=True, help="the rollout spec's task_queue")
    parser.add_argument("--agent", choices=sorted(AGENTS), required=True)
    args = parser.parse_args()
    agent = AGENTS[args.agent]()
    asyncio.run(serve(args.address, args.namespace, args.task_queue, agent))
    # The worker has stopped. Leave now: the Temporal SDK's runtime threads can crash the
    # interpreter as it finalizes (a fatal PyGILState_Release, exit status -6).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
