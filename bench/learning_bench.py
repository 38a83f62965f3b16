"""Learning benchmark (issue 49): does branching make a model learn faster? Learning curves
of the relay task (examples/relay: the tiny digits model from scratch, a 3-call agent) in
ordinary groups and in branching groups of each kind, on the same budget, over several seeds.
Prints figures; asserts nothing.

One dev stack (Temporal, the policy server with the digits model, the gateway, the workers,
the relay agent service) runs every training run one after the other, the modes interleaved
seed by seed so a change in the machine's load falls on all of them alike. Each run starts
from the same initial model. A run's curve is its validation reward (independent rollouts,
one per validation task, never trained) against the policy tokens its training rollouts made
the policy server generate (calls answered from a record cost none) and against seconds.

    .venv/bin/python -m bench.learning_bench [--modes independent,uniform,surprisal,adaptive]
        [--seeds 4] [--steps 36] [--threshold 0.6] [--adaptive-success 0.5] [--out DIR]
    .venv/bin/python -m bench.learning_bench --again DIR/curves.json --threshold 0.5

Figures per mode, mean ± sd over seeds: policy tokens and seconds to the threshold, the final
validation reward, the trainer's time per step. A PNG of the curves and the figures' JSON go
to the output folder (`.darl/bench-learning/<time>` by default); the PNG is copied to
docs/images/learning-curves.png when `--docs-image` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from temporalio.client import Client

import darl.examples.relay
from bench.learning_figures import CurvePoint, RunCurve, curve, live_tokens_by_time, plot, report
from darl.deploy.config_file import load_config
from darl.deploy.devstack import DevPorts, DevStack
from darl.deploy.stack_file import on_stack
from darl.deploy.temporal_connection import connect
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.trainer.run_files import read_metrics
from darl.workflows.names import TRAINER_TASK_QUEUE, TRAINING_WORKFLOW
from darl.workflows.training_config import GroupsSpec, TrainingConfig, training_workflow_id
from darl.workflows.training_messages import TrainingSummary

RELAY_CONFIG = Path(darl.examples.relay.__file__).parent / "train.yaml"
AGENT_SERVICE = "darl.examples.relay.agent_service:app"
# Beside the default dev stack's ports and the other benchmarks'.
PORTS = DevPorts(temporal=17433, ui=18433, gateway=18500, policy=18600, agent_service=18700)
RUN_TIMEOUT = 15 * 60
DOCS_IMAGE = Path(__file__).resolve().parents[1] / "docs" / "images" / "learning-curves.png"
DOCS_IMAGE_MAX_BYTES = 150_000

# A mode's name and the run's `groups` for it.
MODES: dict[str, dict[str, Any]] = {
    "independent": {"mode": "independent"},
    "uniform": {"mode": "branch", "branch_at": "uniform"},
    "surprisal": {"mode": "branch", "branch_at": "surprisal"},
    "fraction": {"mode": "branch", "branch_at": "fraction"},
    "adaptive": {"mode": "branch", "seed": "adaptive", "branch_at": "uniform"},
    "adaptive-surprisal": {"mode": "branch", "seed": "adaptive", "branch_at": "surprisal"},
}
DEFAULT_MODES = ("independent", "uniform", "surprisal", "adaptive")
ADAPTIVE_SUCCESS = 0.5
"""The run's `success_threshold` under an adaptive seed: the relay's reward is dense (a share
of the digits right), so a rollout right in half its digits counts as a success; at the
default 1.0 hardly any rollout passes early on, and a task with no success makes ordinary
groups."""


class ModeError(ValueError):
    """A mode the benchmark does not know, or one this build's config does not accept."""


def available(mode: str) -> bool:
    """Whether this build's `GroupsSpec` accepts the mode (the adaptive seed is newer)."""
    if mode not in MODES:
        raise ModeError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    try:
        GroupsSpec.model_validate(MODES[mode])
    except ValueError:
        return False
    return True


def run_config(
    stack: DevStack, mode: str, seed: int, steps: int, adaptive_success: float
) -> TrainingConfig:
    """The relay config on `stack` for one run: its mode's groups (with `adaptive_success`
    as the run's success threshold under an adaptive seed), and `seed` for the dataset's
    order and the trainer's mini-batches."""
    groups = GroupsSpec.model_validate(MODES[mode])
    run_id = f"learn-{mode}-s{seed}-{time.strftime('%H%M%S')}"
    config = on_stack(load_config(RELAY_CONFIG, run_id), stack.endpoints(), only_defaults=False)
    backend = config.backend.model_copy(
        update={
            "model_dir": str(stack.model_dir),
            "settings": {**config.backend.settings, "seed": seed},
        }
    )
    return config.model_copy(
        update={
            "backend": backend,
            "dataset": config.dataset.model_copy(update={"seed": seed}),
            "groups": groups,
            "total_steps": steps,
            **({"success_threshold": adaptive_success} if groups.seed == "adaptive" else {}),
        }
    )


