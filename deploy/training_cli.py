"""`darl train CONFIG`, `darl status|pause|resume|stop|plot RUN`, the trainer worker and the
agent service host. Registered on the `darl` app by deploy/cli.py."""

from __future__ import annotations

import asyncio
import importlib
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from darl.deploy.cli_support import (
    CliError,
    Namespace,
    TemporalAddress,
    run_client,
    run_failure,
    run_until_signalled,
    run_worker,
    secret,
    setup_logging,
)
from darl.deploy.config_file import ConfigFileError, load_config
from darl.deploy.progress import follow, status_line, step_line, web_ui_link
from darl.deploy.serving import serve_app
from darl.deploy.temporal_connection import (
    DEFAULT_ADDRESS,
    DEFAULT_NAMESPACE,
    TemporalSettings,
    connect,
)
from darl.workflows.names import (
    METRICS_QUERY,
    PAUSE_SIGNAL,
    RESUME_SIGNAL,
    STATUS_QUERY,
    STOP_SIGNAL,
    TRAINER_TASK_QUEUE,
    TRAINING_WORKFLOW,
)
from darl.workflows.training_config import training_workflow_id
from darl.workflows.training_messages import StopRequest, TrainingProgress, TrainingSummary
from darl.workflows.training_state import StepRecord

Run = Annotated[str, typer.Argument(help="The run id (its workflow is train/<run id>).")]
UiUrl = Annotated[str, typer.Option(envvar="DARL_UI_URL", help="The Temporal Web UI.")]


async def _handle(run_id: str, address: str, namespace: str):
    client = await connect(TemporalSettings.from_env(address, namespace))
    return client.get_workflow_handle(training_workflow_id(run_id))


def train(
    config_file: Annotated[Path, typer.Argument(help="TrainingConfig as YAML or JSON.")],
    run_id: Annotated[str | None, typer.Option(help="Override the config's run_id.")] = None,
    follow_run: Annotated[bool, typer.Option("--follow", help="Show steps as they land.")] = False,
    task_queue: str = TRAINER_TASK_QUEUE,
    temporal_address: TemporalAddress = DEFAULT_ADDRESS,
    namespace: Namespace = DEFAULT_NAMESPACE,
    ui_url: UiUrl = "http://127.0.0.1:8233",
) -> None:
    """Start a TrainingWorkflow (idempotent: a run id runs once)."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
    from temporalio.exceptions import WorkflowAlreadyStartedError

    try:
        config = load_config(config_file, run_id)
    except ConfigFileError as err:
        raise typer.BadParameter(str(err)) from err

    async def main() -> None:
        client = await connect(TemporalSettings.from_env(temporal_address, namespace))
        workflow_id = training_workflow_id(config.run_id)
        async for earlier in client.list_workflows(f'WorkflowId = "{workflow_id}"'):
            if earlier.status == WorkflowExecutionStatus.COMPLETED:
                raise CliError(
                    f"run {config.run_id!r} already completed ({workflow_id}); a run id trains "
                    "once: give this one another --run-id"
                )
        try:
            # A running run is followed; a completed one is not started again (its rollout
            # ids and checkpoints are taken: a run id trains once). One that failed may be:
            # the run's own start check refuses it if it had got as far as rollouts.
            handle = await client.start_workflow(
                TRAINING_WORKFLOW,
                config,
                id=workflow_id,
                task_queue=task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
                result_type=TrainingSummary,
            )
        except WorkflowAlreadyStartedError:
            raise CliError(
                f"run {config.run_id!r} already completed ({workflow_id}); a run id trains "
                "once: give this one another --run-id"
            ) from None
        typer.echo(f"started {handle.id}")
        typer.echo(f"Web UI: {web_ui_link(ui_url, handle.id, namespace)}")
        if follow_run:
            summary = await follow(handle, Console())
            typer.echo(summary.model_dump_json(indent=2))

    run_client(main)


def status(
    run: Run,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    temporal_address: TemporalAddress = DEFAULT_ADDRESS,
    namespace: Namespace = DEFAULT_NAMESPACE,
) -> None:
    """Where a run stands (the `status` and `metrics` queries)."""

    async def main() -> None:
        handle = await _handle(run, temporal_address, namespace)
        failure = await run_failure(handle)
        if failure is not None:
            raise CliError(f"{handle.id} {failure}")
        progress = await handle.query(STATUS_QUERY, result_type=TrainingProgress)
        records = await handle.query(METRICS_QUERY, result_type=list[StepRecord])
        if as_json:
            typer.echo(progress.model_dump_json(indent=2))
            return
        typer.echo(status_line(progress))
        for record in records[-10:]:
            typer.echo(step_line(record))

    run_client(main)


def _signal(run: str, name: str, address: str, namespace: str, arg: object = None) -> None:
    async def main() -> None:
        handle = await _handle(run, address, namespace)
        if arg is None:
            await handle.signal(name)
        else:
            await handle.signal(name, arg)
        typer.echo(f"sent {name} to {handle.id}")

    run_client(main)


def pause(
    run: Run,
    temporal_address: TemporalAddress = DEFAULT_ADDRESS,
    namespace: Namespace = DEFAULT_NAMESPACE,
) -> None:
    """No new rollouts or steps until resume; rollouts out finish and wait in the buffer."""
    _signal(run, PAUSE_SIGNAL, temporal_address, namespace)


def resume(
    run: Run,
    temporal_address: TemporalAddress = DEFAULT_ADDRESS,
    namespace: Namespace = DEFAULT_NAMESPACE,
) -> None:
    """Continue a paused run."""
    _signal(run, RESUME_SIGNAL, temporal_address, namespace)


def stop(
    run: Run,
    finish: Annotated[
        bool, typer.Option(help="Let running rollouts finish instead of cancelling them.")
    ] = False,
    temporal_address: TemporalAddress = DEFAULT_ADDRESS,
    namespace: Namespace = DEFAULT_NAMESPACE,
) -> None:
    """Stop gracefully: no new rollouts, in-flight ones cancelled (or finished), a summary."""
    _signal(run, STOP_SIGNAL, temporal_address, namespace, StopRequest(cancel_inflight=not finish))


def plot(
    run: Run,
    runs_dir: Annotated[Path, typer.Option(envvar="DARL_RUNS_DIR")] = Path(".darl/runs"),
) -> None:
    """Draw the run's reward curve from its metrics.jsonl into reward.png."""
    from darl.trainer.run_files import plot_rewards

    path = plot_rewards(runs_dir / run, run)
    if path is None:
        raise typer.BadParameter(f"no steps recorded under {runs_dir / run}")
    typer.echo(str(path))


