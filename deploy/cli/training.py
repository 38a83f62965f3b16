"""`darl train CONFIG`, `darl status|pause|resume|stop|plot RUN`, the trainer worker and the
agent service host."""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console

from darl.deploy.cli.support import (
    DEFAULT_UI_URL,
    CliError,
    Namespace,
    StackAddress,
    StackHome,
    TemporalAddress,
    app,
    run_client,
    run_failure,
    run_until_signalled,
    run_worker,
    secret,
    setup_logging,
    use_stack,
)
from darl.deploy.config_file import ConfigFileError, config_paths, load_config
from darl.deploy.progress import follow, status_line, step_table
from darl.deploy.serving import serve_app
from darl.deploy.stack_file import (
    STACK_FILE,
    StackEndpoints,
    endpoint_changes,
    model_mismatch,
    on_stack,
)
from darl.deploy.store_options import StoreUrl, open_checked_store, store_location
from darl.deploy.temporal_connection import (
    DEFAULT_ADDRESS,
    DEFAULT_NAMESPACE,
    TemporalSettings,
    connect,
)
from darl.viewer.links import viewer_run_link, web_ui_link
from darl.workflows.names import (
    METRICS_QUERY,
    PAUSE_SIGNAL,
    RESUME_SIGNAL,
    STATUS_QUERY,
    STOP_SIGNAL,
    TRAINER_TASK_QUEUE,
    TRAINING_WORKFLOW,
)
from darl.workflows.training_config import MAX_WAIT_SECONDS, training_workflow_id
from darl.workflows.training_messages import StopRequest, TrainingProgress, TrainingSummary
from darl.workflows.training_state import StepRecord

if TYPE_CHECKING:
    from temporalio.client import WorkflowHandle

Run = Annotated[str, typer.Argument(help="The run id (its workflow is train/<run id>).")]
FINISH_TIMEOUT_SECONDS = 600.0


async def _handle(run_id: str, address: str, namespace: str):
    client = await connect(TemporalSettings.from_env(address, namespace))
    return client.get_workflow_handle(training_workflow_id(run_id))


@app.command()
def train(
    config_file: Annotated[Path, typer.Argument(help="TrainingConfig as YAML or JSON.")],
    run_id: Annotated[str | None, typer.Option(help="Override the config's run_id.")] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="Override a config key (dotted: knobs.max_inflight=4); repeat.",
        ),
    ] = None,
    follow_run: Annotated[bool, typer.Option("--follow", help="Show steps as they land.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="With --follow, end with the raw summary (JSON).")
    ] = False,
    task_queue: str = TRAINER_TASK_QUEUE,
    temporal_address: StackAddress = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    ui_url: Annotated[
        str | None,
        typer.Option(
            envvar="DARL_UI_URL",
            help=f"The Temporal Web UI. Default: the running `darl dev`'s, else {DEFAULT_UI_URL}.",
        ),
    ] = None,
    home: StackHome = None,
) -> None:
    """Start a TrainingWorkflow (idempotent: a run id runs once). With a `darl dev` running
    (under --home, or found from here), endpoints the config gives as the default dev
    stack's (gateway :8100, policy server :8200, agent service :8300 on 127.0.0.1) are that
    stack's, wherever its flags put them; other endpoints are kept."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
    from temporalio.exceptions import WorkflowAlreadyStartedError

    found, address = use_stack(home, temporal_address)
    stack = found.endpoints
    try:
        # A path under .darl/ in the config is the stack's home's.
        config = load_config(config_file, run_id, overrides or (), home=found.home)
    except ConfigFileError as err:
        _config_error(str(err))
    if stack is not None:
        moved = on_stack(config, stack)
        for change in endpoint_changes(config, moved):
            typer.echo(f"dev stack ({found.home / STACK_FILE}): {change}")
        config = moved
        mismatch = model_mismatch(config, stack)
        if mismatch is not None:
            _config_error(f"{config_file}: {mismatch}")
    for line in config_paths(config):
        typer.echo(line)
    ui = ui_url or (stack.ui_url if stack and stack.ui_url else DEFAULT_UI_URL)

    async def main() -> None:
        client = await connect(TemporalSettings.from_env(address, namespace))
        workflow_id = training_workflow_id(config.run_id)
        running = False
        async for earlier in client.list_workflows(f'WorkflowId = "{workflow_id}"'):
            if earlier.status == WorkflowExecutionStatus.COMPLETED:
                raise CliError(
                    f"run {config.run_id!r} already completed ({workflow_id}); a run id trains "
                    "once: give this one another --run-id"
                )
            running = running or earlier.status == WorkflowExecutionStatus.RUNNING
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
        # A run id runs once: a running run is the one this config names, followed as it is.
        typer.echo(
            f"following {handle.id} (already running)" if running else f"started {handle.id}"
        )
        typer.echo(f"Web UI: {web_ui_link(ui, handle.id, namespace)}")
        if stack is not None and stack.viewer_url:
            typer.echo(f"Viewer: {viewer_run_link(stack.viewer_url, config.run_id)}")
        if follow_run:
            await _follow_to_the_end(handle, stack, as_json)

    run_client(main)


def _config_error(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


async def _follow_to_the_end(
    handle: WorkflowHandle[Any, TrainingSummary], stack: StackEndpoints | None, as_json: bool
) -> None:
    """Steps as they land, then the summary: the demo's report, or the raw JSON."""
    from darl.deploy.demo import report

    console = Console()
    shown: dict[int, StepRecord] = {}
    started = time.monotonic()
    summary = await follow(handle, console, shown=shown)
    if as_json:
        typer.echo(summary.model_dump_json(indent=2))
        return
    seconds = summary.seconds if summary.seconds is not None else time.monotonic() - started
    runs_dir = Path(stack.runs_dir) if stack and stack.runs_dir else _runs_dir()
    run_dir = Path(summary.run_dir) if summary.run_dir else runs_dir / summary.run_id
    records = [shown[step] for step in sorted(shown)]
    report(console, summary, records, seconds, run_dir)


