"""Coding-agent benchmark: where the time of a graded rollout goes (sandbox set-up, agent,
grading, the rest) and what the trajectory store keeps of it per call. Prints figures;
checks only that every rollout earned reward 1.

On a stack of its own (a Temporal dev server, the scripted policy server as the gateway's
upstream: a stand-in for a model that can solve coding tasks, answering with the tool calls
of a known fix; the gateway; a rollout worker), the shipped rollout specs
(examples/swe/rollout.json, rollout-mini.json: a bubblewrap sandbox per attempt, the
`swe_tests` grader) run one rollout at a time, `--runs` times each: DARL's agent with the
known fix (2 calls), mini-swe-agent unchanged with the known fix (2 calls), and DARL's agent
on a 50-call episode (tests/agents/swe_scripts.py). Every figure is read from what the
system records: Temporal's history, the runner's attempt directory, the grade, the store.

    .venv/bin/python -m bench.swe_bench [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHandle

from darl.activities.runners.local import EXIT_FILE, HANDLE_FILE
from darl.activities.sandbox.workspace import READY_FILE
from darl.deploy.devstack import connect_when_ready, register_search_attributes
from darl.examples.swe.instances import load_instances
from darl.workflows.contracts import RolloutResult
from darl.workflows.names import AWAIT_AGENT, LAUNCH_AGENT
from darl.workflows.rollout_status import RolloutStatus
from tests.agents.swe_scripts import DARL_AGENT, MINI_AGENT, Case, case, long_episode, scripts_file
from tests.integration.dev_server import DevServer
from tests.integration.test_swe_agents import TASKS, ScriptedStack, shipped_spec

ROOT = Path(__file__).resolve().parents[1]
LONG_EPISODE_CALLS = 50
ROLLOUT_TIMEOUT = 240
MIRRORS_TIMEOUT = 120

SOURCES = f"""Where each figure comes from (one clock: Temporal's server, the worker and the
agents share the machine; file times are mtimes in <agents>/<rollout>/attempt-1/):
  total        workflow execution started -> completed (Temporal history)
  set-up       launch_agent's ActivityTaskStarted (history) -> {READY_FILE} written: the
               launch's checks (a second run, the grader), then the workspace checked out
               from the mirror
  agent        {HANDLE_FILE} written (the runner writes it as it spawns the agent) -> {EXIT_FILE}
               written (the agent's wrapper, at its exit): the sandbox's start (supervisor,
               bwrap, bridge), the agent's own start-up, its model calls and commands
  grading      GradeReport.seconds (the grader's clock: workspace copy, restore, hidden tests)
  close/other  total - set-up - agent - grading, split in the second table:
    to launch    workflow started -> launch_agent started (history)
    launch rest  {READY_FILE} -> {HANDLE_FILE} (sandbox config, spawn)
    close        {EXIT_FILE} -> await_agent completed (history), less grading: the
                 gateway's close of the attempt
    after await  await_agent completed -> workflow completed (history)
  to 1st call  agent spawned -> the gateway got its first call (the store's record:
               created_at less latency_ms); ms/call after: from then to the exit, per call
  calls        RolloutResult.calls; store bytes: the files under <store>/<rollout_id>/;
               reward: RolloutResult.reward, the grade (any other fails the bench)"""


@dataclass(frozen=True)
class Kind:
    """One kind of rollout the bench runs: its label, scripted case and agent settings."""

    label: str
    scripted: Case
    env: dict[str, str]


@dataclass(frozen=True)
class Timeline:
    """One graded rollout's moments (epoch seconds, one machine's clock) and what it cost."""

    workflow_started: float
    launch_started: float
    workspace_ready: float
    agent_started: float
    first_call: float
    agent_exited: float
    await_completed: float
    workflow_completed: float
    grading: float
    reward: float
    calls: int
    store_bytes: int

    @property
    def total(self) -> float:
        return self.workflow_completed - self.workflow_started

    @property
    def setup(self) -> float:
        return self.workspace_ready - self.launch_started

    @property
    def agent(self) -> float:
        return self.agent_exited - self.agent_started

    @property
    def other(self) -> float:
        return self.total - self.setup - self.agent - self.grading

    @property
    def to_launch(self) -> float:
        return self.launch_started - self.workflow_started

    @property
    def launch_rest(self) -> float:
        return self.agent_started - self.workspace_ready

    @property
    def to_first_call(self) -> float:
        return self.first_call - self.agent_started

    @property
    def per_call(self) -> float:
        """From the first call to the agent's exit, per call: the model's answer, the
        command it asked for and the agent's own work."""
        return (self.agent_exited - self.first_call) / self.calls

    @property
    def close(self) -> float:
        return self.await_completed - self.agent_exited - self.grading

    @property
    def after_await(self) -> float:
        return self.workflow_completed - self.await_completed


def kinds() -> list[Kind]:
    """The three rollouts of the bench, on the first shipped instance."""
    instance = load_instances(TASKS)[0]
    name = instance["instance_id"]
    long = long_episode(instance, LONG_EPISODE_CALLS)
    return [
        Kind("darl agent, known fix", case(DARL_AGENT, "fix", instance), {}),
        Kind("mini-swe-agent, known fix", case(MINI_AGENT, "fix", instance), {}),
        Kind(
            f"darl agent, {LONG_EPISODE_CALLS}-call episode",
            Case(f"darl/long/{name}", DARL_AGENT, instance, long),
            # The shipped spec's step limit is below the episode's length.
            {"AGENT_STEP_LIMIT": str(LONG_EPISODE_CALLS)},
        ),
    ]


def build_mirrors(out: Path) -> None:
    """The task repositories' git mirrors, built as a user builds them."""
    command = [sys.executable, "-m", "darl.examples.swe.make_tasks", "mirrors"]
    built = subprocess.run(
        [*command, "--out", str(out), "--tasks", str(TASKS)],
        capture_output=True,
        text=True,
        timeout=MIRRORS_TIMEOUT,
    )
    if built.returncode != 0:
        raise RuntimeError(f"building the mirrors failed: {built.stdout}{built.stderr}")


def seconds(event: HistoryEvent) -> float:
    return event.event_time.seconds + event.event_time.nanos / 1e9


async def workflow_moments(handle: WorkflowHandle[Any, RolloutResult]) -> dict[str, float]:
    """From the rollout's Temporal history: when the workflow started and completed, when
    launch_agent started and when await_agent completed (the last try of each)."""
    history = await handle.fetch_history()
    activities: dict[int, str] = {}
    moments: dict[str, float] = {}
    for event in history.events:
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            moments["workflow_started"] = seconds(event)
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
            moments["workflow_completed"] = seconds(event)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            activities[event.event_id] = name
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            scheduled = event.activity_task_started_event_attributes.scheduled_event_id
            if activities.get(scheduled) == LAUNCH_AGENT:
                moments["launch_started"] = seconds(event)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            scheduled = event.activity_task_completed_event_attributes.scheduled_event_id
            if activities.get(scheduled) == AWAIT_AGENT:
                moments["await_completed"] = seconds(event)
    wanted = {"workflow_started", "workflow_completed", "launch_started", "await_completed"}
    if missing := wanted - moments.keys():
        raise RuntimeError(f"{handle.id}: its history lacks {sorted(missing)}")
    return moments


def store_bytes(stack: ScriptedStack, rollout_id: str) -> int:
    folder = stack.store_dir / rollout_id
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


async def run_once(stack: ScriptedStack, kind: Kind, mirrors: Path, n: int) -> Timeline:
    """One graded rollout of `kind`, alone on the stack, and its timeline."""
    scripted = kind.scripted
    spec = shipped_spec(scripted.agent, mirrors, kind.env)
    run = "bench-swe"
    spec = spec.model_copy(
        update={
            "run_id": run,
            "rollout_id": f"{run}-{scripted.agent}-{n}-{uuid.uuid4().hex[:6]}",
            "group_id": scripted.instance["instance_id"],
            "task": scripted.task(),
        }
    )
    handle = await stack.start_rollout(spec)
    async with asyncio.timeout(ROLLOUT_TIMEOUT):
        result = await handle.result()
    grade = result.grade
    if result.status != RolloutStatus.SUCCEEDED or grade is None or result.reward != 1.0:
        raise RuntimeError(
            f"{kind.label}: the known fix was not graded 1 ({result.status}, reward "
            f"{result.reward}, attempts {result.attempts}): {result.error or grade}"
        )
    if result.attempts != 1:
        raise RuntimeError(f"{kind.label}: {result.attempts} attempts; timings would mix them")
    attempt_dir = stack.agents_dir / spec.rollout_id / "attempt-1"
    records = stack.store().read_sync(spec.rollout_id)
    if not records:
        raise RuntimeError(f"{kind.label}: the store holds no call of {spec.rollout_id}")
    return Timeline(
        **await workflow_moments(handle),
        workspace_ready=(attempt_dir / READY_FILE).stat().st_mtime,
        # The handle is written the moment the agent's process is spawned. Its started_at
        # (psutil's create time) is not used: Linux gives it from the boot time in whole
        # seconds, so it is off the wall clock by up to a second.
        agent_started=(attempt_dir / HANDLE_FILE).stat().st_mtime,
        # A record's created_at is when its answer was stored; less its latency, when the
        # gateway received the call.
        first_call=min(r.created_at - r.latency_ms / 1000 for r in records),
        agent_exited=(attempt_dir / EXIT_FILE).stat().st_mtime,
        grading=grade.seconds,
        reward=result.reward,
        calls=result.calls,
        store_bytes=store_bytes(stack, spec.rollout_id),
    )


def check_machine() -> None:
    """The bench runs the shipped specs as a user does: from the checkout, with bwrap and
    mini-swe-agent's venv installed."""
    if Path.cwd().resolve() != ROOT:
        raise SystemExit(f"run the bench from the checkout ({ROOT}): the specs' {{cwd}} is it")
    if shutil.which("bwrap") is None or not (ROOT / ".venv-swe" / "bin" / "mini").exists():
        raise SystemExit("the bench needs bubblewrap and .venv-swe: run `make swe` first")


async def measure(runs: int) -> dict[str, list[Timeline]]:
    with tempfile.TemporaryDirectory(prefix="darl-bench-swe-") as tmp:
        root = Path(tmp)
        mirrors = root / "repos"
        await asyncio.to_thread(build_mirrors, mirrors)
        server = DevServer(root)
        server.start()
        stack: ScriptedStack | None = None
        try:
            await register_search_attributes(server.settings)
            client = await connect_when_ready(server.settings)
            scripts = root / "scripts.json"
            bench_kinds = kinds()
            scripts.write_text(scripts_file([k.scripted for k in bench_kinds]))
            stack = ScriptedStack(root / "stack", client, scripts)
            await asyncio.to_thread(stack.start)
            timelines: dict[str, list[Timeline]] = {k.label: [] for k in bench_kinds}
            # Round by round, so a drift of the machine's load spreads over every kind.
            for n in range(runs):
                for kind in bench_kinds:
                    timelines[kind.label].append(await run_once(stack, kind, mirrors, n))
            return timelines
        finally:
            if stack is not None:
                await asyncio.to_thread(stack.stop)
            server.stop()


def median(timelines: list[Timeline], figure: str) -> float:
    return statistics.median(getattr(t, figure) for t in timelines)


def figures_table(title: str, columns: list[str]) -> Table:
    table = Table(title=title)
    table.add_column(columns[0])
    for column in columns[1:]:
        table.add_column(column, justify="right")
    return table


def report(timelines: dict[str, list[Timeline]], runs: int, wall: float, load: str) -> None:
    console = Console(width=160)
    console.print(
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; load average (1, 5, 15 min) before: {load}, after: "
        f"{load_average()}"
    )
    table = figures_table(
        f"Graded rollouts, one at a time, median of {runs} each (seconds)",
        [
            "rollout",
            "set-up",
            "agent",
            "grading",
            "close/other",
            "total",
            "total range",
            "reward",
            "calls",
            "store bytes",
            "bytes/call",
        ],
    )
    for label, done in timelines.items():
        calls = int(median(done, "calls"))
        stored = int(median(done, "store_bytes"))
        table.add_row(
            label,
            *(f"{median(done, f):.2f}" for f in ("setup", "agent", "grading", "other", "total")),
            f"{min(t.total for t in done):.1f}-{max(t.total for t in done):.1f}",
            f"{median(done, 'reward'):.1f}",
            str(calls),
            f"{stored:,}",
            f"{stored // calls:,}",
        )
    console.print(table)
    split = figures_table(
        "close/other split, and the agent's start-up (median seconds)",
        [
            "rollout",
            "to launch",
            "launch rest",
            "close",
            "after await",
            "agent: to 1st call",
            "agent: ms/call after",
        ],
    )
    for label, done in timelines.items():
        figures = ("to_launch", "launch_rest", "close", "after_await", "to_first_call")
        per_call = median(done, "per_call") * 1000
        split.add_row(label, *(f"{median(done, f):.3f}" for f in figures), f"{per_call:.0f}")
    console.print(split)
    console.print(SOURCES)
    console.print(f"Whole bench (mirrors, stack, {runs * len(timelines)} rollouts): {wall:.0f} s")


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="rollouts of each kind (median)")
    args = parser.parse_args()
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    check_machine()
    load = load_average()
    began = time.monotonic()
    timelines = asyncio.run(measure(args.runs))
    report(timelines, args.runs, time.monotonic() - began, load)


if __name__ == "__main__":
    main()
    # The Temporal SDK's runtime can abort at interpreter exit (sdk-python #300).
    os._exit(0)
