"""The floor a Temporal server puts under any rollout: the server's CPU for a bare workflow that
runs one activity and completes (no search attributes, no signal, no report), measured on the
same server right after the training benchmark's run, so the two figures compare."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from datetime import timedelta

import psutil
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

BARE_WORKFLOW = "DarlBenchBareWorkflow"
STARTS_AT_ONCE = 64


@activity.defn(name="darl_bench_nothing")
async def nothing() -> None:
    return None


@workflow.defn(name=BARE_WORKFLOW, sandboxed=False)
class BareWorkflow:
    @workflow.run
    async def run(self) -> None:
        await workflow.execute_activity(nothing, start_to_close_timeout=timedelta(seconds=60))


@dataclass(frozen=True)
class Floor:
    workflows: int
    server_cpu_seconds: float

    @property
    def ms_per_workflow(self) -> float:
        return 1000 * self.server_cpu_seconds / max(self.workflows, 1)


async def measure_floor(client: Client, server_pid: int, count: int = 400) -> Floor:
    """Start `count` bare workflows (as the trainer starts rollouts: many at once, not waiting
    on results) and wait until visibility counts them completed."""
    queue = f"bench-bare-{uuid.uuid4().hex[:8]}"
    server = psutil.Process(server_pid)
    async with Worker(
        client,
        task_queue=queue,
        workflows=[BareWorkflow],
        activities=[nothing],
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        before = server.cpu_times()
        gate = asyncio.Semaphore(STARTS_AT_ONCE)

        async def start() -> None:
            async with gate:
                await client.start_workflow(
                    BareWorkflow.run, id=f"{queue}-{uuid.uuid4().hex}", task_queue=queue
                )

        await asyncio.gather(*(start() for _ in range(count)))
        query = f'TaskQueue = "{queue}" AND ExecutionStatus = "Completed"'
        async with asyncio.timeout(300):
            while (await client.count_workflows(query)).count < count:
                await asyncio.sleep(0.5)
        after = server.cpu_times()
    used = (after.user + after.system) - (before.user + before.system)
    return Floor(count, used)


def report_floor(floor: Floor, rollout_server_ms: float) -> None:
    print(
        f"Temporal server floor: a bare one-activity workflow costs "
        f"{floor.ms_per_workflow:.1f} ms of server CPU ({floor.workflows} measured after the "
        f"run, on the same server); a trained rollout costs {rollout_server_ms:.1f} ms, "
        f"{rollout_server_ms / max(floor.ms_per_workflow, 1e-9):.2f}x that"
    )