def _runs_dir() -> Path:
    return Path(os.environ.get("DARL_RUNS_DIR", ".darl/runs"))


@app.command()
def status(
    run: Run,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    temporal_address: StackAddress = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    home: StackHome = None,
) -> None:
    """Where a run stands (the `status` and `metrics` queries)."""

    async def main() -> None:
        handle = await _handle(run, use_stack(home, temporal_address)[1], namespace)
        failure = await run_failure(handle)
        if failure is not None:
            raise CliError(f"{handle.id} {failure}")
        progress = await handle.query(STATUS_QUERY, result_type=TrainingProgress)
        records = await handle.query(METRICS_QUERY, result_type=list[StepRecord])
        if as_json:
            typer.echo(progress.model_dump_json(indent=2))
            return
        typer.echo(status_line(progress))
        for line in step_table(records[-10:]):
            typer.echo(line)

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


@app.command()
def pause(
    run: Run,
    temporal_address: StackAddress = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    home: StackHome = None,
) -> None:
    """No new rollouts or steps until resume; rollouts out finish and wait in the buffer."""
    _signal(run, PAUSE_SIGNAL, use_stack(home, temporal_address)[1], namespace)


@app.command()
def resume(
    run: Run,
    temporal_address: StackAddress = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    home: StackHome = None,
) -> None:
    """Continue a paused run."""
    _signal(run, RESUME_SIGNAL, use_stack(home, temporal_address)[1], namespace)


@app.command()
def stop(
    run: Run,
    finish: Annotated[
        bool, typer.Option(help="Let running rollouts finish instead of cancelling them.")
    ] = False,
    finish_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            max=MAX_WAIT_SECONDS,
            metavar="SECONDS",
            help="With --finish, how long the run waits for its rollouts before it cancels "
            "those still running.",
        ),
    ] = FINISH_TIMEOUT_SECONDS,
    temporal_address: StackAddress = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    home: StackHome = None,
) -> None:
    """Stop gracefully: no new rollouts, in-flight ones cancelled (or finished), a summary."""
    request = (
        StopRequest(cancel_inflight=False, grace_seconds=finish_timeout)
        if finish
        else StopRequest(cancel_inflight=True)
    )
    # Without the fields left at None: a trainer worker of a DARL whose StopRequest has no
    # `grace_seconds` refuses a payload naming a field it does not know (and drops the signal).
    payload = request.model_dump(mode="json", exclude_none=True)
    _signal(run, STOP_SIGNAL, use_stack(home, temporal_address)[1], namespace, payload)


@app.command()
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


@app.command("agent-service")
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


@app.command("trainer-worker")
def trainer_worker(
    store_dir: Annotated[Path, typer.Option(help="The gateway's trajectory store.")] = Path(
        ".darl/trajectories"
    ),
    store_url: StoreUrl = None,
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
    location = store_location(store_url, store_dir.resolve())
    open_checked_store(location)
    settings = TrainerWorkerSettings(
        store_dir=store_dir.resolve(),
        store_url=store_url,
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