def agent_service(
    target: Annotated[str, typer.Argument(help="module:attribute of an ASGI app.")],
    host: str = "127.0.0.1",
    port: int = 8300,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where DARL's agent-service helper keeps its journal of attempts "
            "(default: <home>/agent-service)."
        ),
    ] = None,
    home: Annotated[Path, typer.Option(envvar="DARL_HOME")] = Path(".darl"),
    ready_file: Annotated[Path | None, typer.Option()] = None,
) -> None:
    """Host an agent HTTP service (e.g. darl.examples.digits.agent_service:app)."""
    from darl.examples.agent_service import STATE_DIR_ENV

    setup_logging()
    module_name, _, attribute = target.partition(":")
    if not attribute:
        raise typer.BadParameter("expected module:attribute")
    # Read by the service when its module builds it, below.
    os.environ[STATE_DIR_ENV] = str((state_dir or home / "agent-service").resolve())
    asgi = getattr(importlib.import_module(module_name), attribute)

    async def main(stop: asyncio.Event) -> None:
        await serve_app(asgi, host, port, stop, ready_file, "agent-service")

    run_until_signalled(main)


def trainer_worker(
    store_dir: Annotated[Path, typer.Option(help="The gateway's trajectory store.")] = Path(
        ".darl/trajectories"
    ),
    runs_dir: Annotated[Path, typer.Option(envvar="DARL_RUNS_DIR")] = Path(".darl/runs"),
    task_queue: str = TRAINER_TASK_QUEUE,
    threads: Annotated[int, typer.Option(help="torch CPU threads.")] = 1,
    temporal_address: TemporalAddress = DEFAULT_ADDRESS,
    namespace: Namespace = DEFAULT_NAMESPACE,
    home: Annotated[Path, typer.Option(envvar="DARL_HOME")] = Path(".darl"),
    ready_file: Annotated[Path | None, typer.Option()] = None,
) -> None:
    """Run the trainer worker (TrainingWorkflow, train_step, weight sync)."""
    import torch

    from darl.activities.trainer_worker import TrainerWorkerSettings, build_trainer_worker
    from darl.deploy.telemetry import configure_tracing

    setup_logging()
    torch.set_num_threads(threads)
    settings = TrainerWorkerSettings(
        store_dir=store_dir.resolve(),
        runs_dir=runs_dir.resolve(),
        admin_key=secret("DARL_ADMIN_KEY", home),
        task_queue=task_queue,
    )
    configure_tracing("darl-trainer-worker")

    run_worker(
        lambda client, http: build_trainer_worker(client, settings, http),
        TemporalSettings.from_env(temporal_address, namespace),
        settings.task_queue,
        ready_file,
    )


def register(app: typer.Typer) -> None:
    app.command()(train)
    app.command()(status)
    app.command()(pause)
    app.command()(resume)
    app.command()(stop)
    app.command()(plot)
    app.command("agent-service")(agent_service)
    app.command("trainer-worker")(trainer_worker)
