"""The rollout worker's own share of a rollout, against the Python SDK's floor, in one run: one
process runs up to four workers (`--workers`) on one dev server, and the same number of
workflows goes to each in turn, the order alternating, while the process's CPU is read:

- `floor`: the bare workflow in the rollout's shape (`bench.bare_workflow`: an activity, then a
  local activity), the SDK's default data converter, no tracing, no DARL code;
- `context`: RolloutWorkflow as the rollout worker runs it where no span is exported (DARL's
  data converter and tracing plugin; the workflow hands the trace header its starter sent
  on, as a rollout the trainer started does);
- `spans`: the same, its workflows making their spans as this worker's did before
  `WorkflowContext` (sampled off, as the provider `darl worker` installs where nothing exports
  samples them; the activities run in the context they are sent either way);
- `sandboxed`: `context` in Temporal's sandbox (`rollout_workflow_runner(sandboxed=True)`),
  which gives each workflow a fresh import of its module and checks its calls.

The rollout's activities are stand-ins that return at once (no agent, no gateway): what is
measured is the workflow side, DARL's and the SDK's. The workflows are started from a process
of their own, whose CPU is not counted, as the trainer starts rollouts (a trace context sent,
the search attributes set, a trainer to report to). Nothing exports: the bench unsets the
OTEL_ variables.

    python -m bench.worker_bench [--workflows 300] [--rounds 6] [--workers context sandboxed]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import inspect
import os
import statistics
import sys
import uuid
from collections import Counter
from pathlib import Path
from unittest import mock

import uvloop
from temporalio import activity
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from bench.bare_workflow import BareWorkflow, nothing
from bench.load import cpu_seconds, start_dev_server
from darl.activities.rollout_activities import current_traceparent
from darl.activities.worker import rollout_workflow_runner
from darl.deploy import telemetry, temporal_tracing
from darl.deploy.temporal_connection import TemporalSettings, connect
from darl.workflows import search_attributes as sa
from darl.workflows.contracts import (
    CURRENT_REVISION,
    AgentExit,
    AgentReport,
    AwaitRequest,
    HttpAgentSpec,
    RolloutReport,
    RolloutSpec,
    rollout_workflow_id,
)
from darl.workflows.names import AWAIT_AGENT, REPORT_ROLLOUT
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.rollout_workflow import RolloutWorkflow

FLOOR, CONTEXT, SPANS, SANDBOXED = "floor", "context", "spans", "sandboxed"
WORKERS = (FLOOR, CONTEXT, SPANS, SANDBOXED)
STARTS_AT_ONCE = 64
# Per task queue: the stand-in agents that ran in a trace context (as an agent gets its
# TRACEPARENT), and all of them.
in_a_trace: Counter[str] = Counter()
agents: Counter[str] = Counter()


@activity.defn(name=AWAIT_AGENT)
async def stand_in_agent(request: AwaitRequest) -> AgentExit:
    """A stand-in for await_agent: an agent that finished with a reward, at once."""
    queue = activity.info().task_queue
    agents[queue] += 1
    in_a_trace[queue] += current_traceparent() is not None
    return AgentExit(exit_code=0, report=AgentReport(attempt=request.attempt, reward=1.0))


@activity.defn(name=REPORT_ROLLOUT)
async def stand_in_report(report: RolloutReport) -> None:
    """A stand-in for report_rollout: a trainer that took the report."""


async def start(target: str, queue: str, count: int, tag: str) -> None:
    """Start `count` workflows on `queue` as the trainer starts rollouts (through DARL's
    client, each start sending a trace context), and wait until visibility counts them
    completed."""
    telemetry.configure_tracing("darl-worker-bench-starter")
    client = await connect(TemporalSettings(address=target))
    gate = asyncio.Semaphore(STARTS_AT_ONCE)

    async def one(i: int) -> None:
        rollout_id = f"{tag}-{i}"
        async with gate:
            if queue == FLOOR:
                await client.start_workflow(
                    BareWorkflow.run, True, id=rollout_workflow_id(rollout_id), task_queue=queue
                )
                return
            spec = RolloutSpec(
                run_id="worker-bench",
                rollout_id=rollout_id,
                task={"question": "What is 2 + 2?"},
                agent=HttpAgentSpec(url="http://127.0.0.1:9/stand-in"),
                report_to="worker-bench-trainer",
                revision=CURRENT_REVISION,
            )
            await client.start_workflow(
                RolloutWorkflow.run,
                spec,
                id=rollout_workflow_id(rollout_id),
                task_queue=queue,
                search_attributes=sa.rollout_attributes(spec, RolloutStatus.PENDING.value),
            )

    await asyncio.gather(*(one(i) for i in range(count)))
    done = f'ExecutionStatus = "Completed" AND WorkflowId STARTS_WITH "{rollout_workflow_id(tag)}-"'
    async with asyncio.timeout(300):
        while (await client.count_workflows(done)).count < count:
            await asyncio.sleep(0.2)


async def measure(count: int, rounds: int, names: list[str]) -> dict[str, list[float]]:
    """ms of this process's CPU a workflow, per worker (of `names`) and round."""
    # The provider `darl worker` installs where nothing exports: spans are made, not sampled.
    telemetry.configure_tracing("darl-worker-bench")
    env = await start_dev_server()
    target = env.client.service_client.config.target_host
    try:
        darl_client = await connect(TemporalSettings(address=target))
        workers: dict[str, Worker] = {}
        for name in names:
            if name == FLOOR:
                workers[name] = Worker(
                    await Client.connect(target),
                    task_queue=FLOOR,
                    workflows=[BareWorkflow],
                    activities=[nothing],
                    workflow_runner=UnsandboxedWorkflowRunner(),
                )
                continue
            # The workflow interceptor is chosen when the worker is built, by whether the
            # process drops its spans; it does here, and the `spans` worker is told otherwise.
            with mock.patch.object(temporal_tracing, "drops_spans", return_value=name != SPANS):
                workers[name] = Worker(
                    darl_client,
                    task_queue=name,
                    workflows=[RolloutWorkflow],
                    activities=[stand_in_agent, stand_in_report],
                    workflow_runner=rollout_workflow_runner(sandboxed=name == SANDBOXED),
                )
        used: dict[str, list[float]] = {name: [] for name in names}
        me = {"worker": os.getpid()}
        async with contextlib.AsyncExitStack() as running:
            for worker in workers.values():
                await running.enter_async_context(worker)
            for round_ in range(rounds):
                order = list(used) if round_ % 2 == 0 else list(reversed(used))
                for name in order:
                    before = cpu_seconds(me)["worker"]
                    starter = await asyncio.create_subprocess_exec(
                        sys.executable,
                        "-m",
                        "bench.worker_bench",
                        "--start",
                        target,
                        name,
                        str(count),
                        f"{name}-{round_}-{uuid.uuid4().hex[:6]}",
                    )
                    if await starter.wait() != 0:
                        raise RuntimeError(f"starting the {name} workflows failed")
                    used[name].append(1000 * (cpu_seconds(me)["worker"] - before) / count)
        return used
    finally:
        await env.shutdown()


