"""Training benchmark: the demo run on the embedded dev stack, measured. Prints figures;
asserts nothing.

One async GRPO run of the digits demo config (continue-as-new forced early, so the trainer's
history is seen across several runs) on a dev stack of its own, on ports beside the default
dev stack's. Reports per step the gateway's pause for the weight sync and rollouts per minute;
overall rollouts/s; per trained rollout its history events by type and the Temporal actions
they cost (`bench/temporal_cost.py`), and so the rollouts/s a namespace limited to 500 actions/s
sustains; each trainer run's history length; each process's CPU seconds per rollout; and the
floors under any rollout (`bench/bare_workflow.py`): the server's and an SDK worker's CPU for a
bare one-activity workflow on the same server, and the same in the rollout's shape.

    .venv/bin/python -m bench.training_bench [--steps 12] [--continue-as-new-after 1000]
        [--worker-tasks]

`--worker-tasks` also splits the rollout worker's CPU by thread and by kind of asyncio task
(`bench/task_cpu.py`; the counting costs the worker ~2-3 us a task step), and sets it beside
the floor's worker's, split the same way while it runs the workflows in the rollout's shape.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
from rich.console import Console
from temporalio.client import Client, WorkflowExecutionStatus

from bench import task_cpu
from bench.bare_workflow import Floors, measure_floor, report_floor
from bench.temporal_cost import (
    Cost,
    HeartbeatSchedule,
    ServerCounts,
    add_history,
    parse_server_counts,
    report_server,
    server_metrics_url,
)
from bench.temporal_cost import report as report_cost
from darl.activities.runners.base import agent_heartbeat_interval
from darl.deploy.demo import AGENT_SERVICE, demo_config
from darl.deploy.devstack import DevPorts, DevStack
from darl.deploy.progress import follow
from darl.deploy.temporal_connection import connect
from darl.workflows.contracts import RolloutResult
from darl.workflows.names import ROLLOUT_WORKFLOW, TRAINER_TASK_QUEUE, TRAINING_WORKFLOW
from darl.workflows.training_config import TrainingConfig, training_workflow_id
from darl.workflows.training_messages import TrainingSummary

PORTS = DevPorts(temporal=17233, ui=18233, gateway=18100, policy=18200, agent_service=18300)
RUN_TIMEOUT = 15 * 60


@dataclass(frozen=True)
class TrainerRun:
    run_id: str
    status: str
    events: int


@dataclass(frozen=True)
class Figures:
    summary: TrainingSummary
    seconds: float
    rollout_cost: Cost
    trainer_cost: Cost
    trainer_runs: list[TrainerRun]
    cpu_seconds: dict[str, float]
    server: ServerCounts | None
    # Each failed rollout's status and error: an undisturbed run should have none.
    failures: list[str]
    # Bare workflows (one activity; the rollout's shape) on the same server, after the run.
    floors: Floors
    # The rollout worker's CPU by thread and task over the run (--worker-tasks).
    worker_tasks: dict | None = None
    counted_tasks: bool = False  # --worker-tasks was asked for


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its reaped children."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def server_counts(stack: DevStack) -> ServerCounts | None:
    """The Temporal dev server's own counters, if it says where its metrics are."""
    url = server_metrics_url((stack.home / "logs" / "temporal.log").read_text(errors="replace"))
    if url is None:
        return None
    with urllib.request.urlopen(url, timeout=10) as answer:
        return parse_server_counts(answer.read().decode())


def temporal_pid(stack: DevStack) -> int:
    return next(process.pid for process in stack.processes if process.name == "temporal")


def stack_cpu(stack: DevStack) -> dict[str, float]:
    return {process.name: cpu_seconds(process.pid) for process in stack.processes}


def heartbeat_schedule(config: TrainingConfig) -> HeartbeatSchedule:
    """When await_agent calls `activity.heartbeat` for an HTTP agent: an interval in, then
    every interval (`HttpAgentRunner.wait`; the release before heartbeated at once)."""
    interval = agent_heartbeat_interval(config.rollout.timeouts.heartbeat_seconds)
    return HeartbeatSchedule(first_after=interval, every=interval)


