"""What Temporal's sandbox costs RolloutWorkflow, and how much of it passing modules through
takes away: the stored rollout histories (tests/workflow/histories) replayed in this process
under each runner in turn, the order alternating, reading the process's CPU. No server, no
activities: a replay runs the workflow's code and the SDK's activations, nothing else.

- `unsandboxed`: what the rollout worker runs;
- `sandboxed`: `rollout_workflow_runner(sandboxed=True)` (the standard library, temporalio and
  pydantic passed through; the contracts by the workflow module's own imports);
- `darl passed through`: the same with every DARL module passed through, the workflow's own
  too: it is imported once, and keeps the real `datetime`, `random` and `os`, so only the
  sandbox's restricted builtins (`open`) are still refused in it;
- `all passed through`: nothing imported afresh; what is left is the sandbox's own machinery
  (each activation, serialization context and instance run through `exec` in the sandbox).

    python -m bench.sandbox_replay [--replays 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path

from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from darl.activities.worker import rollout_workflow_runner
from darl.deploy.temporal_connection import DATA_CONVERTER
from darl.workflows.contracts import rollout_workflow_id
from darl.workflows.rollout_workflow import RolloutWorkflow

HISTORIES = Path(__file__).parent.parent / "tests" / "workflow" / "histories"
# The stored histories and the rollout ids they were recorded with.
RECORDED = {
    "http_rollout_before_patch": "recorded-http",
    "timed_out_rollout_before_patch": "recorded-timeout",
    "http_rollout_revision_2": "recorded-http-2",
}
RUNNERS: dict[str, WorkflowRunner] = {
    "unsandboxed": rollout_workflow_runner(sandboxed=False),
    "sandboxed": rollout_workflow_runner(sandboxed=True),
    "darl passed through": SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules("darl")
    ),
    "all passed through": SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_all_modules()
    ),
}


def histories() -> list[WorkflowHistory]:
    return [
        WorkflowHistory.from_json(
            rollout_workflow_id(rollout_id), (HISTORIES / f"{name}.json").read_text()
        )
        for name, rollout_id in RECORDED.items()
    ]


async def replay(runner: WorkflowRunner, recorded: list[WorkflowHistory], count: int) -> float:
    """ms of this process's CPU a replay, over `count` replays of the recorded histories."""
    replayer = Replayer(
        workflows=[RolloutWorkflow], data_converter=DATA_CONVERTER, workflow_runner=runner
    )

    async def each() -> AsyncIterator[WorkflowHistory]:
        for i in range(count):
            yield recorded[i % len(recorded)]

    before = time.process_time()
    async with replayer.workflow_replay_iterator(each()) as results:
        async for result in results:
            if result.replay_failure is not None:
                raise result.replay_failure
    return 1000 * (time.process_time() - before) / count


async def measure(count: int, rounds: int) -> dict[str, list[float]]:
    recorded = histories()
    used: dict[str, list[float]] = {name: [] for name in RUNNERS}
    for runner in RUNNERS.values():  # warms imports and caches up; not counted
        await replay(runner, recorded, len(recorded))
    for round_ in range(rounds):
        order = list(RUNNERS) if round_ % 2 == 0 else list(reversed(RUNNERS))
        for name in order:
            used[name].append(await replay(RUNNERS[name], recorded, count))
    return used


def report(used: dict[str, list[float]], count: int) -> None:
    print(f"CPU a replay of RolloutWorkflow, ms ({count} replays a round):")
    unsandboxed = used["unsandboxed"]
    for name, rounds in used.items():
        more = [ms - base for ms, base in zip(rounds, unsandboxed, strict=True)]
        spread = statistics.stdev(more) if len(more) > 1 else 0.0
        shown = " ".join(f"{ms:.2f}" for ms in rounds)
        print(
            f"  {name:<20} mean {statistics.mean(rounds):5.2f}   over unsandboxed "
            f"{statistics.mean(more):+5.2f} ± {spread:4.2f}   rounds: {shown}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replays", type=int, default=300, help="replays a runner a round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    report(asyncio.run(measure(args.replays, args.rounds)), args.replays)


if __name__ == "__main__":
    main()
