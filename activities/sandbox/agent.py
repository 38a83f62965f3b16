"""How a local agent with a `sandbox` starts: its workspace prepared, then (isolation
`bubblewrap`) the supervisor that runs it under bwrap with the bridge to the gateway, or
(`none`) the agent itself in the workspace.

In the sandbox the agent sees its workspace at `workdir`, its task at /run/darl/task.json, a
private /tmp as HOME, the system and the Python read-only; its environment is the agent
contract (gateway addresses rewritten to the bridge's 127.0.0.1:<port>), the spec's `env`,
and the worker's locale and PATH, nothing else of the worker's.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from darl.activities.sandbox import bridge
from darl.activities.sandbox.bubblewrap import (
    RUN_DIR,
    SandboxLayout,
    SandboxTools,
    base_python,
    bwrap_argv,
    check_read_only,
    find_tools,
    give_to,
    kept_environment,
    sandbox_uid,
    shown,
    write_etc,
)
from darl.activities.sandbox.errors import SandboxSpecError
from darl.activities.sandbox.supervise import SOCKET_FILE, SupervisorConfig
from darl.activities.sandbox.workspace import prepare_workspace
from darl.workflows.contracts import SandboxSpec

SANDBOX_SOCKET = f"{RUN_DIR}/gateway.sock"
SANDBOX_TASK = f"{RUN_DIR}/task.json"
SANDBOX_BRIDGE = f"{RUN_DIR}/bridge.py"
LOOPBACK = "127.0.0.1"
BRIDGE_FILE = str(Path(bridge.__file__).resolve())
# The sandbox's own /etc files (`write_etc`), in the attempt's directory.
ETC_DIR = "etc"
# Where the bridge listens when the gateway's own port is privileged (< 1024): a sandbox
# without capabilities cannot bind that.
UNPRIVILEGED_PORT = 8080


@dataclass(frozen=True)
class AgentStart:
    """What the runner starts (under its exit-code wrapper): argv, environment and cwd."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path | None


@dataclass(frozen=True)
class Gateway:
    """The gateway as the worker reaches it, and as the agent does through the bridge."""

    origin: str  # scheme://host:port, as the contract's URLs start
    host: str
    port: int
    inside_port: int

    @classmethod
    def of(cls, base_url: str) -> Gateway:
        url = urlsplit(base_url)
        if url.scheme != "http" or url.hostname is None:
            raise SandboxSpecError(
                f"a sandboxed agent reaches the gateway over plain http through its bridge; "
                f"the gateway URL {base_url!r} is not http://host:port"
            )
        port = url.port or 80
        inside = port if port >= 1024 else UNPRIVILEGED_PORT
        return cls(f"{url.scheme}://{url.netloc}", url.hostname, port, inside)

    def rewrite(self, env: Mapping[str, str]) -> dict[str, str]:
        """The agent's variables with the gateway's address made the bridge's."""
        inside = f"http://{LOOPBACK}:{self.inside_port}"
        if inside == self.origin:
            return dict(env)
        origin = re.compile(re.escape(self.origin) + r"(?=/|$)")  # not http://gw2 for http://gw
        return {k: origin.sub(inside, v) for k, v in env.items()}


def check_sandbox(sandbox: SandboxSpec) -> SandboxTools | None:
    """Refuse a sandbox this machine cannot make before anything is prepared; the programs
    that make it (None for isolation `none`)."""
    if sandbox.isolation == "none":
        return None
    check_read_only(sandbox.read_only)
    return find_tools()


async def prepare_agent(
    sandbox: SandboxSpec,
    task: Any,
    attempt_dir: Path,
    argv: Sequence[str],
    *,
    worker_env: Mapping[str, str],
    agent_env: Mapping[str, str],
    gateway_url: str,
    task_file: Path,
    timeout: float,
) -> AgentStart:
    """Prepare the attempt's workspace (idempotent) and say how to start its agent.
    `agent_env` is the contract's and the spec's variables, `worker_env` what an
    unsandboxed agent inherits besides; `gateway_url` is the contract's base URL."""
    tools = check_sandbox(sandbox)
    if tools is None:
        workspace = await prepare_workspace(sandbox, task, attempt_dir, timeout)
        env = {**worker_env, **agent_env, "DARL_TASK_FILE": str(task_file)}
        return AgentStart(list(argv), env, workspace.tree)
    gateway = Gateway.of(gateway_url)
    read_only = (sys.base_prefix, *sandbox.read_only)
    _check_program(argv[0], read_only, {**worker_env, **agent_env}.get("PATH"))
    workspace = await prepare_workspace(sandbox, task, attempt_dir, timeout)
    uid = sandbox_uid(str(attempt_dir))
    await asyncio.to_thread(give_to, workspace.tree, uid)
    layout = SandboxLayout(
        workspace=workspace.tree,
        workdir=sandbox.workdir,
        limits=sandbox.limits,
        uid=uid,
        read_only=read_only,
        files=(
            (BRIDGE_FILE, SANDBOX_BRIDGE),
            (str(task_file), SANDBOX_TASK),
            *write_etc(attempt_dir / ETC_DIR),
        ),
        # Connecting needs write permission on the socket; it holds no data to change.
        writable=((str(attempt_dir / SOCKET_FILE), SANDBOX_SOCKET),),
    )
    inside = [base_python(), "-I", "-S", SANDBOX_BRIDGE, "--port", str(gateway.inside_port)]
    inside += ["--socket", SANDBOX_SOCKET, "--", *argv]
    config = SupervisorConfig(
        bwrap_argv=bwrap_argv(tools, layout, inside),
        bwrap_env=kept_environment(worker_env),
        gateway_host=gateway.host,
        gateway_port=gateway.port,
        socket_owner=uid,
    ).write(attempt_dir)
    env = kept_environment(worker_env) | gateway.rewrite(agent_env)
    env |= {"DARL_TASK_FILE": SANDBOX_TASK, "PWD": sandbox.workdir}
    supervisor = [sys.executable, "-m", "darl.activities.sandbox.supervise", str(config)]
    return AgentStart(supervisor, env, attempt_dir)


def _check_program(program: str, read_only: Sequence[str], path: str | None) -> None:
    """Refuse an agent command the sandbox would not show (a relative path names a file in
    the workspace, which it does)."""
    found = program if "/" in program else shutil.which(program, path=path)
    if found is not None and os.path.isabs(found) and not shown(found, read_only):
        raise SandboxSpecError(
            f"the agent command {program!r} is not in its sandbox: add its directory to "
            "sandbox.read_only"
        )
