"""Temporal External Storage against passing tasks by reference (issue 45), measured.

A training step hands its tasks (SWE-bench-shaped rows, ~210 KB each) to one activity, as
DARL's TrainingWorkflow does with `start_rollouts`, or to one child workflow each. Three ways:
inline (the default converter); through the SDK's External Storage (temporalio 1.35.0,
experimental: `DataConverter(external_storage=ExternalStorage(drivers=[...]))`) with a
local-file driver standing in for S3/GCS (`bench.local_payload_store`: SHA-256, an exists check
and a write to store, a read and a hash check to retrieve); and by reference (row indices; the
activity reads its rows from the JSONL dataset through an offset index). On one dev server; the
worker runs in this process. Then a replay of a step's history, and a 3 s store outage.

    .venv/bin/python -m bench.payload_storage_bench [--quick] [--tasks 64] [--children 32]

Conclusion: pass references. External Storage keeps the history as small as references do
(0.1 KB a task for the activity hand-off, against 2 MB per payload and 50 MB per history), but
every task still goes through the workflow worker: stored by the reading activity, fetched and
decoded into the workflow, encoded again for `start_rollouts`, fetched again there, and fetched
again on every replay. That costs 10-20x the worker CPU (2.8-4.4 against 0.16-0.31 ms a task)
and 6-15 against 0.7-2.5 ms of wall time a task, and adds a second store to DARL's failures:
- down, it fails workflow tasks, retried on the server's schedule rather than by a retry policy
  written at a call site (a 3 s outage held the step 10.1 s, against 3.1 s for references);
- replay needs it ([TMPRL1105] without it) and re-reads the whole batch (13.4 MB for 64 tasks);
- `temporal workflow show` prints `{driverName, claimData}` in the task's place (the Web UI
  reads the same history; the SDK ships no codec server that resolves it), and nothing deletes
  stored objects (the GCS and S3 drivers leave that to a bucket lifecycle, which must outlast
  the namespace's retention and any replay);
- below its threshold (256 KiB) a 210 KB task stays inline: 32 child starts in one workflow
  task carry 6.7 MB, over gRPC's 4 MB, and the server terminates the step (GrpcMessageTooLarge);
  a 64 KiB threshold avoids that at 4 more store operations (6 round trips) a task.
A reference costs one row read where the task is used, and its data already has an owner (the
dataset, which must stay immutable for as long as a step may retry or replay). External Storage
is the tool for large values with no home of their own (a trajectory, a grader's log).

Figures (`python -m bench.payload_storage_bench`: medians of 3; a 2-core VM shared with other
work, load 6-8, so wall times vary by 2x between runs; bytes, events and CPU do not):

    shape    variant              lat  N  step KB  events  tasks@limit  wall ms  worker ms  RT
    activity inline                 0 64  FAILED: PayloadsTooLarge [TMPRL1103] (a 13.4 MB list)
    activity ext. storage 256 KiB   0 64      0.1     0.3      192,753      8.8       3.28  1.1
    activity references             0 64      0.1     0.2      297,891      0.7       0.31  1.0
    activity ext. storage 256 KiB   5 64      0.1     0.3      192,753     10.3       2.81  1.1
    activity references             5 64      0.1     0.2      297,891      1.0       0.16  1.0
    children inline                 0  8    410.7     7.0          125    353.1      28.75  1.0
    children ext. storage 256 KiB   0 32  FAILED: GrpcMessageTooLarge (the server terminated it)
    children ext. storage 256 KiB   0  8    205.9     7.0          249    111.5      25.00  1.4
    children ext. storage 64 KiB    0 32      1.1     4.1       12,507     58.7      10.94  7.1
    children references             0 32      0.7     4.0       12,800     28.5       5.62  1.0
    children ext. storage 64 KiB    5 32      1.0     3.8       13,430     48.1      10.94  7.1
    children references             5 32      0.8     4.6       11,222     73.4       6.56  1.0

(a task's share of the step's history and events; tasks@limit: tasks one run holds before 50 MB
or 51,200 events; RT: round trips to the stores, row reads included; lat: ms a round trip.)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from temporalio import activity, workflow
from temporalio.api.common.v1 import Payload
from temporalio.client import Client, WorkflowFailureError, WorkflowHistory
from temporalio.common import RetryPolicy
from temporalio.converter import DataConverter, ExternalStorage
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.worker import Replayer, Worker

from bench.local_payload_store import (
    LocalFileStorageDriver,
    RowFile,
    StoreStats,
    write_rows,
)
from tests.integration.dev_server import DevServer

ROW_BYTES = 210_000
HISTORY_LIMIT = 50 * 1024 * 1024
EVENT_LIMIT = 51_200
# Children a step starts where its tasks still fit in a payload (2 MB) and a workflow task.
SMALL_STEP = 8
PAYLOAD = "temporal.api.common.v1.Payload"
REFERENCE_TYPE = b"temporal.api.sdk.v1.ExternalStorageReference"
# Bounded (DARL's own are not) so that a step refused on size fails in seconds.
RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=4)
TIMEOUT = timedelta(seconds=60)
# A step that fails on size may do so by retrying a workflow task until this ends it.
STEP_TIMEOUT = timedelta(seconds=30)


@dataclass(frozen=True)
class Step:
    """One training step's hand-off: `count` rows from `first_row`, passed as tasks or as row
    indices, to one activity (`shape="activity"`) or to one child workflow each."""

    shape: str
    by_reference: bool
    first_row: int
    count: int


# --- the work: a training step hands tasks to an activity, or to child workflows ---------


class RowActivities:
    """The activities, reading rows from the dataset file (and touching each task they get)."""

    def __init__(self, rows: RowFile) -> None:
        self.rows = rows

    @activity.defn(name="payload_bench_read_tasks")
    async def read_tasks(self, rows: list[int]) -> list[dict[str, Any]]:
        return await self.rows.read_many(rows)

    @activity.defn(name="payload_bench_start_rollouts")
    async def start_rollouts(self, tasks: list[dict[str, Any]]) -> list[str]:
        return [_outcome(t) for t in tasks]

    @activity.defn(name="payload_bench_start_rollouts_by_row")
    async def start_rollouts_by_row(self, rows: list[int]) -> list[str]:
        return [_outcome(t) for t in await self.rows.read_many(rows)]

    @activity.defn(name="payload_bench_run_agent")
    async def run_agent(self, task: dict[str, Any]) -> str:
        return _outcome(task)

    @activity.defn(name="payload_bench_run_agent_by_row")
    async def run_agent_by_row(self, row: int) -> str:
        return _outcome(await self.rows.read(row))

    def all(self) -> list[Any]:
        return [
            self.read_tasks,
            self.start_rollouts,
            self.start_rollouts_by_row,
            self.run_agent,
            self.run_agent_by_row,
        ]


def _outcome(task: dict[str, Any]) -> str:
    """A slim outcome: what a training workflow keeps of a rollout."""
    return f"{task['instance_id']}:{len(task['patch'])}"


@workflow.defn(name="PayloadBenchRolloutByTask", sandboxed=False)
class RolloutByTask:
    @workflow.run
    async def run(self, task: dict[str, Any]) -> str:
        return await workflow.execute_activity(
            "payload_bench_run_agent",
            task,
            result_type=str,
            start_to_close_timeout=TIMEOUT,
            retry_policy=RETRY,
        )


@workflow.defn(name="PayloadBenchRolloutByRow", sandboxed=False)
class RolloutByRow:
    @workflow.run
    async def run(self, row: int) -> str:
        return await workflow.execute_activity(
            "payload_bench_run_agent_by_row",
            row,
            result_type=str,
            start_to_close_timeout=TIMEOUT,
            retry_policy=RETRY,
        )


@workflow.defn(name="PayloadBenchStep", sandboxed=False)
class StepWorkflow:
    """Reads its tasks in one activity (or takes their row indices), then hands them over."""

    @workflow.run
    async def run(self, step: Step) -> list[str]:
        rows = list(range(step.first_row, step.first_row + step.count))
        items: list[Any] = rows
        if not step.by_reference:
            items = await workflow.execute_activity(
                "payload_bench_read_tasks",
                rows,
                result_type=list[dict[str, Any]],
                start_to_close_timeout=TIMEOUT,
                retry_policy=RETRY,
            )
        if step.shape == "activity":
            return await workflow.execute_activity(
                "payload_bench_start_rollouts_by_row"
                if step.by_reference
                else "payload_bench_start_rollouts",
                items,
                result_type=list[str],
                start_to_close_timeout=TIMEOUT,
                retry_policy=RETRY,
            )
        rollout = "PayloadBenchRolloutByRow" if step.by_reference else "PayloadBenchRolloutByTask"
        parent = workflow.info().workflow_id
        outcomes = await asyncio.gather(
            *(
                workflow.execute_child_workflow(
                    rollout, item, id=f"{parent}-rollout-{row}", result_type=str
                )
                for row, item in zip(rows, items, strict=True)
            )
        )
        return list(outcomes)


WORKFLOWS = [StepWorkflow, RolloutByTask, RolloutByRow]


# --- the measurement ---------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """How tasks travel: inline (the default converter), through External Storage from
    `threshold` bytes up, or as row indices."""

    label: str
    by_reference: bool = False
    threshold: int | None = None


INLINE = Variant("inline")
EXTERNAL = Variant("external storage (256 KiB)", threshold=256 * 1024)
EXTERNAL_LOW = Variant("external storage (64 KiB)", threshold=64 * 1024)
REFERENCES = Variant("references (row index)", by_reference=True)


@dataclass
class Run:
    variant: Variant
    shape: str
    tasks: int
    latency_ms: float
    error: str = ""
    wall_s: float = 0.0
    worker_cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    parent_history: int = 0
    parent_events: int = 0
    all_histories: int = 0
    largest_payload: int = 0
    attempts: str = ""
    store: StoreStats = field(default_factory=StoreStats)
    rows: StoreStats = field(default_factory=StoreStats)

    def per_task(self, value: float) -> float:
        return value / self.tasks


def payloads(message: Message) -> Iterator[Payload]:
    """Every Payload in a proto message, however deep."""
    for desc, value in message.ListFields():
        if desc.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        kind = desc.message_type
        if kind.GetOptions().map_entry:
            kind = kind.fields_by_name["value"].message_type
            if kind is None:
                continue
            items = list(value.values())
        else:
            items = list(value) if desc.is_repeated else [value]
        for item in items:
            if kind.full_name == PAYLOAD:
                yield item
            else:
                yield from payloads(item)


def error_chain(err: BaseException) -> str:
    messages = []
    cause: BaseException | None = err
    while cause is not None:
        messages.append(str(cause))
        cause = cause.__cause__
    return messages[-1][:110]


class PayloadBench:
    """Runs each hand-off on one dev server, a fresh worker and client per run."""

    def __init__(self, server: DevServer, root: Path) -> None:
        self.target = server.settings.address
        self.server = psutil.Process(server.process.pid if server.process else 0)
        self.root = root
        self.rows_path = root / "rows.jsonl"

    def converter(self, variant: Variant, stats: StoreStats) -> DataConverter:
        if variant.threshold is None:
            return DataConverter.default
        driver = LocalFileStorageDriver(self.root / "store", stats)
        storage = ExternalStorage(drivers=[driver], payload_size_threshold=variant.threshold)
        return DataConverter(external_storage=storage)

    async def run(
        self, variant: Variant, shape: str, tasks: int, latency_ms: float, outage_s: float = 0
    ) -> tuple[Run, Client, str]:
        run = Run(variant, shape, tasks, latency_ms)
        run.store = StoreStats(latency_s=latency_ms / 1000, outage_s=outage_s)
        run.rows = StoreStats(
            latency_s=latency_ms / 1000, outage_s=outage_s if variant.by_reference else 0
        )
        client = await Client.connect(
            self.target, data_converter=self.converter(variant, run.store)
        )
        activities = RowActivities(RowFile(self.rows_path, run.rows))
        queue = workflow_id = f"payload-bench-{uuid.uuid4().hex[:8]}"
        step = Step(shape, variant.by_reference, 0, tasks)
        async with Worker(
            client, task_queue=queue, workflows=WORKFLOWS, activities=activities.all()
        ):
            me, cpu, server_cpu = psutil.Process(), _cpu(psutil.Process()), _cpu(self.server)
            started = time.perf_counter()
            try:
                await client.execute_workflow(
                    StepWorkflow.run,
                    step,
                    id=workflow_id,
                    task_queue=queue,
                    execution_timeout=STEP_TIMEOUT,
                )
            except WorkflowFailureError as err:
                run.error = error_chain(err)
            run.wall_s = time.perf_counter() - started
            run.worker_cpu_s = _cpu(me) - cpu
            run.server_cpu_s = _cpu(self.server) - server_cpu
        await self._read_histories(run, client, workflow_id)
        return run, client, workflow_id

    async def _read_histories(self, run: Run, client: Client, workflow_id: str) -> None:
        ids = [workflow_id]
        if run.shape == "children" and not run.error:
            ids += [f"{workflow_id}-rollout-{row}" for row in range(run.tasks)]
        attempts = {"workflow task": 1, "activity": 1}
        for i, wid in enumerate(ids):
            history = await client.get_workflow_handle(wid).fetch_history()
            size = sum(e.ByteSize() for e in history.events)
            run.all_histories += size
            run.parent_history = run.parent_history or size
            run.parent_events = run.parent_events or len(history.events)
            for event in history.events:
                sizes = (p.ByteSize() for p in payloads(event))
                run.largest_payload = max(run.largest_payload, *sizes, 0)
                scheduled = event.workflow_task_scheduled_event_attributes.attempt
                started = event.activity_task_started_event_attributes.attempt
                attempts["workflow task"] = max(attempts["workflow task"], scheduled)
                attempts["activity"] = max(attempts["activity"], started)
            if i == 0:
                run.attempts = ", ".join(f"{k} attempts {v}" for k, v in attempts.items())

    async def replay(self, variant: Variant, history: WorkflowHistory) -> str:
        """Replays the step's history with its store, then without one."""
        lines = []
        for label, stats in (("with the store", StoreStats()), ("without it", None)):
            converter = DataConverter.default if stats is None else self.converter(variant, stats)
            started = time.perf_counter()
            result = await Replayer(workflows=WORKFLOWS, data_converter=converter).replay_workflow(
                history, raise_on_replay_failure=False
            )
            elapsed = 1000 * (time.perf_counter() - started)
            outcome = "ok" if result.replay_failure is None else _brief(result.replay_failure)
            line = f"  replay {label}: {outcome} ({elapsed:.0f} ms)"
            if stats is not None:
                line += (
                    f"; the store served {stats.gets} gets ({stats.bytes_got / 1e6:.1f} MB) and "
                    f"{stats.puts} puts ({stats.round_trips} round trips)"
                )
            lines.append(line)
        return "\n".join(lines)


