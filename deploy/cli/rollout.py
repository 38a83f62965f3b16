"""`darl rollout SPEC`: start one RolloutWorkflow from a RolloutSpec file and show its result."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from darl.deploy.cli.support import (
    CliError,
    Namespace,
    StackAddress,
    StackHome,
    app,
    run_client,
    use_stack,
)
from darl.deploy.errors import single_line
from darl.deploy.temporal_connection import DEFAULT_NAMESPACE, TemporalSettings, connect
from darl.workflows import errors
from darl.workflows.contracts import CURRENT_REVISION, RolloutSpec
from darl.workflows.names import ROLLOUT_TASK_QUEUE, ROLLOUT_WORKFLOW


def with_current_revision(spec: RolloutSpec) -> RolloutSpec:
    """The spec as `darl rollout` starts it: at the current revision when the file says none
    (the field's default, 1, is for a history recorded from a spec that names none, which
    replays as revision 1; a user starting a rollout means today's command sequence)."""
    if "revision" in spec.model_fields_set:
        return spec
    return spec.model_copy(update={"revision": CURRENT_REVISION})


@app.command()
def rollout(
    spec_file: Annotated[Path, typer.Argument(help="A RolloutSpec as JSON.")],
    wait: bool = True,
    task_queue: Annotated[
        str, typer.Option(help="The rollout workers' task queue.")
    ] = ROLLOUT_TASK_QUEUE,
    temporal_address: StackAddress = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    home: StackHome = None,
) -> None:
    """Start a RolloutWorkflow (idempotent: its id comes from the rollout id, and a rollout
    that already ran is not run again: its result is shown)."""
    from pydantic import ValidationError
    from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
    from temporalio.exceptions import WorkflowAlreadyStartedError

    from darl.workflows import search_attributes as sa
    from darl.workflows.contracts import RolloutResult, rollout_workflow_id
    from darl.workflows.rollout_status import RolloutStatus

    try:
        spec = RolloutSpec.model_validate_json(spec_file.read_text())
    except OSError as err:
        typer.echo(f"error: {spec_file}: {err.strerror or err}", err=True)
        raise typer.Exit(2) from None
    except ValidationError as err:
        typer.echo(
            f"error: {spec_file} is not a RolloutSpec: {errors.one_line(err.errors())}", err=True
        )
        raise typer.Exit(2) from None

    spec = with_current_revision(spec)
    address = use_stack(home, temporal_address)[1]

    async def main() -> None:
        client = await connect(TemporalSettings.from_env(address, namespace))
        workflow_id = rollout_workflow_id(spec.rollout_id)
        try:
            handle = await client.start_workflow(
                ROLLOUT_WORKFLOW,
                spec,
                id=workflow_id,
                task_queue=task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                result_type=RolloutResult,
                static_summary=sa.rollout_summary(spec),
            )
            typer.echo(f"started {handle.id}")
        except WorkflowAlreadyStartedError:
            # One rollout id, one result: the one it already has.
            handle = client.get_workflow_handle(workflow_id, result_type=RolloutResult)
            typer.echo(f"{workflow_id} already ran; its result:")
            wait_for_it = True
        else:
            wait_for_it = wait
        if wait_for_it:
            result = await handle.result()
            typer.echo(result.model_dump_json(indent=2))
            if result.status != RolloutStatus.SUCCEEDED:
                why = single_line(result.error or "no error said")
                raise CliError(f"{workflow_id} ended {result.status.value}: {why}")

    run_client(main)