async def rollout_cost(
    client: Client, run_id: str, sample: int, heartbeats: HeartbeatSchedule
) -> Cost:
    # Trained rollouts' histories (the newest rollouts of a run are the cancelled ones).
    query = (
        f'WorkflowType = "{ROLLOUT_WORKFLOW}" AND DarlRun = "{run_id}" '
        'AND DarlStatus = "succeeded" AND DarlMode = "train"'
    )
    cost = Cost()
    async for execution in client.list_workflows(query, limit=sample):
        handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
        add_history(cost, (await handle.fetch_history()).events, heartbeats)
    return cost


async def failures(client: Client, run_id: str) -> list[str]:
    query = (
        f'WorkflowType = "{ROLLOUT_WORKFLOW}" AND DarlRun = "{run_id}" '
        'AND DarlStatus IN ("failed_agent", "failed_infra", "timed_out")'
    )
    found = []
    async for execution in client.list_workflows(query):
        result = await client.get_workflow_handle(execution.id, result_type=RolloutResult).result()
        found.append(f"{execution.id}: {result.status} after {result.attempts}: {result.error}")
    return found


async def trainer_runs(client: Client, run_id: str, cost: Cost) -> list[TrainerRun]:
    """Every run of the trainer's continue-as-new chain, oldest first; counts their events
    and actions into `cost`."""
    workflow_id = training_workflow_id(run_id)
    executions = [e async for e in client.list_workflows(f'WorkflowId = "{workflow_id}"')]
    runs = []
    for execution in sorted(executions, key=lambda e: e.start_time):
        handle = client.get_workflow_handle(workflow_id, run_id=execution.run_id)
        status = execution.status or WorkflowExecutionStatus.RUNNING
        history = (await handle.fetch_history()).events
        add_history(cost, history, own_signals_only=True)
        runs.append(TrainerRun(execution.run_id, status.name.lower(), len(history)))
    return runs


async def measure(
    stack: DevStack, steps: int, continue_after: int, sample: int, tasks_file: Path | None
) -> Figures:
    run_id = time.strftime("bench-%m%d-%H%M%S")
    config = demo_config(stack, run_id, steps).model_copy(
        update={"continue_as_new_after_events": continue_after}
    )
    client = await connect(stack.temporal)
    print(
        f"{config.mode.value} GRPO, {config.batch_size} groups x {config.group_size} rollouts "
        f"a step, {steps} steps, continue-as-new after {continue_after} events"
    )
    tasks_before = task_cpu.snapshot_now(tasks_file)
    cpu_before = stack_cpu(stack)
    server_before = server_counts(stack)
    started = time.monotonic()
    handle = await client.start_workflow(
        TRAINING_WORKFLOW,
        config,
        id=training_workflow_id(run_id),
        task_queue=TRAINER_TASK_QUEUE,
        result_type=TrainingSummary,
    )
    async with asyncio.timeout(RUN_TIMEOUT):
        summary = await follow(handle, Console())
    seconds = time.monotonic() - started
    cpu_after = stack_cpu(stack)
    server_after = server_counts(stack)
    tasks_after = task_cpu.snapshot_now(tasks_file)
    trainer_cost = Cost()
    return Figures(
        summary=summary,
        seconds=seconds,
        rollout_cost=await rollout_cost(client, run_id, sample, heartbeat_schedule(config)),
        trainer_cost=trainer_cost,
        trainer_runs=await trainer_runs(client, run_id, trainer_cost),
        cpu_seconds={name: cpu_after[name] - cpu_before[name] for name in cpu_after},
        server=server_after.minus(server_before) if server_after and server_before else None,
        failures=await failures(client, run_id),
        floors=await measure_floor(
            client,
            temporal_pid(stack),
            tasks_file=tasks_file.with_name("floor-tasks.json") if tasks_file else None,
        ),
        worker_tasks=(
            task_cpu.minus(tasks_after, tasks_before) if tasks_after and tasks_before else None
        ),
        counted_tasks=tasks_file is not None,
    )


