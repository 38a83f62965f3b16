"""`darl train CONFIG`, `darl status|pause|resume|stop|plot RUN`, the trainer worker and the
agent service host. Registered on the `darl` app by deploy/cli.py."""

from __future__ import annotations

import asyncio
import importlib
import os
from pathlib import Path
from typing import Annotated

import typer
import yaml
from pydantic import ValidationError
from rich.console import Console

from deploy.cli_support import (
    CliError,
    one_line,
    run_client,
    run_failure,
    run_until_signalled,
    run_worker,
    secret,
    setup_logging,
    validation_line,
)
from deploy.progress import follow, status_line, step_line, web_ui_link
from deploy.serving import serve_app
from workflows.contracts import TRAINER_TASK_QUEUE
from workflows.temporal_connection import TemporalSettings, connect
from workflows.training_contracts import (
    StepRecord,
    StopRequest,
    TrainingConfig,
    TrainingProgress,
    TrainingSummary,
    training_workflow_id,
)

Run = Annotated[str, typer.Argument(help="The run id (its workflow is train/<run id>).")]
TemporalAddress = Annotated[str, typer.Option(envvar="TEMPORAL_ADDRESS")]
Namespace = Annotated[str, typer.Option(envvar="TEMPORAL_NAMESPACE")]
UiUrl = Annotated[str, typer.Option(envvar="DARL_UI_URL", help="The Temporal Web UI.")]


def load_config(path: Path, run_id: str | None = None) -> TrainingConfig:
    """A TrainingConfig from YAML or JSON; `run_id` overrides the file's. A file that is not
    one raises typer.BadParameter with one line saying what is wrong."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise typer.BadParameter(f"{path}: {one_line(str(err))}") from err
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{path}: expected a mapping of config keys")
    if run_id:
        data["run_id"] = run_id
    try:
        config = TrainingConfig.model_validate(data)
    except ValidationError as err:
        raise typer.BadParameter(f"{path}: {validation_line(err)}") from err
    return absolute_paths(config)


def absolute_paths(config: TrainingConfig) -> TrainingConfig:
    """Relative paths in a config mean the directory `darl train` runs in; the workers may
    run elsewhere, so they get absolute ones."""

    def resolved(value: str | None) -> str | None:
        return None if value is None else str(Path(value).expanduser().resolve())

    validation = config.validation
    return config.model_copy(
        update={
            "dataset": config.dataset.model_copy(update={"path": resolved(config.dataset.path)}),
            "validation": validation.model_copy(update={"path": resolved(validation.path)}),
            "backend": config.backend.model_copy(
                update={"model_dir": resolved(config.backend.model_dir)}
            ),
            "run_dir": resolved(config.run_dir),
        }
    )


async def _handle(run_id: str, address: str, namespace: str):
    client = await connect(TemporalSettings.from_env(address, namespace))
    return client.get_workflow_handle(training_workflow_id(run_id))


def train(
    config_file: Annotated[Path, typer.Argument(help="TrainingConfig as YAML or JSON.")],
    run_id: Annotated[str | None, typer.Option(help="Override the config's run_id.")] = None,
    follow_run: Annotated[bool, typer.Option("--follow", help="Show steps as they land.")] = False,
    task_queue: str = TRAINER_TASK_QUEUE,
    temporal_address: TemporalAddress = "127.0.0.1:7233",
    namespace: Namespace = "default",
    ui_url: UiUrl = "http://127.0.0.1:8233",
) -> None:
    """Start a TrainingWorkflow (idempotent: a run id runs once)."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
    from temporalio.exceptions import WorkflowAlreadyStartedError

    config = load_config(config_file, run_id)

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
                "TrainingWorkflow",
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
    temporal_address: TemporalAddress = "127.0.0.1:7233",
    namespace: Namespace = "default",
) -> None:
    """Where a run stands (the `status` and `metrics` queries)."""

    async def main() -> None:
        handle = await _handle(run, temporal_address, namespace)
        failure = await run_failure(handle)
        if failure is not None:
            raise CliError(f"{handle.id} {failure}")
        progress = await handle.query("status", result_type=TrainingProgress)
        records = await handle.query("metrics", result_type=list[StepRecord])
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
    temporal_address: TemporalAddress = "127.0.0.1:7233",
    namespace: Namespace = "default",
) -> None:
    """No new rollouts or steps until resume; rollouts out finish and wait in the buffer."""
    _signal(run, "pause", temporal_address, namespace)


def resume(
    run: Run,
    temporal_address: TemporalAddress = "127.0.0.1:7233",
    namespace: Namespace = "default",
) -> None:
    """Continue a paused run."""
    _signal(run, "resume", temporal_address, namespace)


def stop(
    run: Run,
    finish: Annotated[
        bool, typer.Option(help="Let running rollouts finish instead of cancelling them.")
    ] = False,
    temporal_address: TemporalAddress = "127.0.0.1:7233",
    namespace: Namespace = "default",
) -> None:
    """Stop gracefully: no new rollouts, in-flight ones cancelled (or finished), a summary."""
    _signal(run, "stop", temporal_address, namespace, StopRequest(cancel_inflight=not finish))


def plot(
    run: Run,
    runs_dir: Annotated[Path, typer.Option(envvar="DARL_RUNS_DIR")] = Path(".darl/runs"),
) -> None:
    """Draw the run's reward curve from its metrics.jsonl into reward.png."""
    from trainer.run_files import plot_rewards

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
    """Host an agent HTTP service (e.g. examples.digits.agent_service:app)."""
    from examples.agent_service import STATE_DIR_ENV

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
    temporal_address: TemporalAddress = "127.0.0.1:7233",
    namespace: Namespace = "default",
    home: Annotated[Path, typer.Option(envvar="DARL_HOME")] = Path(".darl"),
    ready_file: Annotated[Path | None, typer.Option()] = None,
) -> None:
    """Run the trainer worker (TrainingWorkflow, train_step, weight sync)."""
    import torch

    from activities.trainer_worker import TrainerWorkerSettings, build_trainer_worker
    from deploy.telemetry import configure_tracing

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