def _brief(err: BaseException) -> str:
    """The SDK's own message (`[TMPRL...] ...`) out of a replay failure's long text."""
    text = str(err)
    start = text.find("[TMPRL")
    return text[start : text.find('"', start)] if start >= 0 else text[:110]


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


# --- the table ---------------------------------------------------------------------------

HEADER = (
    f"{'shape':<9}{'variant':<28}{'lat':>4}{'N':>4}{'step KB':>9}{'all KB':>8}{'events':>7}"
    f"{'tasks@limit':>12}{'max payload':>12}{'wall ms':>8}{'worker ms':>10}{'server ms':>10}"
    f"{'store ops':>10}{'RT':>6}"
)
UNITS = f"{'':<41}{'history bytes and events a task':>24}{'KB':>24}{'per task':>28}{'per task':>16}"


def row(run: Run) -> str:
    head = f"{run.shape:<9}{run.variant.label:<28}{run.latency_ms:>4.0f}{run.tasks:>4}"
    if run.error:
        return head + f"  FAILED after {run.wall_s:.1f} s: {run.error}"
    events = run.per_task(run.parent_events)
    limit = min(HISTORY_LIMIT / run.per_task(run.parent_history), EVENT_LIMIT / events)
    stores = (run.store, run.rows)
    return head + (
        f"{run.per_task(run.parent_history) / 1024:>9.1f}"
        f"{run.per_task(run.all_histories) / 1024:>8.1f}"
        f"{events:>7.1f}{limit:>12,.0f}{run.largest_payload / 1024:>12.1f}"
        f"{1000 * run.per_task(run.wall_s):>8.1f}"
        f"{1000 * run.per_task(run.worker_cpu_s):>10.2f}"
        f"{1000 * run.per_task(run.server_cpu_s):>10.2f}"
        f"{run.per_task(sum(s.puts + s.gets for s in stores)):>10.1f}"
        f"{run.per_task(sum(s.round_trips for s in stores)):>6.1f}"
    )


