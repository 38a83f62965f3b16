"""Workflow agents against process agents: what an agent that is a Temporal workflow costs per
model call, in Temporal's work and in CPU. Prints figures; asserts nothing.

On a stack of its own (a Temporal dev server, DARL's reference policy server with the tiny
model, the gateway, DARL's rollout worker, and the user's worker running `CountingAgent` of
tests/agents/workflow_agent.py in .venv-temporal-agents), rollouts of n model calls each, of
two kinds taking turns batch by batch so the machine's noise hits both: a process agent
(tests/agents/replay_agent.py on the OpenAI SDK, `chat`, started per attempt by the rollout
worker) and a workflow agent (the rollout's child workflow, each call a model activity through
DARL's httpx client, with an Idempotency-Key). Both send the conversation so far each turn,
answers of 4 tokens. Per model call: history events and Temporal actions
(`bench/temporal_cost.py`; the rollout's history, and the agent workflow's for a workflow
agent), CPU by process (`bench/load.py`'s per-process clocks; the agent side is the user's
worker for workflow agents, the agent processes for process agents, each its whole life);
the wall time of a rollout; the ratios; and each figure split into a fixed cost per rollout
and a cost per call, from n = the two call counts.

    .venv/bin/python -m bench.workflow_agent_bench [--calls 5 20] [--rounds 8]
        [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table
from temporalio.client import Client

from bench.load import cpu_seconds
from bench.temporal_cost import Cost, HeartbeatSchedule, add_history
from darl.activities.runners.base import agent_heartbeat_interval
from darl.deploy.devstack import connect_when_ready, register_search_attributes
from darl.workflows.contracts import (
    LocalAgentSpec,
    RewardSpec,
    RolloutResult,
    RolloutSpec,
    RolloutTimeouts,
    WorkflowAgentSpec,
    rollout_workflow_id,
)
from darl.workflows.rollout_agent_workflow import agent_workflow_id
from tests.integration.dev_server import DevServer
from tests.integration.stack import Stack
from tests.integration.test_workflow_agent_durability import AGENTS_PYTHON, UserWorker

REPO = Path(__file__).resolve().parents[1]
PROCESS_AGENT = REPO / "tests" / "agents" / "replay_agent.py"
TIMED_AGENT = REPO / "bench" / "timed_agent.py"
KINDS = ("process", "workflow")
MAX_TOKENS = 4  # CountingAgent's
TIMEOUTS = RolloutTimeouts(agent_seconds=300)
HEARTBEATS = HeartbeatSchedule(
    first_after=agent_heartbeat_interval(TIMEOUTS.heartbeat_seconds),
    every=agent_heartbeat_interval(TIMEOUTS.heartbeat_seconds),
)
AGENT_SIDE = "agent side"
# Rows of the CPU figures, in the order printed.
PROCESSES = ("temporal", "gateway", "rollout worker", AGENT_SIDE, "policy server")


@dataclass
class Cell:
    """The rollouts of one kind and call count, and what they cost."""

    rollout_ids: list[str] = field(default_factory=list)
    cpu: Counter[str] = field(default_factory=Counter)  # seconds, by process
    walls: list[float] = field(default_factory=list)
    rollout_cost: Cost = field(default_factory=Cost)
    agent_cost: Cost = field(default_factory=Cost)  # the agent workflows' histories

    def per_rollout(self) -> dict[str, float]:
        """Every figure per rollout: events, actions, CPU ms by process, wall seconds."""
        n = max(len(self.rollout_ids), 1)
        costs = (self.rollout_cost, self.agent_cost)
        figures = {
            "history events": sum(sum(c.events.values()) for c in costs) / n,
            "Temporal actions": sum(sum(c.actions.values()) for c in costs) / n,
        }
        for name in PROCESSES:
            figures[f"CPU ms: {name}"] = self.cpu[name] / n * 1000
        figures["CPU ms: all"] = sum(self.cpu[name] for name in PROCESSES) / n * 1000
        figures["wall ms (median rollout)"] = statistics.median(self.walls) * 1000
        return figures


def rollout_spec(kind: str, calls: int, user_queue: str, root: Path) -> RolloutSpec:
    rollout_id = f"bench-{kind}-{calls}-{uuid.uuid4().hex[:8]}"
    # Its own question: no rollout shares a prompt with another.
    question = f"Rollout {rollout_id}: count the letters."
    if kind == "workflow":
        agent: LocalAgentSpec | WorkflowAgentSpec = WorkflowAgentSpec(
            workflow="CountingAgent", task_queue=user_queue, answer_field="answer"
        )
    else:
        agent = LocalAgentSpec(
            command=["{python}", str(TIMED_AGENT), str(PROCESS_AGENT)],
            env={
                "PROTOCOL": "chat",
                "TURNS": str(calls),
                "MAX_TOKENS": str(MAX_TOKENS),
                "AGENT_LOG": str(root / "agent.log"),
                "AGENT_CPU_LOG": str(root / "agent-cpu.log"),
            },
        )
    return RolloutSpec(
        run_id="bench-workflow-agent",
        rollout_id=rollout_id,
        task={"question": question, "turns": calls},
        agent=agent,
        reward=RewardSpec(missing_reward=1.0),
        timeouts=TIMEOUTS,
    )


async def run_one(stack: Stack, spec: RolloutSpec, calls: int) -> float:
    """Start the rollout and wait for its result; returns its wall seconds."""
    started = time.monotonic()
    handle = await stack.start_rollout(spec)
    result: RolloutResult = await asyncio.wait_for(handle.result(), TIMEOUTS.agent_seconds)
    if result.status != "succeeded" or len(result.call_ids) != calls:
        raise RuntimeError(
            f"{spec.rollout_id}: {result.status} with {len(result.call_ids)} calls of {calls} "
            f"after {result.attempts} attempts: {result.error}"
        )
    return time.monotonic() - started


async def run_batch(
    stack: Stack, pids: dict[str, int], cell: Cell, specs: list[RolloutSpec], calls: int
) -> None:
    """Run `specs` at once; the CPU every process spent meanwhile goes to `cell`."""
    before = cpu_seconds(pids)
    walls = await asyncio.gather(*(run_one(stack, spec, calls) for spec in specs))
    after = cpu_seconds(pids)
    cell.cpu.update({name: after[name] - before[name] for name in pids})
    cell.walls += walls
    cell.rollout_ids += [spec.rollout_id for spec in specs]


async def count_histories(client: Client, kind: str, cell: Cell) -> None:
    for rollout_id in cell.rollout_ids:
        history = await client.get_workflow_handle(rollout_workflow_id(rollout_id)).fetch_history()
        add_history(cell.rollout_cost, history.events, HEARTBEATS)
        if kind == "workflow":
            agent = client.get_workflow_handle(agent_workflow_id(rollout_id, 1))
            add_history(cell.agent_cost, (await agent.fetch_history()).events, HEARTBEATS)


def add_agent_processes(cell: Cell, log: Path) -> None:
    """The process agents' own CPU, as each noted it at its end (bench/timed_agent.py)."""
    mine = set(cell.rollout_ids)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    noted = [line["cpu_seconds"] for line in lines if line["rollout"] in mine]
    if len(noted) != len(mine):
        raise RuntimeError(f"{len(noted)} agent processes noted their CPU, of {len(mine)}")
    cell.cpu[AGENT_SIDE] += sum(noted)


