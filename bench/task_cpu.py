"""CPU by asyncio task and by thread inside one process, for the training benchmark's rollout
worker and the SDK floor's worker beside it (`python -m bench.training_bench --worker-tasks`).
Prints figures; asserts nothing.

Every task the process's event loop creates runs its coroutine through a wrapper that reads
the thread's CPU clock around each step, and charges it to the coroutine's name (its
`__qualname__`): what one kind of task costs a step at a time, its own steps only (a task it
starts is a task of its own). The collector runs in whatever step allocated when a
generation filled up: its passes are timed on their own (`gc.callbacks`, thread by thread)
and taken out of the step they ran in. What neither a task nor the collector runs (the event
loop, protocol callbacks) is the main thread's remainder. Threads are read from /proc: the
main thread, the Temporal SDK's core (tokio) and its workflow pool (`temporal_workflow_*`),
which runs the workflows' code.

The process writes its figures to a JSON file every two seconds (components leave with
os._exit, which skips atexit); the benchmark takes a `snapshot` before the run and one after,
and reports the difference. A step costs the wrapper ~2-3 us of its own (a loop of empty
steps on uvloop: 1.1-1.7 us a step bare, 3.5-4.1 us wrapped).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Coroutine, Generator
from pathlib import Path
from typing import Any

# Where the rollout worker writes its figures: set by `training_bench --worker-tasks`, read by
# bench/worker_tasks/sitecustomize.py (which names it itself: it imports nothing from here
# before it knows it is in the rollout worker).
WORKER_TASKS_ENV = "DARL_BENCH_TASK_CPU"
_DUMP_EVERY_SECONDS = 2.0


class _Collector:
    """The collector's CPU, by the thread its passes ran on."""

    def __init__(self) -> None:
        self.seconds: Counter[int] = Counter()
        self._started: dict[int, float] = {}

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        thread, now = threading.get_ident(), time.thread_time()
        if phase == "start":
            self._started[thread] = now
        else:
            self.seconds[thread] += now - self._started.pop(thread, now)


class _Timed(Coroutine[Any, Any, Any]):
    """A coroutine whose every step's CPU, less the collector's passes in it, is charged to
    `name`."""

    __slots__ = ("_collector", "_coroutine", "_cpu", "_name")

    def __init__(
        self,
        coroutine: Coroutine[Any, Any, Any],
        name: str,
        cpu: Counter[str],
        collector: _Collector,
    ) -> None:
        self._coroutine = coroutine
        self._name = name
        self._cpu = cpu
        self._collector = collector

    def _charge(self, started: float, collected: float) -> None:
        during = self._collector.seconds[threading.get_ident()] - collected
        self._cpu[self._name] += time.thread_time() - started - during

    def send(self, value: Any) -> Any:
        collected = self._collector.seconds[threading.get_ident()]
        started = time.thread_time()
        try:
            return self._coroutine.send(value)
        finally:
            self._charge(started, collected)

    def throw(self, *args: Any) -> Any:
        collected = self._collector.seconds[threading.get_ident()]
        started = time.thread_time()
        try:
            return self._coroutine.throw(*args)
        finally:
            self._charge(started, collected)

    def close(self) -> None:
        self._coroutine.close()

    def __await__(self) -> Generator[Any, None, Any]:
        return self  # type: ignore[return-value]


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads, summed by kind."""
    python_names = {thread.native_id: thread.name for thread in threading.enumerate()}
    kinds: Counter[str] = Counter()
    main = os.getpid()
    for tid in os.listdir(f"/proc/{main}/task"):
        try:
            comm = Path(f"/proc/{main}/task/{tid}/comm").read_text().strip()
            ns = int(Path(f"/proc/{main}/task/{tid}/schedstat").read_text().split()[0])
        except OSError:
            continue  # a thread that ended in between
        name = python_names.get(int(tid), "")
        if int(tid) == main:
            kind = "main thread (event loop)"
        elif name.startswith("temporal_workflow"):
            kind = "workflow pool threads (workflow code)"
        elif comm.startswith("tokio"):
            kind = "SDK core threads (tokio)"
        else:
            kind = f"other threads ({comm})"
        kinds[kind] += ns / 1e9
    return dict(kinds)


def install(out: str) -> None:
    """Charge every task of every event loop made by `uvloop.new_event_loop` (what DARL's
    components run on) from now on, and write the figures to `out`."""
    import uvloop

    cpu: Counter[str] = Counter()
    tasks: Counter[str] = Counter()
    collector = _Collector()
    gc.callbacks.append(collector)
    main = threading.get_ident()
    new_event_loop = uvloop.new_event_loop

    def factory(
        loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Task[Any]:
        name = getattr(coroutine, "__qualname__", type(coroutine).__name__)
        tasks[name] += 1
        return asyncio.Task(_Timed(coroutine, name, cpu, collector), loop=loop, **kwargs)

    def timed_loop() -> asyncio.AbstractEventLoop:
        loop = new_event_loop()
        loop.set_task_factory(factory)  # type: ignore[arg-type]
        return loop

    uvloop.new_event_loop = timed_loop

    def dump() -> None:
        while True:
            time.sleep(_DUMP_EVERY_SECONDS)
            figures = {
                "tasks": {name: [tasks[name], cpu[name]] for name in list(cpu)},
                "threads": _thread_cpu(),
                "collector": {
                    "main thread": collector.seconds[main],
                    "other threads": sum(collector.seconds.values()) - collector.seconds[main],
                },
                "process": time.process_time(),
            }
            Path(out + ".part").write_text(json.dumps(figures))
            os.replace(out + ".part", out)

    threading.Thread(target=dump, name="bench-task-cpu", daemon=True).start()


def snapshot_now(path: Path | None) -> dict | None:
    """The figures the process writes next (`snapshot`, newer than now); None without a path."""
    return None if path is None else snapshot(path, newer_than=time.time())


def snapshot(path: Path, newer_than: float = 0.0, wait_seconds: float = 5.0) -> dict | None:
    """The figures the process last wrote, once written after `newer_than` (time.time());
    None if it wrote none in time."""
    deadline = time.monotonic() + wait_seconds
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_mtime > newer_than:
            return json.loads(path.read_text())
        time.sleep(0.1)
    return None


def minus(after: dict, before: dict) -> dict:
    """What the process spent between two snapshots."""
    old = before["tasks"]
    return {
        "tasks": {
            name: [count - old.get(name, [0, 0.0])[0], seconds - old.get(name, [0, 0.0])[1]]
            for name, (count, seconds) in after["tasks"].items()
        },
        "threads": {
            kind: seconds - before["threads"].get(kind, 0.0)
            for kind, seconds in after["threads"].items()
        },
        "collector": {
            where: seconds - before["collector"].get(where, 0.0)
            for where, seconds in after["collector"].items()
        },
    }


def report(figures: dict, rollouts: int, top: int = 14) -> None:
    """The worker's CPU per rollout by thread and by kind of task."""
    per = 1000 / max(rollouts, 1)
    print(f"Rollout worker CPU by thread (ms per rollout; {rollouts} rollouts):")
    for kind, seconds in sorted(figures["threads"].items(), key=lambda item: -item[1]):
        print(f"  {kind:<60}{seconds * per:>8.2f}")
    print("Its main thread by kind of asyncio task (ms per rollout, tasks per rollout, ms a task):")
    ranked = sorted(figures["tasks"].items(), key=lambda item: -item[1][1])
    for name, (count, seconds) in ranked[:top]:
        print(
            f"  {name[:60]:<60}{seconds * per:>8.2f}{count / max(rollouts, 1):>7.2f}"
            f"{seconds / max(count, 1) * 1000:>9.3f}"
        )
    collected = figures["collector"]["main thread"]
    print(f"  {'the collector':<60}{collected * per:>8.2f}")
    outside = _outside(figures) * per
    print(f"  {'outside any task (the event loop, protocol callbacks)':<60}{outside:>8.2f}")
    elsewhere = figures["collector"]["other threads"] * per
    print(f"The collector on the worker's other threads: {elsewhere:.2f} ms per rollout")


