"""Branching benchmark (docs/branching.md): what a branching GRPO group costs against an
ordinary group of the same size. Prints figures; asserts nothing.

On a stack of its own (a Temporal dev server, DARL's reference policy server with the tiny
model, the gateway, a rollout worker and a trainer worker), two training runs of the same
multi-turn agent (tests/agents/replay_agent.py: token ids in and out, a deterministic tool,
the conversation sent whole each turn), one after the other, with the same settings but for
`groups.mode`: ordinary groups (`independent`), then branching groups (`branch`, at half the
seed's calls). For each run: wall time per step, the tokens the policy server generated (its
own log) per trained member, and the calls answered from a record instead.

    .venv/bin/python -m bench.branch_bench [--steps 3] [--turns 12] [--group-size 4]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from darl.deploy.devstack import connect_when_ready, register_search_attributes
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.workflows.contracts import LocalAgentSpec
from darl.workflows.training_config import TrainingConfig
from tests.integration.dev_server import DevServer
from tests.integration.stack import Stack
from tests.integration.training_stack import start_training, training_config, training_result

AGENT = str(Path(__file__).resolve().parents[1] / "tests" / "agents" / "replay_agent.py")
TIMEOUT = 1800


@dataclass(frozen=True)
class RunFigures:
    mode: str
    steps: int
    wall_seconds: float
    trained_members: int
    generated_tokens: int
    replayed_calls: int
    groups_branched: int


def config_for(stack: Stack, mode: str, steps: int, turns: int, group_size: int) -> TrainingConfig:
    run_id = f"branch-bench-{mode}-{uuid.uuid4().hex[:6]}"
    config = training_config(
        stack,
        run_id,
        steps,
        group_size=group_size,
        batch_size=2,
        min_group_size=group_size,
        # The agent's reward is constant: every group is trained, the cost is what is measured.
        equal_reward_groups="train",
        groups={"mode": mode, "branch_at": "fraction", "fraction": 0.5},
    )
    data = config.model_dump(mode="json")
    data["rollout"]["agent"] = LocalAgentSpec(
        command=["{python}", AGENT],
        env={
            "AGENT_LOG": str(stack.root / "replay-agent.log"),
            "MARKER_DIR": str(stack.root / "markers"),
            "PROTOCOL": "tokens",
            "TURNS": str(turns),
            "MAX_TOKENS": "8",
        },
    ).model_dump(mode="json")
    return TrainingConfig.model_validate(data)


async def run_once(stack: Stack, config: TrainingConfig) -> RunFigures:
    started = time.monotonic()
    handle = await start_training(stack.client, config, stack.trainer_queue)
    summary = await training_result(stack, handle, TIMEOUT)
    wall = time.monotonic() - started
    store = DirectoryTrajectoryStore(stack.store_dir)
    records = [
        record
        for folder in stack.store_dir.iterdir()
        if folder.name.startswith(config.run_id)
        for record in store.read_sync(folder.name)
    ]
    live = {r.call_id for r in records if r.replayed_from is None}
    generated = sum(
        len(line["token_ids"][0])
        for line in stack.policy_responses()
        if line.get("call_id") in live
    )
    return RunFigures(
        mode=config.groups.mode,
        steps=summary.steps,
        wall_seconds=wall,
        trained_members=summary.counters.rollouts_trained,
        generated_tokens=generated,
        replayed_calls=sum(1 for r in records if r.replayed_from is not None),
        groups_branched=summary.counters.groups_branched,
    )


async def main(steps: int, turns: int, group_size: int) -> None:
    console = Console(width=160)
    with tempfile.TemporaryDirectory(prefix="darl-bench-branch-") as tmp:
        root = Path(tmp)
        server = DevServer(root)
        server.start()
        stack: Stack | None = None
        try:
            await register_search_attributes(server.settings)
            client = await connect_when_ready(server.settings)
            stack = Stack(root / "stack", client)
            await asyncio.to_thread(stack.start)
            await asyncio.to_thread(stack.start_trainer_worker, "trainer")
            (stack.root / "markers").mkdir(exist_ok=True)
            runs = [
                await run_once(stack, config_for(stack, mode, steps, turns, group_size))
                for mode in ("independent", "branch")
            ]
        finally:
            if stack is not None:
                await asyncio.to_thread(stack.stop)
            server.stop()

    table = Table(
        title=f"{steps} steps of 2 groups of {group_size}, an agent of {turns} calls"
        " (branches at half the seed's calls)"
    )
    for column in (
        "groups",
        "wall s / step",
        "trained members",
        "policy tokens / member",
        "calls replayed",
        "groups branched",
    ):
        table.add_column(column, justify="right")
    for run in runs:
        members = max(run.trained_members, 1)
        table.add_row(
            run.mode,
            f"{run.wall_seconds / max(run.steps, 1):.1f}",
            str(run.trained_members),
            f"{run.generated_tokens / members:.1f}",
            str(run.replayed_calls),
            str(run.groups_branched),
        )
    console.print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=4)
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.turns, args.group_size))