async def measure(
    stack: Stack, server: DevServer, user: UserWorker, calls: list[int], rounds: int, at_once: int
) -> dict[tuple[str, int], Cell]:
    if server.process is None or user.process is None:
        raise RuntimeError("measure needs the dev server and the user's worker running")
    pids = {
        "temporal": server.process.pid,
        "gateway": stack.processes["gateway"].pid,
        "rollout worker": stack.processes["worker"].pid,
        "policy server": stack.processes["policy-server"].pid,
        "user's worker": user.process.pid,
    }
    root = stack.root

    def specs(kind: str, n: int) -> list[RolloutSpec]:
        return [rollout_spec(kind, n, user.task_queue, root) for _ in range(at_once)]

    # Warm-up, not counted: the first rollouts of each kind import and cache what later ones
    # reuse (the user's worker its workflow, the gateway its routes).
    for kind in KINDS:
        await run_batch(stack, pids, Cell(), specs(kind, min(calls)), min(calls))
    cells = {(kind, n): Cell() for kind in KINDS for n in calls}
    for round_ in range(rounds):
        order = KINDS if round_ % 2 == 0 else KINDS[::-1]
        for n in calls:
            for kind in order:
                await run_batch(stack, pids, cells[kind, n], specs(kind, n), n)
        print(f"round {round_ + 1} of {rounds} done", flush=True)
    for (kind, _), cell in cells.items():
        user_worker = cell.cpu.pop("user's worker")
        if kind == "workflow":
            cell.cpu[AGENT_SIDE] = user_worker
        else:
            add_agent_processes(cell, root / "agent-cpu.log")
        await count_histories(stack.client, kind, cell)
    return cells


