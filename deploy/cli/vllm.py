"""`darl vllm-server`: a real vLLM policy server behind DARL's launcher, which changes its
weights by restarting it on a checkpoint directory (what vLLM's CPU build needs)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Annotated

import typer

from darl.deploy.cli.support import Host, app, run_until_signalled, setup_logging
from darl.deploy.serving import serve_app


@app.command("vllm-server")
def vllm_server(
    model_dir: Annotated[
        Path, typer.Option(help="An HF model directory, e.g. a checkpoint's step-NNNNNN.")
    ],
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="The launcher's port (its API).")] = 8210,
    vllm_port: Annotated[int, typer.Option(help="vLLM's port; 0: the kernel picks one.")] = 8200,
    version: Annotated[int, typer.Option(help="The policy version of --model-dir.")] = 0,
    served_model_name: str = "darl-tiny",
    python: Annotated[
        Path | None,
        typer.Option(envvar="DARL_VLLM_PYTHON", help="vLLM's python (default: .venv-vllm)."),
    ] = None,
    enforce_eager: Annotated[
        bool, typer.Option(help="No torch.compile: a restart takes half the time.")
    ] = True,
    kv_cache_gib: int = 1,
    stream_interval: Annotated[
        int, typer.Option(help="Tokens per streamed chunk (1 lags far behind on a CPU).")
    ] = 16,
    startup_timeout: float = 300.0,
    vllm_arg: Annotated[
        list[str] | None,
        typer.Option(
            help="One more argument for vLLM's api_server; repeat "
            "(e.g. --vllm-arg=--no-enable-prefix-caching)."
        ),
    ] = None,
    log_file: Annotated[
        Path | None, typer.Option(help="vLLM's own log (default: next to the ready file).")
    ] = None,
    state_file: Annotated[
        Path | None,
        typer.Option(
            help="Record each load here; on start, serve the last one instead of --model-dir "
            "(default: <home>/vllm-server-<port>.json)."
        ),
    ] = None,
    home: Annotated[Path, typer.Option(envvar="DARL_HOME", help="DARL's state directory.")] = Path(
        ".darl"
    ),
    ready_file: Annotated[
        Path | None, typer.Option(help="Write the launcher's address here once serving (JSON).")
    ] = None,
) -> None:
    """Start vLLM on a model directory and serve the launcher API: `POST /load_weights`
    {"path", "version"} restarts vLLM on that directory; `GET /status` says where it is."""
    setup_logging()
    from darl.serving.vllm_server import (
        UNRESTORED_VERSION,
        ModelDirError,
        VllmLauncher,
        VllmServerProcess,
        VllmSettings,
        check_model_dir,
        create_launcher_app,
        read_launcher_state,
        vllm_python,
    )

    state_file = state_file or home / f"vllm-server-{port}.json"
    recorded = read_launcher_state(state_file)
    if recorded is not None:
        try:
            model_dir, version = check_model_dir(recorded[0]), recorded[1]
            typer.echo(f"restoring the last load: {model_dir} as version {version}")
        except ModelDirError as err:
            # The model dir's weights, under a version no run has: the gateway records
            # nothing from this server until a weight sync loads the run's weights.
            version = UNRESTORED_VERSION
            typer.echo(
                f"cannot restore the last load ({err}): serving {model_dir} as version "
                f"{version} until a weight sync",
                err=True,
            )

    settings = VllmSettings(
        python=python or vllm_python(),
        host=host,
        served_model_name=served_model_name,
        enforce_eager=enforce_eager,
        kv_cache_gib=kv_cache_gib,
        stream_interval=stream_interval,
        extra_args=tuple(vllm_arg or ()),
        startup_timeout_seconds=startup_timeout,
    )
    if log_file is None:
        log_file = (ready_file.parent if ready_file else Path(".darl/logs")) / "vllm.log"
    server = VllmServerProcess(model_dir, log_file, settings, port=vllm_port, version=version)

    async def main(stop: asyncio.Event) -> None:
        server.start()
        try:
            ready = asyncio.ensure_future(server.wait_ready())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not ready.done():  # signalled while vLLM was starting
                ready.cancel()
                return
            typer.echo(f"vLLM ready at {ready.result()} (log {log_file})")
            launcher = VllmLauncher(server, state_file)
            watching = asyncio.create_task(launcher.watch())
            try:
                await serve_app(
                    create_launcher_app(launcher), host, port, stop, ready_file, "vllm-server"
                )
            finally:
                watching.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watching
        finally:
            await asyncio.to_thread(server.stop)

    run_until_signalled(main)
