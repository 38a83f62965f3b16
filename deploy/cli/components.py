"""The components of a deployment, each a long-lived process of its own: the reference policy
server, the gateway and the rollout worker."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated

import typer

from darl.deploy.cli.support import (
    Home,
    Host,
    Namespace,
    ReadyFile,
    TemporalAddress,
    app,
    run_until_signalled,
    run_worker,
    secret,
    setup_logging,
)
from darl.deploy.serving import serve_app
from darl.deploy.store_options import StoreUrl, open_checked_store, store_location
from darl.deploy.telemetry import configure_tracing, exports_traces
from darl.deploy.temporal_connection import (
    DEFAULT_ADDRESS,
    DEFAULT_NAMESPACE,
    TemporalSettings,
    connect,
)
from darl.gateway import defaults
from darl.workflows.names import ROLLOUT_TASK_QUEUE


@app.command("policy-server")
def policy_server(
    host: Host = "127.0.0.1",
    port: int = 8200,
    model_dir: Annotated[Path, typer.Option(help="Created from a seed if missing.")] = Path(
        ".darl/models/tiny"
    ),
    model: Annotated[
        str, typer.Option(help="Preset the model dir is created from: tiny or digits.")
    ] = "tiny",
    model_name: str = "darl-tiny",
    max_batch: int = 32,
    threads: Annotated[int, typer.Option(help="torch CPU threads.")] = 1,
    seed: int = 0,
    response_log: Annotated[
        Path | None, typer.Option(help="Append every answer's token ids here (JSONL).")
    ] = None,
    state_file: Annotated[
        Path | None,
        typer.Option(
            help="Record each weight load here and restore the last one on start "
            "(default: <home>/policy-server-<port>.json)."
        ),
    ] = None,
    home: Home = Path(".darl"),
    ready_file: ReadyFile = None,
) -> None:
    """Serve the tiny reference model with an OpenAI-compatible API (vLLM's fields)."""
    setup_logging()
    import torch

    from darl.serving.policy_app import create_policy_app
    from darl.serving.policy_server import PolicyServer
    from darl.serving.tiny_model import MODEL_PRESETS, create_model_dir

    if model not in MODEL_PRESETS:
        raise typer.BadParameter(f"--model must be one of {sorted(MODEL_PRESETS)}")
    torch.set_num_threads(threads)
    configure_tracing("darl-policy-server")
    server = PolicyServer(
        create_model_dir(model_dir, MODEL_PRESETS[model]),
        model_name,
        max_batch,
        seed,
        response_log=response_log,
        state_file=state_file or home / f"policy-server-{port}.json",
    )

    async def main(stop: asyncio.Event) -> None:
        server.engine.start()
        try:
            await serve_app(
                create_policy_app(server), host, port, stop, ready_file, "policy-server"
            )
        finally:
            await asyncio.to_thread(server.engine.stop)

    run_until_signalled(main)


@app.command()
def gateway(
    host: Host = "127.0.0.1",
    port: int = 8100,
    upstream: Annotated[
        list[str], typer.Option(envvar="DARL_UPSTREAMS", help="Policy server base URL; repeat.")
    ] = ["http://127.0.0.1:8200"],  # noqa: B006 - typer reads the default, never mutates it
    model: Annotated[str | None, typer.Option(help="Forced model name (default: ask)")] = None,
    store_dir: Path = Path(".darl/trajectories"),
    store_url: StoreUrl = None,
    store_fsync: Annotated[bool, typer.Option(help="fsync every record.")] = False,
    train_temperature: float = defaults.TRAIN_TEMPERATURE,
    val_temperature: float = defaults.VAL_TEMPERATURE,
    max_body_bytes: int = defaults.MAX_BODY_BYTES,
    call_deadline_seconds: float = defaults.CALL_DEADLINE_SECONDS,
    signal_interval: Annotated[
        float, typer.Option(help="Seconds between a rollout's batched call signals.")
    ] = defaults.SIGNAL_INTERVAL_SECONDS,
    journal_dir: Annotated[
        Path | None,
        typer.Option(
            help="The gateway's admin state and outages (default: beside the store: "
            "<store-dir>/_gateway, or <prefix>/_gateway/ of an S3 store)."
        ),
    ] = None,
    instance: Annotated[
        str, typer.Option(help="This gateway's name among those sharing the journal.")
    ] = defaults.INSTANCE,
    stale_wait_seconds: Annotated[
        float, typer.Option(help="How long a call waits for a policy server behind the run.")
    ] = defaults.STALE_WAIT_SECONDS,
    shutdown_grace_seconds: Annotated[
        float, typer.Option(help="On SIGTERM, how long calls in flight may take to finish.")
    ] = 30.0,
    closed_recheck_seconds: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="How long an attempt's closed mark in the store is taken as still absent "
            "(default: 0, every call looks, for a directory; 1 for S3, where a look is a "
            "request). A call of an attempt closed meanwhile is kept out of its rollout.",
        ),
    ] = None,
    temporal_address: TemporalAddress = DEFAULT_ADDRESS,
    namespace: Namespace = DEFAULT_NAMESPACE,
    home: Home = Path(".darl"),
    ready_file: ReadyFile = None,
) -> None:
    """Run the capturing OpenAI-compatible gateway."""
    setup_logging()
    from darl.gateway.app import create_app, unwrap
    from darl.gateway.calls.proxy import ProxySettings
    from darl.gateway.state import Gateway, GatewaySettings
    from darl.gateway.store.url import journal_storage

    location = store_location(store_url, store_dir)
    store = open_checked_store(location, fsync=store_fsync)
    configure_tracing("darl-gateway")
    settings = GatewaySettings(
        token_secret=secret("DARL_TOKEN_SECRET", home).encode(),
        admin_key=secret("DARL_ADMIN_KEY", home),
        upstreams=tuple(upstream),
        proxy=ProxySettings(
            model=model,
            train_temperature=train_temperature,
            val_temperature=val_temperature,
            call_deadline_seconds=call_deadline_seconds,
        ),
        max_body_bytes=max_body_bytes,
        signal_interval_seconds=signal_interval,
        upstream_api_key=os.environ.get("DARL_UPSTREAM_API_KEY"),
        journal_dir=journal_dir or journal_storage(location),
        instance=instance,
        stale_wait_seconds=stale_wait_seconds,
        closed_recheck_seconds=(
            closed_recheck_seconds
            if closed_recheck_seconds is not None
            else (1.0 if location.is_s3 else 0.0)
        ),
        traced=exports_traces(),
    )

    async def main(stop: asyncio.Event) -> None:
        client = await connect(TemporalSettings.from_env(temporal_address, namespace))
        app = create_app(settings, store, client)
        gateway_state: Gateway = unwrap(app).state.gateway
        try:
            await serve_app(
                app,
                host,
                port,
                stop,
                ready_file,
                "gateway",
                graceful_seconds=shutdown_grace_seconds,
                on_stop=gateway_state.begin_shutdown,
            )
        finally:
            await store.aclose()

    run_until_signalled(main)