def report(figures: Figures, continue_after: int) -> None:
    summary, c = figures.summary, figures.summary.counters
    rollouts = c.rollouts_started
    print(
        f"\n{summary.steps} steps ({summary.reason}) in {figures.seconds:.0f}s: "
        f"{rollouts} rollouts started, {rollouts / figures.seconds:.1f} rollouts/s; "
        f"{c.rollouts_trained} trained ({c.rollouts_trained / figures.seconds:.1f}/s), "
        f"{c.rollouts_in_dropped_groups} in dropped groups ({c.groups_dropped_equal} groups "
        f"all-equal, {c.groups_dropped_stale} stale, {c.groups_dropped_small} short), "
        f"{c.rollouts_failed} failed, "
        f"{c.rollouts_cancelled} cancelled at the end, {c.rollouts_validated} validation"
    )
    for failure in figures.failures:
        print(f"  failed: {failure}")
    report_cost(figures.rollout_cost, figures.trainer_cost, rollouts)
    runs = figures.trainer_runs
    total = sum(run.events for run in runs)
    print(
        f"Trainer history: {total} events in {len(runs)} runs, "
        f"{total / max(summary.steps, 1):.0f} per step, {total / max(rollouts, 1):.2f} per "
        f"rollout; continue-as-new after {continue_after}"
    )
    for run in runs:
        print(f"  run {run.run_id}: {run.events:>6} events ({run.status})")
    print("CPU seconds per rollout, by process:")
    for name, used in sorted(figures.cpu_seconds.items(), key=lambda item: -item[1]):
        print(f"  {name:<16}{used:>8.1f} s  {used / max(rollouts, 1) * 1000:>7.1f} ms/rollout")
    used = sum(figures.cpu_seconds.values())
    print(f"  {'all':<16}{used:>8.1f} s  {used / max(rollouts, 1) * 1000:>7.1f} ms/rollout")
    if figures.server is not None:
        report_server(figures.server, rollouts)
    per_rollout = {
        name: used / max(rollouts, 1) * 1000 for name, used in figures.cpu_seconds.items()
    }
    report_floor(figures.floors, per_rollout["temporal"], per_rollout["worker"])
    if figures.worker_tasks is not None:
        task_cpu.report(figures.worker_tasks, rollouts)
        floor = figures.floors
        if floor.shaped_tasks is not None:
            task_cpu.compare(
                figures.worker_tasks, rollouts, floor.shaped_tasks, floor.shaped.workflows
            )
        else:
            print("CPU by task: the floor's worker wrote no figures in time")
    elif figures.counted_tasks:
        print(
            "CPU by task: the rollout worker wrote no figures in time (is bench/worker_tasks "
            "on its PYTHONPATH, and was it started as `worker --gateway-url ...`?)"
        )
    print(f"Rollouts/s of the run: {rollouts / figures.seconds:.1f}")


def count_worker_tasks(home: Path) -> Path:
    """Make the stack's rollout worker count its CPU by task (bench/worker_tasks): where."""
    hook = Path(__file__).resolve().parent / "worker_tasks"
    paths = [str(hook), *filter(None, [os.environ.get("PYTHONPATH")])]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    os.environ[task_cpu.WORKER_TASKS_ENV] = str(home / "worker-tasks.json")
    return home / "worker-tasks.json"


def main(steps: int, continue_after: int, sample: int, worker_tasks: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="darl-training-bench-") as home:
        stack = DevStack(Path(home), PORTS, ui=False, model="digits", agent_service=AGENT_SERVICE)
        tasks_file = count_worker_tasks(Path(home)) if worker_tasks else None
        print(f"starting the dev stack in {home} (Temporal on {PORTS.temporal})...")
        stack.start()
        try:
            figures = asyncio.run(measure(stack, steps, continue_after, sample, tasks_file))
        finally:
            stack.stop()
    report(figures, continue_after)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--continue-as-new-after", type=int, default=1000)
    parser.add_argument("--history-sample", type=int, default=20, help="rollouts to inspect")
    parser.add_argument(
        "--worker-tasks",
        action="store_true",
        help="split the rollout worker's CPU by thread and by kind of asyncio task",
    )
    args = parser.parse_args()
    main(args.steps, args.continue_as_new_after, args.history_sample, args.worker_tasks)
    # The Temporal SDK's runtime can crash at interpreter exit (sdk-python #300): leave now.
    sys.stdout.flush()
    os._exit(0)
