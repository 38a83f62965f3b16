"""One sandbox per attempt, with real bwrap and real processes: the agent writes only its
workspace and its own /tmp, reads nothing of the host beside what it is shown, reaches the
gateway (a stand-in HTTP server) through the bridge and nothing else on the network, and a
command it runs finds the rollout token in no process's environment but the agent's own (and
not there once the agent makes itself non-dumpable); a relaunch or an adoption keeps its
workspace, its exit status is recorded, and killing it leaves nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
from temporalio.exceptions import ApplicationError

from darl.activities.agent_contract import ContractIssuer
from darl.activities.runners.local import (
    EXIT_FILE,
    HANDLE_FILE,
    LocalProcessRunner,
    stop_leftover_agents,
)
from darl.activities.sandbox.bubblewrap import sandbox_uid
from darl.activities.sandbox.workspace import READY_FILE
from darl.workflows.contracts import (
    AwaitRequest,
    GraderSpec,
    LaunchRequest,
    LocalAgentSpec,
    RewardSpec,
    RolloutSpec,
    RolloutTimeouts,
    SandboxLimits,
    SandboxSpec,
)

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "bwrap"], capture_output=True).returncode != 0,
    reason="bubblewrap is not installed (apt-get install bubblewrap)",
)

BASE_PYTHON = f"{sys.base_prefix}/bin/python3"

# Run inside the sandbox by the worker's base Python: each check says what happened.
PROBE = r"""
import json, os, socket, subprocess, sys, urllib.request

def attempt(action):
    try:
        return "ok: " + str(action())
    except Exception as err:
        return "error: " + type(err).__name__

def write(path):
    def go():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("escaped")
        return path
    return go

def gateway():
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/models",
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
    )
    return urllib.request.urlopen(request, timeout=10).read().decode()

# What a command the agent runs can read of the token: its environment has the token blanked
# (as a harness's command environment can), so only /proc could hand it over.
COMMAND = '''
import json, os, sys

token = sys.stdin.read()
seen = {}
for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
    cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode().strip()
    try:
        environ = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
        holds = "token readable" if token in environ else "no token"
    except OSError as err:
        holds = "unreadable: " + type(err).__name__
    seen[pid] = [cmd, holds]
print(json.dumps(seen))
'''

def processes():
    token = os.environ["OPENAI_API_KEY"]
    env = {k: v for k, v in os.environ.items() if token not in v}
    run = subprocess.run([sys.executable, "-c", COMMAND], input=token, env=env,
                         capture_output=True, text=True, timeout=30)
    return json.loads(run.stdout)

def not_dumpable():
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE: what a careful harness does

def limits():
    import resource
    names = ("RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_CPU", "RLIMIT_FSIZE")
    return {name: resource.getrlimit(getattr(resource, name)) for name in names}

def new_user_namespace():
    import ctypes
    if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:  # CLONE_NEWUSER
        raise OSError(ctypes.get_errno(), "unshare")
    return "made"

probe = json.loads(os.environ["PROBE"])
report = {
    "uid": os.getuid(),
    "passwd": open("/etc/passwd").read(),
    "shadow": attempt(lambda: open("/etc/shadow").read()),
    "etc": sorted(os.listdir("/etc")),
    "limits": limits(),
    "tmp_size": os.statvfs("/tmp").f_blocks * os.statvfs("/tmp").f_frsize,
    "user_namespace": attempt(new_user_namespace),
    "oom_score_adj": open("/proc/self/oom_score_adj").read().strip(),
    "workspace": attempt(write("/testbed/agent-wrote.txt")),
    "own_tmp": attempt(write("/tmp/scratch/agent-wrote.txt")),
    "escapes": {path: attempt(write(path)) for path in probe["escapes"]},
    "secret": attempt(lambda: open(probe["secret"]).read()),
    "other_port": attempt(lambda: socket.create_connection(("127.0.0.1", probe["port"]), 3)),
    "gateway": attempt(gateway),
    "task": open(os.environ["DARL_TASK_FILE"]).read(),
    "env": dict(os.environ),
    "cwd": os.getcwd(),
    "processes": processes(),
}
not_dumpable()
report["processes_of_a_careful_harness"] = processes()
with open("/testbed/probe.json", "w") as f:
    json.dump(report, f)
sys.exit(3)
"""


class StandInGateway(BaseHTTPRequestHandler):
    """Stands in for DARL's gateway: answers every GET and records who asked."""

    seen: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization")))
        body = b'{"data": [{"id": "stand-in"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@dataclass(frozen=True)
