"""A stand-in agent written as a Temporal workflow, and the user's worker that runs it (in
.venv-temporal-agents, with DARL's plugin): `CountingAgent` asks the model `turns` times, each
call a model activity whose request goes through DARL's httpx client, and waits for its `go`
signal before turn `pause_after` (so a test can kill a worker at a known call). Not an example:
the examples (examples/temporal_agents/) are the agents a user writes.

    python -m tests.agents.workflow_agent --address HOST:PORT --task-queue Q --ready-file F
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity, workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from openai import AsyncOpenAI

    from darl.temporal_agents import DarlPlugin, darl_async_httpx_client

# A model activity's try: a worker killed mid-call is noticed by the server after this long,
# and the activity is retried on the worker that is left (or started again).
MODEL_TRY_SECONDS = 5
MODEL_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=200),
    backoff_coefficient=1.5,
    maximum_interval=timedelta(seconds=2),
)


_clients: list[AsyncOpenAI] = []


def model_client() -> AsyncOpenAI:
    """One client per worker, as a user's worker keeps one (made in the first activity, not
    when the workflow sandbox loads this module): DARL's httpx client sends each request to
    the attempt of the activity that makes it (the URL and key here are never used)."""
    if not _clients:
        _clients.append(
            AsyncOpenAI(
                base_url="http://model.invalid/v1",
                api_key="unused",
                max_retries=0,
                http_client=darl_async_httpx_client(timeout=60),  # type: ignore[arg-type]
            )
        )
    return _clients[0]


@activity.defn
async def ask_model(messages: list[dict[str, str]]) -> str:
    """One model call, as a user's activity makes it."""
    answer = await model_client().chat.completions.create(
        model="policy",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
    )
    return answer.choices[0].message.content or ""


@workflow.defn(name="CountingAgent")
class CountingAgent:
    def __init__(self) -> None:
        self._go = False
        self._answered = 0

    @workflow.run
    async def run(self, task: dict[str, Any]) -> dict[str, Any]:
        messages = [{"role": "user", "content": str(task["question"])}]
        text = ""
        for turn in range(int(task["turns"])):
            if turn == task.get("pause_after"):
                await workflow.wait_condition(lambda: self._go)
            text = await workflow.execute_activity(
                ask_model,
                messages,
                start_to_close_timeout=timedelta(seconds=MODEL_TRY_SECONDS),
                retry_policy=MODEL_RETRY,
            )
            self._answered += 1
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"turn {turn}: go on."},
            ]
        return {"answer": text, "turns": self._answered}

    @workflow.signal
    def go(self) -> None:
        self._go = True

    @workflow.query
    def answered(self) -> int:
        return self._answered


async def serve(address: str, task_queue: str, ready_file: Path) -> None:
    from temporalio.client import Client
    from temporalio.worker import Worker

    # The one line DARL asks of a user's worker: its plugin.
    client = await Client.connect(address, plugins=[DarlPlugin()])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker = Worker(
        client, task_queue=task_queue, workflows=[CountingAgent], activities=[ask_model]
    )
    async with worker:
        ready_file.write_text("ready")
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--task-queue", required=True)
    parser.add_argument("--ready-file", type=Path, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.address, args.task_queue, args.ready_file))


if __name__ == "__main__":
    main()
