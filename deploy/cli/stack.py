"""`darl dev` (the embedded stack, up until Ctrl-C) and `darl demo` (the stack, a training run
of the digits model, then stop), and the port flags they share."""

from __future__ import annotations

import functools
import inspect
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from darl.deploy.cli.support import Home, app, setup_logging
from darl.deploy.devstack import DevPorts, DevStack

DEFAULT_PORTS = DevPorts()
# The dev stack's ports as flags (`--agent-port` is `agent_service`'s): flag -> DevPorts field.
PORT_FLAGS = {
    "temporal_port": "temporal",
    "ui_port": "ui",
    "gateway_port": "gateway",
    "policy_port": "policy",
    "agent_port": "agent_service",
    "viewer_port": "viewer",
}


def port_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with its `ports: DevPorts` parameter given on the command line as six flags
    in its place (--temporal-port, --ui-port, --gateway-port, --policy-port, --agent-port,
    --viewer-port), each defaulting to its field of the parameter's default."""
    signature = inspect.signature(command, eval_str=True)
    parameters: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        if parameter.name != "ports":
            parameters.append(parameter)
            continue
        parameters.extend(
            inspect.Parameter(
                flag,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=getattr(parameter.default, field),
                annotation=int,
            )
            for flag, field in PORT_FLAGS.items()
        )

    @functools.wraps(command)
    def with_ports(**values: Any) -> None:
        ports = DevPorts(**{field: values.pop(flag) for flag, field in PORT_FLAGS.items()})
        command(ports=ports, **values)

    # What typer reads: the flags in the place of `ports`, typed.
    with_ports.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    with_ports.__annotations__ = {p.name: p.annotation for p in parameters}
    return with_ports


@app.command()
@port_options
def dev(
    home: Home = Path(".darl"),
    ports: DevPorts = DEFAULT_PORTS,
    ui: Annotated[bool, typer.Option(help="Serve the Temporal Web UI.")] = True,
    model: Annotated[str, typer.Option(help="Policy model preset: tiny or digits.")] = "tiny",
    agent_service: Annotated[
        str | None, typer.Option(help="Also host this module:app agent HTTP service.")
    ] = None,
) -> None:
    """Start the embedded stack and keep it up until Ctrl-C."""
    setup_logging()
    stack = DevStack(home, ports, ui=ui, model=model, agent_service=agent_service)
    stopped = False

    def on_signal(signum: int, _: object) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stack.start()
    try:
        typer.echo(f"Temporal      {stack.temporal.address} (namespace default)")
        if stack.ui_url:
            typer.echo(f"Web UI        {stack.ui_url}")
        typer.echo(f"Gateway       {stack.gateway_url}")
        typer.echo(f"Policy server {stack.policy_url} (model {stack.model_dir})")
        if agent_service:
            typer.echo(f"Agent service {stack.agent_service_url}")
        typer.echo(f"Viewer        {stack.viewer_url}")
        typer.echo(f"Logs          {stack.home / 'logs'}")
        typer.echo(
            "darl commands find this stack from anywhere (the last `darl dev` started); "
            "for the temporal CLI:"
        )
        typer.echo(f"  export TEMPORAL_ADDRESS={stack.temporal.address}")
        typer.echo("Ctrl-C stops everything.")
        while not stopped:
            signal.pause()
    finally:
        typer.echo("stopping the stack...")
        stack.stop()


@app.command()
@port_options
def demo(
    home: Home = Path(".darl"),
    steps: Annotated[int | None, typer.Option(help="Override the demo's step count.")] = None,
    ports: DevPorts = DEFAULT_PORTS,
) -> None:
    """Start the stack, train the tiny digits model with RL while you watch, stop."""
    setup_logging()
    logging.getLogger().setLevel(logging.WARNING)
    from darl.deploy.demo import AGENT_SERVICE, run_demo

    stack = DevStack(home, ports, model="digits", agent_service=AGENT_SERVICE)
    raise typer.Exit(run_demo(stack, steps))