class Host:
    repos_dir: Path
    commit: str
    tools: Path  # the probe, shown read-only
    secret: Path
    gateway_port: int
    other_port: int


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    root = tmp_path_factory.mktemp("sandbox")
    source = root / "source"
    source.mkdir()
    (source / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=source, check=True)
    subprocess.run([*git, "add", "-A"], cwd=source, check=True)
    subprocess.run([*git, "commit", "-qm", "bug"], cwd=source, check=True)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=source, capture_output=True, text=True, check=True
    ).stdout.strip()
    subprocess.run(
        ["git", "clone", "-q", "--bare", str(source), str(root / "repos" / "org__calc")],
        check=True,
    )
    (root / "tools").mkdir()
    (root / "tools" / "probe.py").write_text(PROBE)
    (root / "tasks").mkdir()
    secret = root / "tasks" / "secret.txt"
    secret.write_text("the hidden tests")
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInGateway)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    other = socket.create_server(("127.0.0.1", 0))
    yield Host(
        root / "repos",
        commit,
        root / "tools",
        secret,
        server.server_address[1],
        other.getsockname()[1],
    )
    other.close()
    server.shutdown()
    serving.join(timeout=10)


@pytest.fixture
def agents_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    stop_leftover_agents(tmp_path, grace_seconds=2)


def rollout(
    host: Host, command: list[str], env: dict[str, str] | None = None, **sandbox: object
) -> LaunchRequest:
    spec = RolloutSpec(
        run_id="run",
        rollout_id="r1",
        task={
            "repo": "org/calc",
            "base_commit": host.commit,
            "FAIL_TO_PASS": [],
            "PASS_TO_PASS": [],
            "test_patch": "the hidden tests",
        },
        agent=LocalAgentSpec(
            command=command,
            env=env or {},
            sandbox=SandboxSpec(
                repos_dir=str(host.repos_dir), read_only=[str(host.tools)], **sandbox
            ),
        ),
        reward=RewardSpec(grader=GraderSpec(kind="command", command=["true"])),
        timeouts=RolloutTimeouts(agent_seconds=60, heartbeat_seconds=3),
        revision=3,
    )
    return LaunchRequest(spec=spec, attempt=1)


def issuer(host: Host) -> ContractIssuer:
    # `localhost`, not loopback's address: the agent's URLs must be rewritten to the bridge.
    return ContractIssuer(f"http://localhost:{host.gateway_port}", b"secret")


async def run_to_end(runner: LocalProcessRunner, host: Host, request: LaunchRequest) -> int | None:
    contract = issuer(host).issue(request.spec, 1, None, {})
    handle = await runner.launch(request, contract)
    await_request = AwaitRequest(spec=request.spec, attempt=1, handle=handle, one_activity=True)
    agent_exit = await asyncio.wait_for(runner.wait(await_request, contract, lambda *_: None), 60)
    return agent_exit.exit_code