async def train(client: Client, config: TrainingConfig) -> tuple[TrainingSummary, float]:
    started = time.time()
    handle = await client.start_workflow(
        TRAINING_WORKFLOW,
        config,
        id=training_workflow_id(config.run_id),
        task_queue=TRAINER_TASK_QUEUE,
        result_type=TrainingSummary,
    )
    async with asyncio.timeout(RUN_TIMEOUT):
        return await handle.result(), started


def run_curve(
    stack: DevStack,
    config: TrainingConfig,
    mode: str,
    seed: int,
    summary: TrainingSummary,
    started: float,
) -> RunCurve:
    store = DirectoryTrajectoryStore(stack.home / "trajectories")
    records = [
        record
        for folder in (stack.home / "trajectories").iterdir()
        if folder.name.startswith(f"{config.run_id}.e")
        for record in store.read_sync(folder.name)
    ]
    return curve(
        mode,
        seed,
        started,
        read_metrics(stack.runs_dir / config.run_id),
        live_tokens_by_time(config.run_id, records),
        summary.counters,
    )


async def measure(
    stack: DevStack, modes: list[str], args: argparse.Namespace, console: Console
) -> list[RunCurve]:
    client = await connect(stack.temporal)
    curves = []
    for seed in range(args.seeds):
        for mode in modes:
            config = run_config(stack, mode, seed, args.steps, args.adaptive_success)
            summary, started = await train(client, config)
            found = run_curve(stack, config, mode, seed, summary, started)
            curves.append(found)
            last = found.points[-1] if found.points else None
            console.print(
                f"{config.run_id}: {summary.steps} steps ({summary.reason}) in "
                f"{found.wall_seconds:.0f}s, {found.policy_tokens} policy tokens, final "
                f"validation reward {last.reward if last else float('nan'):.3f}, trainer "
                f"{found.train_seconds:.3f}s/step, {summary.counters.groups_branched} groups "
                "branched"
            )
    return curves


def save(curves: list[RunCurve], threshold: float, out: Path, docs_image: bool) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "curves.json").write_text(
        json.dumps({"threshold": threshold, "runs": [asdict(c) for c in curves]}, indent=1)
    )
    png = plot(curves, threshold, out / "learning-curves.png")
    if docs_image and png.stat().st_size <= DOCS_IMAGE_MAX_BYTES:
        shutil.copyfile(png, DOCS_IMAGE)
    return png


def saved_curves(path: Path) -> list[RunCurve]:
    """The runs a benchmark saved (its curves.json), to report them again."""
    runs = json.loads(path.read_text())["runs"]
    return [
        RunCurve(**{**run, "points": [CurvePoint(**point) for point in run["points"]]})
        for run in runs
    ]


def main(args: argparse.Namespace) -> None:
    console = Console(width=160)
    if args.again is not None:
        curves = saved_curves(args.again)
        png = plot(
            curves, args.threshold, args.again.parent / f"learning-curves-{args.threshold}.png"
        )
        report(curves, args.threshold, console)
        console.print(f"curves: {png}", soft_wrap=True)
        return
    modes = [m for m in args.modes.split(",") if m]
    missing = [m for m in modes if not available(m)]
    if missing:
        console.print(f"left out, this build's config does not accept them: {missing}")
        modes = [m for m in modes if m not in missing]
    with tempfile.TemporaryDirectory(prefix="darl-learning-bench-") as home:
        stack = DevStack(Path(home), PORTS, ui=False, model="digits", agent_service=AGENT_SERVICE)
        console.print(f"starting the dev stack in {home}; modes {modes}, {args.seeds} seeds")
        stack.start()
        try:
            curves = asyncio.run(measure(stack, modes, args, console))
        finally:
            stack.stop()
    png = save(curves, args.threshold, args.out, args.docs_image)
    report(curves, args.threshold, console)
    console.print(f"curves: {png}; figures: {args.out / 'curves.json'}", soft_wrap=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES))
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--threshold", type=float, default=0.6)
    parser.add_argument(
        "--out", type=Path, default=Path(".darl/bench-learning") / time.strftime("%m%d-%H%M%S")
    )
    parser.add_argument(
        "--adaptive-success",
        type=float,
        default=ADAPTIVE_SUCCESS,
        help="the success threshold of the adaptive modes' runs",
    )
    parser.add_argument("--docs-image", action="store_true", help="copy the PNG to docs/images")
    parser.add_argument(
        "--again", type=Path, help="report a saved curves.json again (at --threshold), run nothing"
    )
    main(parser.parse_args())
    # The Temporal SDK's runtime can crash at interpreter exit (sdk-python #300): leave now.
    sys.stdout.flush()
    os._exit(0)