async def measured(
    bench: PayloadBench, variant: Variant, shape: str, tasks: int, latency: float, repeats: int
) -> Run:
    """The run with the median wall time of `repeats` (the CPU columns: their medians too);
    a run that fails is not repeated."""
    runs = [(await bench.run(variant, shape, tasks, latency))[0]]
    while len(runs) < repeats and not runs[0].error:
        runs.append((await bench.run(variant, shape, tasks, latency))[0])
    middle = sorted(runs, key=lambda r: r.wall_s)[len(runs) // 2]
    middle.worker_cpu_s = statistics.median(r.worker_cpu_s for r in runs)
    middle.server_cpu_s = statistics.median(r.server_cpu_s for r in runs)
    return middle


async def table(
    bench: PayloadBench, tasks: int, children: int, latencies: list[float], repeats: int
) -> None:
    print(HEADER)
    print(UNITS)
    for shape, count, variants in (
        ("activity", tasks, [INLINE, EXTERNAL, REFERENCES]),
        ("children", children, [INLINE, EXTERNAL, EXTERNAL_LOW, REFERENCES]),
    ):
        failed: set[Variant] = set()
        for latency in latencies:
            for variant in variants:
                if variant in failed:
                    continue  # a step that fails on size fails whatever the store's latency
                run = await measured(bench, variant, shape, count, latency, repeats)
                print(row(run), flush=True)
                if run.error:
                    failed.add(variant)
                if run.error and shape == "children" and count > SMALL_STEP:
                    # What the same hand-off costs where it still fits.
                    run = await measured(bench, variant, shape, SMALL_STEP, latency, repeats)
                    print(row(run), flush=True)


async def replay(bench: PayloadBench, tasks: int) -> None:
    print("\nReplaying a step's history (activity shape, external storage, 0 ms):")
    _, client, workflow_id = await bench.run(EXTERNAL, "activity", tasks, 0)
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    reference = next(
        p
        for e in history.events
        for p in payloads(e)
        if p.metadata.get("messageType") == REFERENCE_TYPE
    )
    print(
        f"  what history holds in place of the task list ({reference.ByteSize()} bytes; "
        f"`temporal workflow show` prints the same):\n"
        f"    metadata {dict(reference.metadata)}\n    data {reference.data.decode()}\n"
        f"    external_payloads {[p.size_bytes for p in reference.external_payloads]}"
    )
    print(await bench.replay(EXTERNAL, history))


async def outage(bench: PayloadBench, seconds: float) -> None:
    print(f"\nThe store down for {seconds:g} s after its first request (activity shape, 8 tasks):")
    for variant in (EXTERNAL, REFERENCES):
        run, _, _ = await bench.run(variant, "activity", 8, 0, outage_s=seconds)
        store = run.rows if variant.by_reference else run.store
        print(
            f"  {variant.label:<28}{run.error or 'completed'} in {run.wall_s:.1f} s; "
            f"{store.refused} requests refused; {run.attempts}"
        )


async def measure(args: argparse.Namespace, bench: PayloadBench) -> None:
    await bench.run(REFERENCES, "activity", 2, 0)  # warm-up: imports, first connections
    latencies = [0.0, args.latency_ms]
    await table(bench, args.tasks, args.children, latencies, args.repeats)
    await replay(bench, args.tasks)
    await outage(bench, 3.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=64, help="tasks one activity gets")
    parser.add_argument("--children", type=int, default=32, help="child workflows a step starts")
    parser.add_argument("--latency-ms", type=float, default=5.0, help="the slow store's latency")
    parser.add_argument("--repeats", type=int, default=3, help="runs a row's median is of")
    parser.add_argument("--quick", action="store_true", help="16 tasks, 8 children, 1 run")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.children, args.repeats = 16, 8, 1
    # Failures are read from the histories and printed; the SDK's own logs would repeat them.
    logging.getLogger("temporalio").setLevel(logging.CRITICAL)
    Runtime.set_default(Runtime(telemetry=TelemetryConfig(logging=None)))
    # `timeout` ends the bench with SIGTERM: unwind, so the dev server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="payload-bench-") as tmp:
        root = Path(tmp)
        write_rows(root / "rows.jsonl", max(args.tasks, args.children), ROW_BYTES)
        server = DevServer(root)
        server.start()
        try:
            bench = PayloadBench(server, root)
            asyncio.run(measure(args, bench))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