async def test_the_agent_sees_its_workspace_and_the_gateway_only(
    host: Host, agents_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DARL_WORKER_ONLY", "a worker's variable")
    mark = uuid.uuid4().hex[:8]
    attempt_dir = agents_dir / "r1" / "attempt-1"
    escapes = [
        str(attempt_dir / f"escape-{mark}.txt"),  # its own attempt's directory on the host
        f"/tmp/escape-{mark}/agent-wrote.txt",  # the host's /tmp
        f"/work/escape-{mark}.txt",
        f"{os.environ['HOME']}/escape-{mark}.txt",
    ]
    probe = {"escapes": escapes, "secret": str(host.secret), "port": host.other_port}
    request = rollout(
        host, [BASE_PYTHON, str(host.tools / "probe.py")], env={"PROBE": json.dumps(probe)}
    )
    StandInGateway.seen.clear()
    # The port the sandbox cannot reach is reachable from the host: the check can fail.
    socket.create_connection(("127.0.0.1", host.other_port), 3).close()

    assert await run_to_end(LocalProcessRunner(agents_dir), host, request) == 3
    assert (attempt_dir / EXIT_FILE).read_text() == "3"

    workspace = attempt_dir / "workspace"
    report = json.loads((workspace / "probe.json").read_text())
    assert report["workspace"].startswith("ok") and (workspace / "agent-wrote.txt").exists()
    assert report["own_tmp"].startswith("ok")
    for path in escapes:
        assert not os.path.exists(path), f"the sandbox wrote {path} on the host"
    assert report["secret"].startswith("error"), report["secret"]
    assert report["other_port"].startswith("error"), report["other_port"]
    # The gateway, over the bridge, with the attempt's token; its address rewritten.
    assert report["gateway"].startswith("ok"), report["gateway"]
    env = report["env"]
    assert env["OPENAI_API_KEY"].startswith("darl1.")  # the attempt's rollout token
    assert StandInGateway.seen == [("/rollouts/r1/v1/models", f"Bearer {env['OPENAI_API_KEY']}")]
    assert env["OPENAI_BASE_URL"] == f"http://127.0.0.1:{host.gateway_port}/rollouts/r1/v1"
    assert "DARL_WORKER_ONLY" not in env and "DARL_AGENT_KEY" not in env
    assert env["HOME"] == "/tmp" and report["cwd"] == "/testbed"
    # The agent's view of the task: the grader's hidden fields are not in it.
    assert "test_patch" not in json.loads(report["task"])
    # No process of the host is visible: the sandbox's init, the bridge, the agent, the
    # command. The token is in no environment but the agent's, which the harness must guard.
    seen = report["processes"]
    for name in ("processes", "processes_of_a_careful_harness"):
        facts = [(cmd.split()[0].rsplit("/", 1)[-1], h) for cmd, h in report[name].values()]
        print(f"{name} as a command of the agent sees them:", facts)
    # A root worker's sandbox has two bwraps: the one that set it up as root (its init) and
    # the one that took user namespaces away from the sandbox's user.
    bwraps = ["bwrap", "bwrap"] if os.geteuid() == 0 else ["bwrap"]
    programs = [cmd.split()[0].rsplit("/", 1)[-1] for cmd, _ in seen.values()]
    assert programs == [*bwraps, "python3.11", "python3", "python3"]
    *sandbox, bridge, agent, _command = (holds for _, holds in seen.values())
    assert (bridge, agent) == ("unreadable: PermissionError", "token readable")
    assert "token readable" not in sandbox
    careful = [holds for _, holds in report["processes_of_a_careful_harness"].values()]
    assert "token readable" not in careful


async def test_the_agent_runs_unprivileged_within_its_limits(host: Host, agents_dir: Path) -> None:
    """Whatever the worker runs as: uid 1000 of the sandbox's own /etc/passwd, no host user's
    files (no /etc/shadow), no user namespace of its own, the limits of its spec on every
    process, its /tmp of their size, and the OOM killer's first choice."""
    limits = SandboxLimits(memory_mb=3000, processes=64, cpu_seconds=120, file_size_mb=50)
    limits = limits.model_copy(update={"tmp_mb": 64})
    request = rollout(
        host,
        [BASE_PYTHON, str(host.tools / "probe.py")],
        env={
            "PROBE": json.dumps(
                {"escapes": [], "secret": str(host.secret), "port": host.other_port}
            )
        },
        limits=limits,
    )
    assert await run_to_end(LocalProcessRunner(agents_dir), host, request) == 3
    workspace = agents_dir / "r1" / "attempt-1" / "workspace"
    report = json.loads((workspace / "probe.json").read_text())
    assert report["uid"] == 1000
    assert report["passwd"].splitlines()[1] == "sandbox:x:1000:1000:sandbox:/tmp:/bin/sh"
    assert report["shadow"] == "error: FileNotFoundError"
    assert not {"shadow", "gshadow", "sudoers", "machine-id"} & set(report["etc"])
    assert report["user_namespace"].startswith("error"), report["user_namespace"]
    mib = 1024 * 1024
    assert report["limits"] == {
        "RLIMIT_AS": [3000 * mib] * 2,
        "RLIMIT_NPROC": [64] * 2,
        "RLIMIT_CPU": [120] * 2,
        "RLIMIT_FSIZE": [50 * mib] * 2,
    }
    assert report["tmp_size"] == 64 * mib
    assert report["oom_score_adj"] == "1000"
    # On the host, what the agent wrote is a sandbox user's, never root's.
    owner = (workspace / "probe.json").stat().st_uid
    assert owner == (sandbox_uid(str(agents_dir / "r1" / "attempt-1")) or os.getuid())
    assert owner != 0


async def test_without_bwrap_the_launch_says_what_to_do(
    host: Host, agents_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    request = rollout(host, ["/bin/true"])
    with pytest.raises(ApplicationError) as refused:
        await LocalProcessRunner(agents_dir).launch(
            request, issuer(host).issue(request.spec, 1, None, {})
        )
    assert refused.value.type == "AgentSpecError" and refused.value.non_retryable
    assert "apt-get install bubblewrap" in str(refused.value)
    assert '"isolation": "none"' in str(refused.value)
    assert not (agents_dir / "r1" / "attempt-1" / "workspace").exists()


async def test_a_relaunch_or_adoption_keeps_the_workspace_and_kill_leaves_nothing(
    host: Host, agents_dir: Path
) -> None:
    ready = host.tools / f"ready-{uuid.uuid4().hex[:8]}"
    os.mkfifo(ready)
    os.chmod(ready, 0o666)  # the sandbox's user writes it
    request = rollout(host, ["/bin/sh", "-c", f"echo up > {ready}; exec /bin/sleep 60"])
    contract = issuer(host).issue(request.spec, 1, None, {})
    runner = LocalProcessRunner(agents_dir, kill_grace_seconds=2)
    handle = await runner.launch(request, contract)
    await asyncio.wait_for(_read_fifo(ready), 10)  # the agent runs in its sandbox
    workspace = agents_dir / "r1" / "attempt-1" / "workspace"
    (workspace / "work-in-progress.txt").write_text("the agent's work")
    ready_mark = (agents_dir / "r1" / "attempt-1" / READY_FILE).stat().st_mtime_ns

    again = await LocalProcessRunner(agents_dir).launch(request, contract)
    assert again == handle
    # A launch that died before saving its handle: the retry adopts the agent it started.
    (agents_dir / "r1" / "attempt-1" / HANDLE_FILE).unlink()
    adopted = await LocalProcessRunner(agents_dir).launch(request, contract)
    assert adopted.data["pid"] == handle.data["pid"]
    assert (workspace / "work-in-progress.txt").read_text() == "the agent's work"
    assert (agents_dir / "r1" / "attempt-1" / READY_FILE).stat().st_mtime_ns == ready_mark

    leader = psutil.Process(handle.data["pid"])
    # The supervisor, bwrap and its init, the bridge, the agent.
    descendants = leader.children(recursive=True)
    names = " ".join(" ".join(p.cmdline()) for p in descendants)
    assert len(descendants) >= 5, names
    assert "darl.activities.sandbox.supervise" in names and "bwrap" in names, names
    assert "bridge.py" in names, names
    await runner.kill(handle)
    await asyncio.wait_for(_exited([leader, *descendants]), 10)


async def test_isolation_none_runs_the_agent_in_its_workspace_copy(
    host: Host, agents_dir: Path
) -> None:
    request = rollout(host, ["/bin/sh", "-c", "pwd; cat $DARL_TASK_FILE"], isolation="none")
    assert await run_to_end(LocalProcessRunner(agents_dir), host, request) == 0
    log = (agents_dir / "r1" / "attempt-1" / "agent.log").read_text()
    assert str(agents_dir / "r1" / "attempt-1" / "workspace") in log
    assert "base_commit" in log and "test_patch" not in log
    assert (agents_dir / "r1" / "attempt-1" / "workspace" / "calc.py").exists()


async def test_a_sandbox_that_cannot_start_is_not_an_agent_failure(
    host: Host, agents_dir: Path
) -> None:
    # bwrap cannot make a mount point inside the read-only /usr.
    request = rollout(host, ["/bin/true"], workdir="/usr/testbed")
    with pytest.raises(ApplicationError) as failed:
        await run_to_end(LocalProcessRunner(agents_dir), host, request)
    assert failed.value.type == "AgentSpecError"
    assert "sandbox did not start" in str(failed.value)


async def _exited(processes: list[psutil.Process]) -> None:
    """Return once every process has exited (a pidfd per process, no polling)."""
    loop = asyncio.get_running_loop()
    for proc in processes:
        try:
            fd = os.pidfd_open(proc.pid)
        except ProcessLookupError:
            continue
        gone: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, lambda gone=gone: gone.done() or gone.set_result(None))
        try:
            await gone
        finally:
            loop.remove_reader(fd)
            os.close(fd)


async def _read_fifo(path: Path) -> bytes:
    """The first line written to a fifo, without blocking the loop (or a thread) on it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
    try:
        await readable
        return os.read(fd, 100)
    finally:
        loop.remove_reader(fd)
        os.close(fd)
