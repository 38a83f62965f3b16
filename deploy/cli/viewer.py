"""`darl viewer` (the read-only web app over runs, rollouts and their trajectories) and `darl
trajectory ROLLOUT` (one rollout's calls in the terminal)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from darl.deploy.cli.support import (
    DEFAULT_UI_URL,
    CliError,
    Host,
    Namespace,
    ReadyFile,
    StackAddress,
    StackHome,
    app,
    run_client,
    run_until_signalled,
    setup_logging,
    use_stack,
)
from darl.deploy.serving import serve_app
from darl.deploy.stack_file import read_stack_file
from darl.deploy.store_options import StoreUrl, open_checked_store, store_location
from darl.deploy.temporal_connection import (
    DEFAULT_NAMESPACE,
    TemporalSettings,
    TemporalUnreachableError,
    connect,
)

if TYPE_CHECKING:
    from darl.viewer.app import ViewerSettings
    from darl.viewer.temporal_view import TemporalView

log = logging.getLogger(__name__)

# The dev stack keeps its store, runs and agents under <home> (deploy/devstack.py).
StoreDir = Annotated[
    Path | None,
    typer.Option(help="The gateway's trajectory store (default: <home>/trajectories)."),
]
NOT_FOUND_EXIT = 2


@app.command()
def viewer(
    host: Host = "127.0.0.1",
    port: int = 8400,
    temporal_address: StackAddress = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    store_dir: StoreDir = None,
    store_url: StoreUrl = None,
    runs_dir: Annotated[
        Path | None, typer.Option(envvar="DARL_RUNS_DIR", help="Default: <home>/runs.")
    ] = None,
    agents_dir: Annotated[
        Path | None,
        typer.Option(
            help="The rollout worker's agents dir, for local agents' logs (default: <home>/agents)."
        ),
    ] = None,
    ui_url: Annotated[
        str | None,
        typer.Option(
            envvar="DARL_UI_URL",
            help=f"The Temporal Web UI to link to (default: the running `darl dev`'s, "
            f"else {DEFAULT_UI_URL}).",
        ),
    ] = None,
    home: StackHome = None,
    ready_file: ReadyFile = None,
) -> None:
    """Serve the trajectory viewer: runs, curves, rollouts, calls and tokens (read-only)."""
    setup_logging()
    from darl.viewer.app import Viewer, create_viewer_app
    from darl.viewer.temporal_view import TemporalView

    found, address = use_stack(home, temporal_address)
    settings = viewer_settings(found.home, store_dir, runs_dir, agents_dir, ui_url, store_url)
    open_checked_store(store_location(settings.store_url, settings.store_dir))

    temporal = TemporalSettings.from_env(address, namespace)

    async def main(stop: asyncio.Event) -> None:
        # Serving first: until Temporal answers, its pages say so (503), then they work.
        view = TemporalView(None, temporal.namespace, temporal.address)
        reaching = asyncio.create_task(_reach(view, temporal))
        try:
            app = create_viewer_app(Viewer(view, settings))
            await serve_app(app, host, port, stop, ready_file, "viewer")
        finally:
            reaching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaching

    run_until_signalled(main)


async def _reach(view: TemporalView, temporal: TemporalSettings) -> None:
    """Connect the view to Temporal, trying every 2 s until it answers."""
    said = False
    while True:
        try:
            view.reached(await connect(temporal))
        except TemporalUnreachableError as err:
            if not said:
                log.warning("%s (is `darl dev` running?); trying every 2 s", err)
                said = True
            await asyncio.sleep(2.0)
        else:
            log.info("reached Temporal at %s", temporal.address)
            return


def viewer_settings(
    home: Path,
    store_dir: Path | None,
    runs_dir: Path | None,
    agents_dir: Path | None,
    ui_url: str | None,
    store_url: str | None = None,
) -> ViewerSettings:
    """What the viewer reads: the flags given, else the dev stack's places under `home`
    (deploy/devstack.py) and its Web UI when one is running."""
    from darl.viewer.app import ViewerSettings

    stack = read_stack_file(home)
    return ViewerSettings(
        store_dir=(store_dir or home / "trajectories").resolve(),
        runs_dir=(runs_dir or home / "runs").resolve(),
        agents_dir=(agents_dir or home / "agents").resolve(),
        ui_url=(ui_url or (stack.ui_url if stack and stack.ui_url else DEFAULT_UI_URL)).rstrip("/"),
        store_url=str(store_location(store_url, Path())) if store_url else None,
    )


@app.command()
def trajectory(
    rollout_id: Annotated[str, typer.Argument(help="The rollout id (workflow rollout/<id>).")],
    attempt: Annotated[
        int | None, typer.Option(help="The attempt to show (default: the rollout's last).")
    ] = None,
    tokens: Annotated[bool, typer.Option("--tokens", help="Show token ids and logprobs.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    store_dir: StoreDir = None,
    store_url: StoreUrl = None,
    temporal_address: StackAddress = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    home: StackHome = None,
) -> None:
    """Every model call of a rollout, in order: messages, completion, finish reason, latency,
    policy version, protocol. Exit status 2 when nothing knows the rollout."""
    from darl.viewer.temporal_view import TemporalView
    from darl.viewer.trajectory import load_trajectory

    found, address = use_stack(home, temporal_address)
    location = store_location(store_url, store_dir or found.home / "trajectories")
    store = open_checked_store(location)

    async def main() -> None:
        client = await connect(TemporalSettings.from_env(address, namespace))
        state = await TemporalView(client).rollout(rollout_id)
        wanted = attempt if attempt is not None else (state.last_attempt if state else None)
        found = await load_trajectory(store, rollout_id, wanted)
        if state is None and not found.in_store:
            raise CliError(
                f"no rollout {rollout_id!r}: Temporal has no workflow rollout/"
                f"{rollout_id} and {store.where(rollout_id)} does not exist",
                exit_code=NOT_FOUND_EXIT,
            )
        result = state.result if state else None
        summary = {
            "rollout_id": rollout_id,
            "workflow_status": state.workflow_status if state else None,
            "result": result.model_dump(mode="json") if result else None,
            "attempt": found.attempt,
            "attempts_in_store": found.attempts,
            "calls": [_call_json(r, tokens) for r in found.calls],
            "failed_calls": [asdict(f) for f in found.failed_calls],
        }
        if as_json:
            typer.echo(json.dumps(summary, indent=2))
        else:
            _print(Console(), summary, found, tokens, str(location))

    run_client(main)


def _call_json(record: Any, with_tokens: bool) -> dict[str, Any]:
    from darl.viewer.render import completion_text

    value: dict[str, Any] = {
        "sequence": record.sequence,
        "call_id": record.call_id,
        "attempt": record.attempt,
        "policy_version": record.policy_version,
        "protocol": record.protocol,
        "endpoint": record.endpoint,
        "finish_reason": record.finish_reason(),
        "latency_ms": record.latency_ms,
        "retry_count": record.retry_count,
        "streamed": record.streamed,
        "replayed_from": record.replayed_from,
        "replay_normalized": record.replay_normalized,
        "messages": record.request.get("messages"),
        "prompt": record.request.get("prompt"),
        "completion": completion_text(record),
        "prompt_tokens": len(record.prompt_token_ids),
        "completion_tokens": len(record.completion_token_ids()),
    }
    if with_tokens:
        value["prompt_token_ids"] = record.prompt_token_ids
        value["completion_token_ids"] = record.completion_token_ids()
        value["completion_logprobs"] = record.completion_logprobs()
    return value


def _print(
    console: Console, summary: dict[str, Any], found: Any, with_tokens: bool, store_root: str
) -> None:
    from darl.viewer.render import call_views
    from darl.viewer.trajectory import returned_token_texts

    result = summary["result"]
    head = f"rollout {summary['rollout_id']}"
    if result:
        head += f": {result['status']}, reward {result['reward']}, answer {result['answer']!r}"
    elif summary["workflow_status"]:
        head += f": workflow {summary['workflow_status']}"
    else:
        head += ": no workflow in Temporal (the store's record only)"
    console.print(head, style="bold", markup=False, highlight=False)
    if result and result.get("error"):
        console.print(f"error: {result['error']}", markup=False, highlight=False)
    console.print(
        f"attempt {found.attempt} (in the store: {found.attempts or 'none'}), "
        f"{len(found.calls)} call{'' if len(found.calls) == 1 else 's'}",
        markup=False,
        highlight=False,
    )
    if result and result.get("calls") and not found.calls:
        console.print(
            f"the store has none of the {result['calls']} calls the rollout made: is "
            f"{store_root} the gateway's store (--store-url, --store-dir, --home)?",
            style="yellow",
            markup=False,
            highlight=False,
        )
    for view in call_views(found.calls):
        r = view.record
        console.rule(
            # Text, not markup: a protocol or finish reason is the upstream's string.
            Text(
                f"call {r.sequence} · policy version {r.policy_version} · {r.protocol} · "
                f"finish {view.finish_reason} · {r.latency_ms:.1f} ms"
            ),
            characters="─",
        )
        if r.replayed_from:
            normalized = " (under the rollout's normalizers)" if r.replay_normalized else ""
            console.print(f"  replayed from {r.replayed_from}{normalized}", highlight=False)
        if view.earlier_messages:
            console.print(f"  … {view.earlier_messages} earlier messages", highlight=False)
        if view.prompt is not None:
            console.print(f"  prompt: {view.prompt}", markup=False, highlight=False)
        for message in view.messages:
            console.print(f"  {message.role}: {message.text}", markup=False, highlight=False)
        console.print(f"  completion: {view.completion}", markup=False, highlight=False)
        if with_tokens:
            table = Table("token id", "text", "logprob")
            texts = returned_token_texts(r)
            logprobs = view.logprobs or []
            for i, token_id in enumerate(r.completion_token_ids()):
                text = texts[i] if i < len(texts) else None
                logprob = logprobs[i] if i < len(logprobs) else None
                # Text cells: a token such as "[/b]" is the model's, never rich markup.
                table.add_row(
                    Text(str(token_id)),
                    Text(repr(text) if text is not None else "-"),
                    Text("-" if logprob is None else f"{logprob:.4f}"),
                )
            console.print(f"  prompt token ids: {r.prompt_token_ids}", highlight=False)
            console.print(table)
    for failed in found.failed_calls:
        console.print(f"failed call: {failed.summary()}", markup=False, highlight=False)
