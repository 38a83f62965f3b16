"""What the `darl` commands share: the Typer app they register on, their common options,
logging, secrets, running a long-lived component until SIGINT/SIGTERM, running a Temporal
worker, and leaving a short client command cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import uvloop
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Worker

from darl.deploy.devstack import SECRETS_FILE, DevPorts
from darl.deploy.errors import DeployError, single_line
from darl.deploy.serving import freeze_built_heap
from darl.deploy.stack_file import HOME_DIR, STACK_FILE, FoundStack, find_stack
from darl.deploy.telemetry import flush_tracing
from darl.deploy.temporal_connection import (
    DEFAULT_ADDRESS,
    TemporalSettings,
    TemporalUnreachableError,
    connect,
    quiet_sdk_logs,
)
from darl.files import write_ready_file

app = typer.Typer(no_args_is_help=True, help="DARL: durable agentic RL on Temporal.")

# The Temporal options every command takes, read from the temporal CLI's own variables.
TemporalAddress = Annotated[str, typer.Option(envvar="TEMPORAL_ADDRESS")]
Namespace = Annotated[str, typer.Option(envvar="TEMPORAL_NAMESPACE")]
Home = Annotated[Path, typer.Option(envvar="DARL_HOME", help="DARL's state directory.")]
# The options of a long-lived component.
ReadyFile = Annotated[
    Path | None, typer.Option(help="Write the bound address here once serving (JSON).")
]
Host = Annotated[str, typer.Option(help="Interface to bind; loopback unless you mean it.")]
# The Temporal Web UI a link points at when neither --ui-url nor a running `darl dev` says:
# the dev stack's, on its default port.
DEFAULT_UI_URL = f"http://127.0.0.1:{DevPorts().ui}"
# For commands that look at a stack rather than serve in one (deploy/stack_file.py,
# find_stack): its home when given, else found from here.
StackHome = Annotated[
    Path | None,
    typer.Option(
        envvar="DARL_HOME",
        help=f"The dev stack's directory (default: {HOME_DIR} here or in the nearest parent "
        "with a running stack, else the last `darl dev` started).",
    ),
]
# Where its Temporal is when no --temporal-address (or TEMPORAL_ADDRESS) says: the found
# stack's, as its <home>/stack.json says, else the default address.
StackAddress = Annotated[
    str | None,
    typer.Option(
        envvar="TEMPORAL_ADDRESS",
        help=f"Default: the running `darl dev`'s (<home>/{STACK_FILE}), else {DEFAULT_ADDRESS}.",
    ),
]


def use_stack(home: Path | None, temporal_address: str | None) -> tuple[FoundStack, str]:
    """The stack a client command uses and the Temporal address it talks to, said in a line
    on stderr. A --temporal-address other than the stack's means the stack is not used."""
    found = find_stack(home)
    stack = found.endpoints
    if stack is not None and temporal_address not in (None, stack.temporal_address):
        found = FoundStack(found.home, None, f"not its Temporal, {temporal_address}")
        stack = None
    address = temporal_address or (stack.temporal_address if stack else DEFAULT_ADDRESS)
    if stack is not None:
        typer.echo(f"using {found.describe()}", err=True)
    return found, address


log = logging.getLogger("darl")


