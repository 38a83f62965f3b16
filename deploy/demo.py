"""`make demo`: DARL's main job on the embedded stack. The tiny "digits" model learns to copy
digit strings with GRPO, from scratch, through real agents (an agent HTTP service) behind the
capturing gateway; the run is a TrainingWorkflow you can watch, pause and stop."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from rich.console import Console

import darl.examples.digits
from darl.deploy.config_file import load_config
from darl.deploy.devstack import DevStack
from darl.deploy.progress import follow
from darl.deploy.stack_file import on_stack
from darl.deploy.temporal_connection import connect
from darl.trainer.run_files import plot_rewards, read_metrics
from darl.viewer.links import viewer_run_link, web_ui_link
from darl.workflows.names import TRAINER_TASK_QUEUE, TRAINING_WORKFLOW
from darl.workflows.training_config import TrainingConfig, training_workflow_id
from darl.workflows.training_messages import TrainingSummary
from darl.workflows.training_state import StepRecord

DEMO_CONFIG = Path(darl.examples.digits.__file__).parent / "train.yaml"
AGENT_SERVICE = "darl.examples.digits.agent_service:app"


def demo_config(stack: DevStack, run_id: str, steps: int | None) -> TrainingConfig:
    """The demo's config on `stack`: every endpoint and the model dir are the stack's."""
    config = on_stack(load_config(DEMO_CONFIG, run_id), stack.endpoints(), only_defaults=False)
    updates: dict = {
        "backend": config.backend.model_copy(update={"model_dir": str(stack.model_dir)}),
    }
    if steps is not None:
        updates["total_steps"] = steps
    return config.model_copy(update=updates)


async def train(stack: DevStack, config: TrainingConfig, console: Console) -> TrainingSummary:
    client = await connect(stack.temporal)
    handle = await client.start_workflow(
        TRAINING_WORKFLOW,
        config,
        id=training_workflow_id(config.run_id),
        task_queue=TRAINER_TASK_QUEUE,
        result_type=TrainingSummary,
    )
    if stack.ui_url:
        console.print(f"Web UI: {web_ui_link(stack.ui_url, handle.id)}", soft_wrap=True)
    console.print(f"Viewer: {viewer_run_link(stack.viewer_url, config.run_id)}", soft_wrap=True)
    console.print(
        f"pause/resume/stop it from another shell: darl pause {config.run_id}", soft_wrap=True
    )
    return await follow(handle, console)


def report(
    console: Console,
    summary: TrainingSummary,
    records: list[StepRecord],
    seconds: float,
    run_dir: Path | None,
) -> None:
    """A finished run in a few lines: rewards first to last, the weight sync's cost, where
    every rollout went and, when `run_dir` is on this machine, the run's files."""
    c = summary.counters
    first, last = records[:3], records[-3:]
    console.print(
        f"\n[bold]{summary.run_id}[/bold]: {summary.steps} steps in {seconds:.0f}s "
        f"({summary.reason})"
    )
    if records:
        console.print(
            f"reward {statistics.fmean(r.reward_mean for r in first):.3f} (first 3 steps) -> "
            f"{statistics.fmean(r.reward_mean for r in last):.3f} (last 3); success "
            f"{statistics.fmean(r.success_rate for r in first):.0%} -> "
            f"{statistics.fmean(r.success_rate for r in last):.0%}"
        )
        paused = statistics.fmean(r.paused_seconds for r in records)
        trained = statistics.fmean(r.train_seconds for r in records)
        console.print(
            f"weight sync paused the gateway {paused:.3f}s per step on average; "
            f"train_step took {trained:.2f}s"
        )
    console.print(
        f"{c.rollouts_started} rollouts started "
        f"({c.rollouts_started / max(seconds, 1e-3):.1f} rollouts/s): "
        f"{c.rollouts_trained} trained, {c.rollouts_in_dropped_groups} in dropped groups "
        f"({c.groups_dropped_equal} all-equal, {c.groups_dropped_stale} stale, "
        f"{c.groups_dropped_small} short), {c.rollouts_failed} failed, "
        f"{c.rollouts_cancelled} cancelled and {c.rollouts_left_over} left over at the end, "
        f"{c.rollouts_validated} validation"
        + (
            f"; {c.rollouts_resumed} resumed by replay ({c.calls_replayed} calls replayed, "
            f"{c.replays_diverged} replays ended early)"
            if c.rollouts_resumed
            else ""
        )
    )
    if run_dir is None or not (run_dir / "metrics.jsonl").exists():
        return
    plot = plot_rewards(run_dir, summary.run_id)
    console.print(f"reward curve: {plot}", soft_wrap=True)
    console.print(
        f"metrics: {run_dir / 'metrics.jsonl'}; checkpoints: {run_dir / 'checkpoints'}",
        soft_wrap=True,
    )


def run_demo(stack: DevStack, steps: int | None = None) -> int:
    console = Console()
    run_id = time.strftime("digits-%m%d-%H%M%S")
    with console.status("starting Temporal, the policy server, the gateway and the workers..."):
        stack.start()
    try:
        config = demo_config(stack, run_id, steps)
        console.print(
            f"Training the tiny digits model with GRPO: {config.batch_size} groups of "
            f"{config.group_size} rollouts per step, {config.mode.value} mode, "
            f"{config.total_steps} steps."
        )
        started = time.monotonic()
        summary = asyncio.run(train(stack, config, console))
        seconds = time.monotonic() - started
        run_dir = stack.runs_dir / run_id
        records = [StepRecord.model_validate(r) for r in read_metrics(run_dir)]
        report(console, summary, records, seconds, run_dir)
    finally:
        with console.status("stopping the stack..."):
            stack.stop()
    return 0 if summary.steps == config.total_steps else 1