@app.command()
def worker(
    gateway_url: Annotated[
        str, typer.Option(envvar="DARL_GATEWAY_URL", help="The gateway as agents reach it.")
    ] = "http://127.0.0.1:8100",
    gateway_admin_url: Annotated[
        str | None, typer.Option(help="The gateway's admin API (default: --gateway-url).")
    ] = None,
    agents_dir: Path = Path(".darl/agents"),
    task_queue: str = ROLLOUT_TASK_QUEUE,
    max_concurrent_agents: int = 256,
    k8s_namespace: Annotated[
        str | None,
        typer.Option(envvar="DARL_K8S_NAMESPACE", help="Run kubernetes agents as Jobs here."),
    ] = None,
    k8s_api_url: Annotated[
        str | None,
        typer.Option(envvar="DARL_K8S_API_URL", help="The API server (default: kubeconfig)."),
    ] = None,
    k8s_jobs_per_minute: Annotated[float, typer.Option(envvar="DARL_K8S_JOBS_PER_MINUTE")] = 120.0,
    k8s_sandbox_namespace: Annotated[
        str | None,
        typer.Option(
            envvar="DARL_K8S_SANDBOX_NAMESPACE",
            help="Run Jobs that ask for root (runAsUser: 0) here, under the runtime class.",
        ),
    ] = None,
    k8s_sandbox_runtime_class: Annotated[
        str | None,
        typer.Option(
            envvar="DARL_K8S_SANDBOX_RUNTIME_CLASS",
            help="The RuntimeClass of root Jobs: a sandboxing one (gVisor's runsc).",
        ),
    ] = None,
    k8s_grading_image: Annotated[
        str | None,
        typer.Option(
            envvar="DARL_K8S_GRADING_IMAGE",
            help="DARL's image, for the grading Jobs of graded Kubernetes agents.",
        ),
    ] = None,
    k8s_grading_volume_size: Annotated[
        str, typer.Option(envvar="DARL_K8S_GRADING_VOLUME_SIZE", help="Each graded attempt's.")
    ] = "20Gi",
    k8s_grading_storage_class: Annotated[
        str | None,
        typer.Option(
            envvar="DARL_K8S_GRADING_STORAGE_CLASS",
            help="The attempts' volumes' StorageClass (default: the cluster's).",
        ),
    ] = None,
    workflow_sandbox: Annotated[
        bool,
        typer.Option(
            envvar="DARL_WORKFLOW_SANDBOX",
            help="Run RolloutWorkflow in Temporal's sandbox (its determinism checks, at "
            "about 5 ms of CPU a rollout): a canary worker, say.",
        ),
    ] = False,
    temporal_address: TemporalAddress = DEFAULT_ADDRESS,
    namespace: Namespace = DEFAULT_NAMESPACE,
    home: Home = Path(".darl"),
    ready_file: ReadyFile = None,
) -> None:
    """Run a rollout worker (RolloutWorkflow and the agent activities)."""
    setup_logging()
    from darl.activities.runners.kubernetes_settings import KubernetesSettings
    from darl.activities.worker import RolloutWorkerSettings, build_worker

    try:
        kubernetes = (
            None
            if k8s_namespace is None
            else KubernetesSettings(
                namespace=k8s_namespace,
                api_url=k8s_api_url,
                jobs_per_minute=k8s_jobs_per_minute,
                sandbox_namespace=k8s_sandbox_namespace,
                sandbox_runtime_class=k8s_sandbox_runtime_class,
                grading_image=k8s_grading_image,
                grading_volume_size=k8s_grading_volume_size,
                grading_storage_class=k8s_grading_storage_class,
            )
        )
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    settings = RolloutWorkerSettings(
        gateway_url=gateway_url,
        gateway_admin_url=gateway_admin_url,
        token_secret=secret("DARL_TOKEN_SECRET", home).encode(),
        admin_key=secret("DARL_ADMIN_KEY", home),
        agents_dir=agents_dir.resolve(),
        task_queue=task_queue,
        max_concurrent_agents=max_concurrent_agents,
        kubernetes=kubernetes,
        traced=exports_traces(),
        sandboxed=workflow_sandbox,
    )
    configure_tracing("darl-rollout-worker")

    run_worker(
        lambda client, _http: build_worker(client, settings),
        TemporalSettings.from_env(temporal_address, namespace),
        settings.task_queue,
        ready_file,
    )
