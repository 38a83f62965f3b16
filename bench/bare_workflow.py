"""The floors Temporal puts under any rollout, measured on the same server right after the
training benchmark's run, so the figures compare: the server's CPU for a bare workflow that runs
one activity and completes (no search attributes, no signal, no report), and the CPU of the
Python SDK's worker that runs it, alone in a process of its own (no DARL code, the SDK's default
data converter, no tracing): what a rollout worker spends before DARL does anything.

The same bare workflow in the rollout's shape (the activity, then a local activity, as a
rollout reports to its trainer), measured next on the same worker, is the floor of what a
trained rollout costs the SDK whatever the workflow's code does: four workflow activations
(the start, the activity's result, the local activity's, the eviction), an activity and a
local activity.

The floor's worker runs on uvloop, as DARL's workers do (`darl.deploy.cli.support`): on
asyncio's own loop the SDK costs 1.0-1.5 ms more a workflow in the rollout's shape here. Given a
`tasks_file`, it also counts its CPU by thread and by kind of asyncio task while the workflows
in the rollout's shape run (`bench.task_cpu`), to set beside the rollout worker's.

    python -m bench.bare_workflow --target HOST:PORT --namespace NS --task-queue Q
runs that worker until its stdin closes (`measure_floor` starts it)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import uvloop
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from bench import task_cpu

BARE_WORKFLOW = "DarlBenchBareWorkflow"
# Where the floor's worker writes its CPU by thread and task (`bench.task_cpu`), when asked.
TASKS_FILE_ENV = "DARL_BENCH_FLOOR_TASK_CPU"
STARTS_AT_ONCE = 64
WARM_UP = 64


@activity.defn(name="darl_bench_nothing")
async def nothing() -> None:
    return None


@workflow.defn(name=BARE_WORKFLOW, sandboxed=False)
class BareWorkflow:
    @workflow.run
    async def run(self, report: bool) -> None:
        await workflow.execute_activity(nothing, start_to_close_timeout=timedelta(seconds=60))
        if report:
            # As a rollout's report: a local activity in the last workflow task.
            await workflow.execute_local_activity(
                nothing, start_to_close_timeout=timedelta(seconds=60)
            )


@dataclass(frozen=True)
class Floor:
    workflows: int
    server_cpu_seconds: float
    worker_cpu_seconds: float

    @property
    def ms_per_workflow(self) -> float:
        return 1000 * self.server_cpu_seconds / max(self.workflows, 1)

    @property
    def worker_ms_per_workflow(self) -> float:
        return 1000 * self.worker_cpu_seconds / max(self.workflows, 1)


@dataclass(frozen=True)
class Floors:
    bare: Floor  # one activity, then complete
    shaped: Floor  # in the rollout's shape: the activity, then a local activity
    # The worker's CPU by thread and task while `shaped` ran (`bench.task_cpu.minus`), when
    # measure_floor was given a tasks file.
    shaped_tasks: dict[str, Any] | None = None


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def measure_floor(
    client: Client, server_pid: int, count: int = 400, tasks_file: Path | None = None
) -> Floors:
    """Start `count` bare workflows (as the trainer starts rollouts: many at once, not waiting
    on results) on a worker in a process of its own, and wait until visibility counts them
    completed; then `count` more in the rollout's shape on the same worker (with
    `tasks_file`, counting its CPU by thread and task meanwhile)."""
    queue = f"bench-bare-{uuid.uuid4().hex[:8]}"
    # Never the rollout worker's counting (bench/worker_tasks): the floor's own, where asked.
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in (TASKS_FILE_ENV, task_cpu.WORKER_TASKS_ENV)
    }
    if tasks_file is not None:
        env[TASKS_FILE_ENV] = str(tasks_file)
    worker = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.bare_workflow",
        "--target",
        client.service_client.config.target_host,
        "--namespace",
        client.namespace,
        "--task-queue",
        queue,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        if worker.stdout is None:
            raise RuntimeError("the floor's worker has no stdout")
        async with asyncio.timeout(60):
            ready = await worker.stdout.readline()
        if ready.strip() != b"polling":
            raise RuntimeError(f"the floor's worker did not start: {ready!r}")
        server, process = psutil.Process(server_pid), psutil.Process(worker.pid)
        # Not counted: imports and caches warm up on the first workflows either shape runs.
        await _measured(client, server, process, queue, WARM_UP, report=True)
        bare = await _measured(client, server, process, queue, count, report=False)
        before = task_cpu.snapshot_now(tasks_file)
        shaped = await _measured(client, server, process, queue, count, report=True)
        after = task_cpu.snapshot_now(tasks_file)
        tasks = task_cpu.minus(after, before) if after and before else None
        return Floors(bare, shaped, tasks)
    finally:
        # Its stdin closed, the worker stops polling and leaves; one that does not is killed.
        if worker.stdin is not None:
            worker.stdin.close()
        try:
            await asyncio.wait_for(worker.wait(), 30)
        except TimeoutError:
            worker.kill()
            await worker.wait()


async def _measured(
    client: Client,
    server: psutil.Process,
    worker: psutil.Process,
    queue: str,
    count: int,
    report: bool,
) -> Floor:
    before, worker_before = server.cpu_times(), _cpu(worker)
    gate = asyncio.Semaphore(STARTS_AT_ONCE)

    async def start() -> None:
        async with gate:
            await client.start_workflow(
                BareWorkflow.run, report, id=f"{queue}-{uuid.uuid4().hex}", task_queue=queue
            )

    done = (await client.count_workflows(_completed(queue))).count
    await asyncio.gather(*(start() for _ in range(count)))
    async with asyncio.timeout(300):
        while (await client.count_workflows(_completed(queue))).count < done + count:
            await asyncio.sleep(0.5)
    after, worker_after = server.cpu_times(), _cpu(worker)
    used = (after.user + after.system) - (before.user + before.system)
    return Floor(count, used, worker_after - worker_before)


def _completed(queue: str) -> str:
    return f'TaskQueue = "{queue}" AND ExecutionStatus = "Completed"'


def report_floor(floors: Floors, rollout_server_ms: float, rollout_worker_ms: float) -> None:
    floor, shaped = floors.bare, floors.shaped
    print(
        f"Temporal server floor: a bare one-activity workflow costs "
        f"{floor.ms_per_workflow:.1f} ms of server CPU ({floor.workflows} measured after the "
        f"run, on the same server); a trained rollout costs {rollout_server_ms:.1f} ms, "
        f"{rollout_server_ms / max(floor.ms_per_workflow, 1e-9):.2f}x that"
    )
    print(
        f"Python SDK worker floor: running it costs {floor.worker_ms_per_workflow:.1f} ms of "
        f"worker CPU (a process of its own, no DARL code); the rollout worker spends "
        f"{rollout_worker_ms:.1f} ms a trained rollout, "
        f"{rollout_worker_ms / max(floor.worker_ms_per_workflow, 1e-9):.2f}x that"
    )
    print(
        f"  in the rollout's shape (the activity, then a local activity: 4 activations): "
        f"{shaped.worker_ms_per_workflow:.1f} ms of worker CPU and "
        f"{shaped.ms_per_workflow:.1f} ms of server CPU; the rollout worker spends "
        f"{rollout_worker_ms - shaped.worker_ms_per_workflow:.1f} ms more than that"
    )


async def serve(target: str, namespace: str, queue: str) -> None:
    """The floor's worker: polls `queue` until stdin closes."""
    client = await Client.connect(target, namespace=namespace)
    async with Worker(
        client,
        task_queue=queue,
        workflows=[BareWorkflow],
        activities=[nothing],
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        print("polling", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the floor's bare worker")
    parser.add_argument("--target", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--task-queue", required=True)
    args = parser.parse_args()
    if os.environ.get(TASKS_FILE_ENV):
        task_cpu.install(os.environ[TASKS_FILE_ENV])  # before the loop is made
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(args.target, args.namespace, args.task_queue))
    # The Temporal SDK's runtime can crash at interpreter exit (sdk-python #300): leave now.
    sys.stdout.flush()
    os._exit(0)