def compare(worker: dict, rollouts: int, floor: dict, workflows: int) -> None:
    """The rollout worker's CPU beside the SDK's floor in the rollout's shape
    (`bench.bare_workflow`), thread by thread, and the main thread's split: the SDK's kinds of
    task (those the floor runs), every other task (the worker's own: DARL's), the collector,
    and what no task ran. Ms per rollout against ms per bare workflow."""
    per, floor_per = 1000 / max(rollouts, 1), 1000 / max(workflows, 1)
    print(
        "The rollout worker against the SDK's floor in the rollout's shape (ms per rollout; "
        "the floor's per workflow, measured after the run, on a quieter machine):"
    )
    print(f"  {'':<60}{'worker':>8}{'floor':>8}{'more':>8}")

    def row(name: str, mine: float, theirs: float) -> None:
        print(f"  {name[:60]:<60}{mine:>8.2f}{theirs:>8.2f}{mine - theirs:>+8.2f}")

    threads = worker["threads"]
    for kind in sorted(threads, key=lambda kind: -threads[kind]):
        row(kind, threads[kind] * per, floor["threads"].get(kind, 0.0) * floor_per)
    print("  the main thread's:")
    sdk = [name for name, (_, seconds) in floor["tasks"].items() if seconds * floor_per >= 0.01]
    for name in sorted(sdk, key=lambda name: -floor["tasks"][name][1]):
        row(f"  {name}", _in_tasks(worker, [name]) * per, _in_tasks(floor, [name]) * floor_per)
    rest_mine = _in_tasks(worker) - _in_tasks(worker, sdk)
    rest_floor = _in_tasks(floor) - _in_tasks(floor, sdk)
    row("  every other task", rest_mine * per, rest_floor * floor_per)
    collected = worker["collector"]["main thread"], floor["collector"]["main thread"]
    row("  the collector", collected[0] * per, collected[1] * floor_per)
    row("  outside any task", _outside(worker) * per, _outside(floor) * floor_per)


def _in_tasks(figures: dict, names: list[str] | None = None) -> float:
    """The CPU of the tasks of these kinds (all of them when None)."""
    tasks = figures["tasks"]
    return sum(tasks[name][1] for name in (tasks if names is None else names) if name in tasks)


def _outside(figures: dict) -> float:
    """The main thread's CPU that no task and no collector pass ran."""
    main = figures["threads"].get("main thread (event loop)", 0.0)
    return main - _in_tasks(figures) - figures["collector"]["main thread"]
