"""`make demo` (until training lands): the embedded stack runs a batch of example rollouts of
real OpenAI-SDK agents through the capturing gateway against the tiny reference model, then
shows what each rollout did and where to look, and stops the stack."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from urllib.parse import quote

from rich.console import Console
from rich.table import Table

import examples.arithmetic
from deploy.devstack import DevStack
from workflows.contracts import (
    ROLLOUT_TASK_QUEUE,
    LocalAgentSpec,
    RewardSpec,
    RolloutResult,
    RolloutSpec,
    RolloutTimeouts,
    rollout_workflow_id,
)
from workflows.rollout_status import RolloutStatus
from workflows.rollout_workflow import RolloutWorkflow
from workflows.temporal_connection import connect

TASKS = Path(examples.arithmetic.__file__).parent / "tasks.jsonl"
AGENTS = {
    "single-turn": ("examples.arithmetic.agent", {}),
    "calculator": ("examples.arithmetic.calculator_agent", {}),
    "calculator-stream": ("examples.arithmetic.calculator_agent", {"AGENT_STREAM": "1"}),
}


def demo_specs(run_id: str, count: int) -> list[tuple[str, RolloutSpec]]:
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines()]
    names = list(AGENTS)
    specs = []
    for i in range(count):
        name = names[i % len(names)]
        module, env = AGENTS[name]
        task = tasks[i % len(tasks)]
        specs.append(
            (
                name,
                RolloutSpec(
                    run_id=run_id,
                    rollout_id=f"{run_id}-{i:03d}",
                    group_id=task["id"],
                    task=task,
                    agent=LocalAgentSpec(command=["{python}", "-m", module], env=env),
                    reward=RewardSpec(function="numeric_match"),
                    timeouts=RolloutTimeouts(agent_seconds=120, heartbeat_seconds=10),
                ),
            )
        )
    return specs


async def run_batch(stack: DevStack, specs: list[RolloutSpec]) -> list[RolloutResult]:
    client = await connect(stack.temporal)
    handles = [
        await client.start_workflow(
            RolloutWorkflow.run,
            spec,
            id=rollout_workflow_id(spec.rollout_id),
            task_queue=ROLLOUT_TASK_QUEUE,
        )
        for spec in specs
    ]
    return [await asyncio.wait_for(handle.result(), 300) for handle in handles]


def show(
    console: Console,
    run_id: str,
    named: list[tuple[str, RolloutSpec]],
    results: list[RolloutResult],
    stack: DevStack,
    seconds: float,
) -> None:
    table = Table(title=f"DARL demo run {run_id}")
    for column in ("rollout", "agent", "status", "reward", "calls", "tokens", "seconds"):
        table.add_column(
            column,
            justify="right" if column in {"reward", "calls", "tokens", "seconds"} else "left",
        )
    for (agent, _), result in zip(named, results, strict=True):
        style = "green" if result.status == RolloutStatus.SUCCEEDED else "red"
        table.add_row(
            result.rollout_id.removeprefix(f"{run_id}-"),
            agent,
            f"[{style}]{result.status.value}[/{style}]",
            "-" if result.reward is None else f"{result.reward:g}",
            str(result.calls),
            str(result.prompt_tokens + result.completion_tokens),
            f"{result.duration_seconds:.1f}",
        )
    console.print(table)
    succeeded = [r for r in results if r.status == RolloutStatus.SUCCEEDED]
    calls = sum(r.calls for r in results)
    rewards = [r.reward for r in succeeded if r.reward is not None]
    console.print(
        f"{len(succeeded)}/{len(results)} rollouts succeeded in {seconds:.1f}s; "
        f"{calls} model calls captured with their token ids under "
        f"{stack.home / 'trajectories'}; mean reward "
        f"{(sum(rewards) / len(rewards)) if rewards else 0:.2f} (the tiny model is untrained)."
    )
    if stack.ui_url:
        query = quote(f'DarlRun="{run_id}"')
        console.print(
            f"Web UI: {stack.ui_url}/namespaces/default/workflows?query={query}", soft_wrap=True
        )
    console.print(f"Logs: {stack.home / 'logs'}", soft_wrap=True)


def run_demo(stack: DevStack, rollouts: int) -> int:
    console = Console()
    run_id = time.strftime("demo-%m%d-%H%M%S")
    named = demo_specs(run_id, rollouts)
    with console.status("starting Temporal, the policy server, the gateway and a worker..."):
        stack.start()
    try:
        started = time.monotonic()
        with console.status(f"running {rollouts} rollouts..."):
            results = asyncio.run(run_batch(stack, [spec for _, spec in named]))
        show(console, run_id, named, results, stack, time.monotonic() - started)
    finally:
        with console.status("stopping the stack..."):
            stack.stop()
    failed = [r for r in results if r.status != RolloutStatus.SUCCEEDED]
    return 1 if failed else 0