def setup_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("DARL_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per HTTP request is noise at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def secret(name: str, home: Path) -> str:
    """From the environment, else from the dev stack's secrets file."""
    value = os.environ.get(name)
    if value:
        return value
    path = home / SECRETS_FILE
    if path.exists():
        return json.loads(path.read_text())[name]
    raise typer.BadParameter(f"set {name} (or run `darl dev` once to create {path})")


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)`; SIGINT/SIGTERM set `stop`. Exits with os._exit after flushing, which
    sidesteps a crash at interpreter exit seen with the Temporal SDK's runtime."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    code = 0
    try:
        # uvloop: the event loop's own overhead is a large part of the gateway's cost per call.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop_runner:
            loop_runner.run(runner())
    except Exception:
        log.exception("stopped by an error")
        code = 1
    flush_tracing()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# How long a stopping worker waits for Temporal to take its goodbye (its last task
# completions, the end of its polls) before it leaves anyway: what it did not report is
# retried by the server at the task's timeout (a workflow task's 10 s, an activity's heartbeat),
# on the next worker.
WORKER_GOODBYE_SECONDS = 5.0


def run_worker(
    build: Callable[[Client, httpx.AsyncClient], contextlib.AbstractAsyncContextManager[Worker]],
    temporal: TemporalSettings,
    task_queue: str,
    ready_file: Path | None,
) -> None:
    """Run a Temporal worker (with one pooled HTTP client) until SIGINT/SIGTERM; then stop it
    within WORKER_GOODBYE_SECONDS, Temporal reachable or not."""

    async def main(stop: asyncio.Event) -> None:
        client = await connect(temporal)
        running = contextlib.AsyncExitStack()
        http_client = await running.enter_async_context(
            httpx.AsyncClient(timeout=httpx.Timeout(60.0))
        )
        await running.enter_async_context(build(client, http_client))
        freeze_built_heap()
        if ready_file is not None:
            write_ready_file(ready_file, {"task_queue": task_queue})
        log.info("worker polling %s", task_queue)
        try:
            await stop.wait()
        finally:
            try:
                async with asyncio.timeout(WORKER_GOODBYE_SECONDS):
                    await running.aclose()
            except TimeoutError:
                log.warning(
                    "Temporal did not take the worker's goodbye within %gs; leaving anyway "
                    "(the server retries what it did not hear at the tasks' timeouts)",
                    WORKER_GOODBYE_SECONDS,
                )

    run_until_signalled(main)


class CliError(DeployError):
    """What a client command prints as its one-line error, leaving with `exit_code` (1, or
    e.g. 2 for "nothing knows that id")."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def failure_text(err: BaseException) -> str:
    """A workflow's failure as one line, its causes joined (`... : activity ... : why`)."""
    parts: list[str] = []
    cause: BaseException | None = err
    while cause is not None:
        message = getattr(cause, "message", None) or str(cause)
        # A cause an error already quotes (`cannot load f: no attribute 'f'`) is said once.
        if message and not any(message in part for part in parts):
            parts.append(message)
        cause = cause.__cause__
    return single_line(": ".join(parts))


async def run_failure(handle: WorkflowHandle) -> str | None:
    """How a closed workflow failed ("failed: why", "terminated", ...); None while it runs
    or when it completed."""
    from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError

    described = await handle.describe()
    if described.status in (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.COMPLETED):
        return None
    status = described.status.name.lower() if described.status else "closed"
    try:
        await handle.result(follow_runs=False)
    except WorkflowFailureError as err:
        return f"{status}: {failure_text(err.cause)}"
    return status


def run_client(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a short client command, then leave with os._exit after flushing: the Temporal
    SDK's runtime can abort the interpreter's finalization (SIGABRT) after the work is done.
    A server's refusal (no such workflow), a failed workflow and a CliError are a one-line
    error, exit status 1."""
    from temporalio.client import WorkflowFailureError
    from temporalio.service import RPCError

    quiet_sdk_logs()
    code = 0
    try:
        asyncio.run(main())
    except TemporalUnreachableError as err:
        typer.echo(
            f"error: {err}: is `darl dev` running? pass --temporal-address or --home "
            "(or run the command under the stack's directory)",
            err=True,
        )
        code = 1
    except RPCError as err:
        typer.echo(f"error: {err.message}", err=True)
        code = 1
    except WorkflowFailureError as err:
        typer.echo(f"error: the workflow failed: {failure_text(err.cause)}", err=True)
        code = 1
    except CliError as err:
        typer.echo(f"error: {err}", err=True)
        code = err.exit_code
    flush_tracing()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