def report(used: dict[str, list[float]], count: int) -> None:
    print(f"Worker CPU a workflow, ms ({count} workflows a round; the first round not counted):")
    # The first round warms imports and caches up.
    counted = {name: rounds[1:] for name, rounds in used.items()}
    medians = {name: statistics.median(rounds) for name, rounds in counted.items()}
    for name, rounds in used.items():
        shown = " ".join(f"{ms:.2f}" for ms in rounds)
        spread = statistics.stdev(counted[name]) if len(counted[name]) > 1 else 0.0
        print(
            f"  {name:<9} median {medians[name]:5.2f}   mean {statistics.mean(counted[name]):5.2f}"
            f" ± {spread:4.2f}   rounds: {shown}"
        )
    for name in [name for name in (CONTEXT, SPANS, SANDBOXED) if name in used]:
        print(f"  {name}: {in_a_trace[name]} of {agents[name]} stand-in agents got a trace context")
    if FLOOR in used and CONTEXT in used and SPANS in used:
        floor = medians[FLOOR]
        print(
            f"RolloutWorkflow over the SDK's floor of its shape: {medians[CONTEXT] - floor:.2f} ms "
            f"handing the trace header on, {medians[SPANS] - floor:.2f} ms making spans; "
            f"context / spans = {medians[CONTEXT] / medians[SPANS]:.2f}"
        )
    if CONTEXT in used and SANDBOXED in used:
        # Each round's sandboxed workflows beside the unsandboxed ones of the same round.
        pairs = list(zip(counted[SANDBOXED], counted[CONTEXT], strict=True))
        more = [s - c for s, c in pairs]
        ratios = [s / c for s, c in pairs]
        print(
            f"Temporal's sandbox, by round: {statistics.mean(more):+.2f} ± "
            f"{statistics.stdev(more) if len(more) > 1 else 0.0:.2f} ms a rollout, "
            f"sandboxed / unsandboxed {statistics.mean(ratios):.2f} "
            f"(from {min(ratios):.2f} to {max(ratios):.2f}); {bytecode_note()}"
        )


def bytecode_note() -> str:
    """Whether RolloutWorkflow's module has bytecode to load: the sandbox imports the module
    afresh for every workflow, and without bytecode (PYTHONDONTWRITEBYTECODE in a checkout)
    compiles its source each time. An installed DARL has it (pip compiles on install)."""
    source = Path(inspect.getfile(RolloutWorkflow))
    cached = Path(importlib.util.cache_from_source(str(source)))
    fresh = cached.exists() and cached.stat().st_mtime >= source.stat().st_mtime
    return f"the workflow's module {'has' if fresh else 'lacks'} bytecode ({cached})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workflows", type=int, default=300, help="workflows a worker a round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--workers", nargs="+", choices=WORKERS, default=list(WORKERS), help="which to run"
    )
    parser.add_argument("--start", nargs=4, metavar=("TARGET", "QUEUE", "COUNT", "TAG"))
    args = parser.parse_args()
    if args.start:
        target, queue, count, tag = args.start
        asyncio.run(start(target, queue, int(count), tag))
    else:
        for name in [name for name in os.environ if name.startswith("OTEL_")]:
            del os.environ[name]
        if args.rounds < 2:
            parser.error("--rounds must be at least 2 (the first is not counted)")
        # On uvloop, as DARL's workers run (darl.deploy.cli.support).
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            used = runner.run(measure(args.workflows, args.rounds, args.workers))
            report(used, args.workflows)
    # The Temporal SDK's runtime can crash at interpreter exit (sdk-python #300): leave now.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