def ratio(workflow: float, process: float) -> str:
    return f"{workflow / process:.2f}x" if process else "-"


def report(cells: dict[tuple[str, int], Cell], calls: list[int], console: Console) -> None:
    figures = {key: cell.per_rollout() for key, cell in cells.items()}
    rollouts = len(next(iter(cells.values())).rollout_ids)
    low, high = min(calls), max(calls)
    for (kind, n), cell in sorted(cells.items()):
        print(f"\n{kind} agent, {n} calls, per rollout: Temporal actions by kind")
        for name, count in sorted((cell.rollout_cost.actions + cell.agent_cost.actions).items()):
            print(f"  {name:<48}{count / len(cell.rollout_ids):>7.2f}")
        if kind == "workflow":
            events = sum(cell.agent_cost.events.values()) / len(cell.rollout_ids)
            print(f"  (the agent workflow's own history: {events:.1f} events)")

    table = Table(title=f"Per model call ({rollouts} rollouts of each kind and call count)")
    table.add_column("figure")
    for n in calls:
        for column in (f"n={n} process", f"n={n} workflow", f"n={n} ratio"):
            table.add_column(column, justify="right")
    for name in figures["process", low]:
        row = [name if name.startswith("wall") else f"{name} / call"]
        for n in calls:
            # Wall time stays per rollout: its calls run one after another.
            per = 1 if name.startswith("wall") else n
            process = figures["process", n][name] / per
            workflow = figures["workflow", n][name] / per
            row += [f"{process:.2f}", f"{workflow:.2f}", ratio(workflow, process)]
        table.add_row(*row)
    console.print(table)

    split = Table(title=f"Fixed per rollout and per call (from n={low} and n={high})")
    for column in (
        "figure",
        "process: fixed",
        "process: per call",
        "workflow: fixed",
        "workflow: per call",
        "per call ratio",
        "fixed: workflow - process",
    ):
        split.add_column(column, justify="right" if column != "figure" else "left")
    for name in figures["process", low]:
        row = [name]
        fits = {}
        for kind in KINDS:
            a, b = figures[kind, low][name], figures[kind, high][name]
            per_call = (b - a) / (high - low)
            fits[kind] = (a - per_call * low, per_call)
            row += [f"{fits[kind][0]:.2f}", f"{per_call:.2f}"]
        row += [
            ratio(fits["workflow"][1], fits["process"][1]),
            f"{fits['workflow'][0] - fits['process'][0]:+.2f}",
        ]
        split.add_row(*row)
    console.print(split)


async def main(calls: list[int], rounds: int, at_once: int) -> None:
    if not AGENTS_PYTHON.exists():
        raise SystemExit("no .venv-temporal-agents: run `make temporal-agents` first")
    console = Console(width=180)
    with tempfile.TemporaryDirectory(prefix="darl-bench-workflow-agent-") as tmp:
        root = Path(tmp)
        server = DevServer(root)
        server.start()
        stack: Stack | None = None
        user: UserWorker | None = None
        try:
            await register_search_attributes(server.settings)
            client = await connect_when_ready(server.settings)
            stack = Stack(root / "stack", client)
            await asyncio.to_thread(stack.start)
            user = UserWorker(stack, f"bench-user-agents-{uuid.uuid4().hex[:6]}")
            await asyncio.to_thread(user.start)
            started = time.monotonic()
            cells = await measure(stack, server, user, calls, rounds, at_once)
            print(f"measured in {time.monotonic() - started:.0f} s")
        finally:
            if user is not None:
                user.stop()
            if stack is not None:
                await asyncio.to_thread(stack.stop)
            server.stop()
    report(cells, calls, console)
    print(
        "\ncommand: .venv/bin/python -m bench.workflow_agent_bench --calls "
        f"{' '.join(map(str, calls))} --rounds {rounds} --concurrency {at_once}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, nargs=2, default=[5, 20], metavar="N")
    parser.add_argument("--rounds", type=int, default=8, help="batches of each kind and n")
    parser.add_argument("--concurrency", type=int, default=4, help="rollouts a batch")
    args = parser.parse_args()
    asyncio.run(main(sorted(args.calls), args.rounds, args.concurrency))
    # The Temporal SDK's runtime can abort at interpreter exit (sdk-python #300).
    os._exit(0)
