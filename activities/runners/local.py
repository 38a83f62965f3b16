"""Local process runner: each attempt's agent is a process group of its own on this machine.

State lives on disk under `<agents_dir>/<rollout>/attempt-<n>/` (handle, task, log, exit code),
so a worker that replaces a crashed one re-attaches to the agent still running there. A small
`sh` wrapper records the agent's exit status in `exit_code`, since only the parent could
otherwise learn it. An agent with a `sandbox` gets the attempt's workspace there too
(`workspace/`, its git directory `git/`) and, under bubblewrap, runs inside the sandbox's
supervisor (`darl.activities.sandbox`), which the wrapper starts in its place; the runner also
grades such an attempt (`grade`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from darl.activities.agent_contract import AgentContract, TaskFieldError, inherited_env
from darl.activities.errors import agent_lost_error, agent_spec_error, agent_stopped_error
from darl.activities.processes import NotARegularFileError, file_tail, read_file, wait_for_exit
from darl.activities.runners.base import (
    LOG_TAIL_BYTES,
    AgentRunner,
    agent_deadline,
    agent_heartbeat_interval,
)
from darl.activities.sandbox import grading
from darl.activities.sandbox.agent import AgentStart, prepare_agent
from darl.activities.sandbox.errors import SandboxSpecError
from darl.activities.sandbox.supervise import FAILED_FILE
from darl.activities.worker_paths import expand, expand_env, expand_sandbox
from darl.files import write_atomically
from darl.workflows.contracts import (
    AgentExit,
    AgentHandle,
    AwaitRequest,
    GradeReport,
    LaunchRequest,
    LocalAgentSpec,
)
from darl.workflows.heartbeats import Heartbeat

log = logging.getLogger(__name__)

# $1 is the exit-code file; the rest is the agent's argv. The file appears (atomically) only
# when the agent exited by itself; a killed group leaves none.
_WRAPPER = 'f=$1; shift; "$@"; c=$?; printf "%s" "$c" > "$f.tmp" && mv "$f.tmp" "$f"; exit "$c"'

HANDLE_FILE = "handle.json"
LAUNCH_MARKER = "launching"
STOPPED_MARKER = "stopped"
EXIT_FILE = "exit_code"
LOG_FILE = "agent.log"
TASK_FILE = "task.json"
AGENT_KEY_ENV = "DARL_AGENT_KEY"


def _read_exit_code(path: Path) -> int | None:
    """The agent's exit status, once its wrapper wrote it (None before). Read without
    following a link or waiting: an agent without isolation could put a FIFO there."""
    try:
        text = read_file(path, 32)
    except FileNotFoundError:
        return None
    except NotARegularFileError:
        return 1  # not what the wrapper writes: the agent's own doing
    try:
        return int(text)
    except ValueError:
        return 1


def _log_tail(attempt_dir: Path) -> str:
    return file_tail(attempt_dir / LOG_FILE, LOG_TAIL_BYTES)


def _check_sandbox_started(attempt_dir: Path) -> None:
    """An agent whose sandbox could not be made never ran: the sandbox, not the agent, failed."""
    try:
        why = read_file(attempt_dir / FAILED_FILE, 4096).decode(errors="replace")
    except (FileNotFoundError, NotARegularFileError):
        return  # none, or not what the supervisor writes (an agent without isolation's)
    raise agent_spec_error(
        f"the agent's sandbox did not start ({why}): {_log_tail(attempt_dir)[-500:]}"
    )


def _is_our_leader(pid: int, create_time: float, boot_time: float | None = None) -> bool:
    """True while the process that leads the agent's group still runs (not a reused pid).
    Compared as time since boot when the handle has the boot time it was read under: psutil's
    create_time adds the boot time the kernel derives from the wall clock, so a clock step
    moves it by whole seconds, and a live agent would look like another process."""
    try:
        proc = psutil.Process(pid)
        started = proc.create_time()
        if boot_time is not None:
            started, create_time = started - psutil.boot_time(), create_time - boot_time
        return abs(started - create_time) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _leader_of(handle: AgentHandle) -> tuple[int, float, float | None]:
    """(pid, create_time, boot_time) of a handle's group leader; boot_time None in a handle
    saved before it was kept."""
    data = handle.data
    boot_time = data.get("boot_time")
    return (
        int(data["pid"]),
        float(data["create_time"]),
        None if boot_time is None else float(boot_time),
    )


def _find_adoptable(agent_key: str) -> psutil.Process | None:
    """A group leader started for this attempt by a launch that died before saving its handle."""
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if os.getpgid(proc.pid) == proc.pid and proc.environ().get(AGENT_KEY_ENV) == agent_key:
                return proc
    return None


class LocalProcessRunner(AgentRunner):
    kind = "local"

    def __init__(self, agents_dir: Path, kill_grace_seconds: float = 5.0) -> None:
        self._agents_dir = agents_dir
        self._kill_grace = kill_grace_seconds
        # Agents this process started, so it can reap them (a re-attached one is not our child).
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def attempt_dir(self, rollout_id: str, attempt: int) -> Path:
        return self._agents_dir / rollout_id / f"attempt-{attempt}"

    async def launch(self, request: LaunchRequest, contract: AgentContract) -> AgentHandle:
        spec = request.spec
        agent = spec.agent
        if not isinstance(agent, LocalAgentSpec):
            raise agent_spec_error(f"the local runner cannot run a {agent.kind!r} agent")
        attempt_dir = self.attempt_dir(spec.rollout_id, request.attempt)
        attempt_dir.mkdir(parents=True, exist_ok=True)
        if (attempt_dir / STOPPED_MARKER).exists():
            raise agent_stopped_error(f"attempt {request.attempt} of {spec.rollout_id} was stopped")
        handle_path = attempt_dir / HANDLE_FILE
        if handle_path.exists():
            log.info("agent of %s attempt %d already launched", spec.rollout_id, request.attempt)
            return AgentHandle.model_validate_json(handle_path.read_text())
        agent_key = str(attempt_dir)  # unique to this attempt on this machine
        marker = attempt_dir / LAUNCH_MARKER
        if marker.exists():
            # An earlier launch died after starting the agent but before saving its handle.
            adopted = _find_adoptable(agent_key)
            if adopted is not None:
                return self._save_handle(request, attempt_dir, adopted.pid, adopted.create_time())
            if (attempt_dir / EXIT_FILE).exists():
                # ... and the agent has finished since: its exit code is its result.
                return self._save_handle(request, attempt_dir, None, time.time())
        start = await self._prepare(request, agent, contract, attempt_dir)
        marker.touch()
        env = start.env | {AGENT_KEY_ENV: agent_key}
        wrapper = ["/bin/sh", "-c", _WRAPPER, "darl-agent", str(attempt_dir / EXIT_FILE)]
        with (attempt_dir / LOG_FILE).open("ab") as log_file:
            try:
                proc = await asyncio.to_thread(
                    subprocess.Popen,
                    [*wrapper, *start.argv],
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=start.cwd,
                    start_new_session=True,
                )
            except OSError as err:
                raise agent_spec_error(f"cannot start agent {start.argv!r}: {err}") from err
        self._children[proc.pid] = proc
        create_time = psutil.Process(proc.pid).create_time()
        handle = self._save_handle(request, attempt_dir, proc.pid, create_time)
        if (attempt_dir / STOPPED_MARKER).exists():  # stopped while we were starting it
            await self.kill(handle)
            raise agent_stopped_error(f"attempt {request.attempt} of {spec.rollout_id} was stopped")
        return handle

    async def _prepare(
        self,
        request: LaunchRequest,
        agent: LocalAgentSpec,
        contract: AgentContract,
        attempt_dir: Path,
    ) -> AgentStart:
        """The agent's argv, environment and cwd; a sandboxed agent's workspace prepared. The
        task file is always the agent's view of the task (the grader's hidden fields out)."""
        spec = request.spec
        task_file = attempt_dir / TASK_FILE
        write_atomically(task_file, json.dumps(spec.agent_task()))
        worker_env = inherited_env()
        agent_env = contract.env | expand_env(agent.env)
        argv = self._argv(agent, worker_env | agent_env)
        if agent.sandbox is None:
            env = worker_env | agent_env | {"DARL_TASK_FILE": str(task_file)}
            return AgentStart(argv, env, Path(agent.cwd) if agent.cwd else None)
        if agent.entrypoint is not None:
            raise agent_spec_error(
                "a sandboxed agent runs a 'command' (the sandbox does not show DARL's code to "
                "an 'entrypoint')"
            )
        try:
            return await prepare_agent(
                expand_sandbox(agent.sandbox),
                spec.task,
                attempt_dir,
                argv,
                worker_env=worker_env,
                agent_env=agent_env,
                gateway_url=contract.base_url,
                task_file=task_file,
                timeout=spec.timeouts.launch_seconds,
            )
        except (SandboxSpecError, TaskFieldError) as err:
            raise agent_spec_error(str(err)) from err

    async def grade(self, request: AwaitRequest, heartbeat: Heartbeat) -> GradeReport:
        return await grading.grade(request.spec, Path(request.handle.data["dir"]), heartbeat)

    async def wait(
        self, request: AwaitRequest, contract: AgentContract, heartbeat: Heartbeat
    ) -> AgentExit:
        handle = request.handle
        attempt_dir = Path(handle.data["dir"])
        if handle.data["pid"] is None:  # adopted after it had already finished
            _check_sandbox_started(attempt_dir)
            code = _read_exit_code(attempt_dir / EXIT_FILE)
            return AgentExit(exit_code=code, log_tail=_log_tail(attempt_dir))
        pid, create_time, boot_time = _leader_of(handle)
        timeouts = request.spec.timeouts
        deadline = agent_deadline(request)
        interval = agent_heartbeat_interval(timeouts.heartbeat_seconds)
        while True:
            code = _read_exit_code(attempt_dir / EXIT_FILE)
            if code is not None:
                await self._after_exit(pid)
                _check_sandbox_started(attempt_dir)
                return AgentExit(exit_code=code, log_tail=_log_tail(attempt_dir))
            if not _is_our_leader(pid, create_time, boot_time):
                # The wrapper writes the file before it exits: read once more, then it is lost.
                code = _read_exit_code(attempt_dir / EXIT_FILE)
                if code is not None:
                    continue
                await self._after_exit(pid)
                raise agent_lost_error(
                    f"agent process {pid} ended without an exit status (killed from outside "
                    f"DARL); log tail: {_log_tail(attempt_dir)[-500:]}"
                )
            now = time.time()
            if now >= deadline:
                await self.kill(handle)
                return AgentExit(exit_code=None, timed_out=True, log_tail=_log_tail(attempt_dir))
            heartbeat({"pid": pid})
            await wait_for_exit(pid, min(interval, deadline - now))

    async def kill(self, handle: AgentHandle) -> None:
        if handle.data["pid"] is None:
            return
        pid, create_time, boot_time = _leader_of(handle)
        if _is_our_leader(pid, create_time, boot_time):
            self._signal_group(pid, signal.SIGTERM)
            await wait_for_exit(pid, self._kill_grace)
        await self._after_exit(pid)

    async def stop(self, request: LaunchRequest) -> None:
        attempt_dir = self.attempt_dir(request.spec.rollout_id, request.attempt)
        attempt_dir.mkdir(parents=True, exist_ok=True)
        (attempt_dir / STOPPED_MARKER).touch()
        handle_path = attempt_dir / HANDLE_FILE
        if handle_path.exists():
            await self.kill(AgentHandle.model_validate_json(handle_path.read_text()))
        elif (attempt_dir / LAUNCH_MARKER).exists():
            adopted = _find_adoptable(str(attempt_dir))
            if adopted is not None:
                self._signal_group(adopted.pid, signal.SIGKILL)

    async def aclose(self) -> None:
        self._children.clear()

    def _save_handle(
        self, request: LaunchRequest, attempt_dir: Path, pid: int | None, create_time: float
    ) -> AgentHandle:
        handle = AgentHandle(
            kind=self.kind,
            rollout_id=request.spec.rollout_id,
            attempt=request.attempt,
            started_at=create_time,
            # The boot time create_time was read under (see _is_our_leader).
            data={
                "pid": pid,
                "create_time": create_time,
                "boot_time": psutil.boot_time(),
                "dir": str(attempt_dir),
            },
        )
        write_atomically(attempt_dir / HANDLE_FILE, handle.model_dump_json())
        return handle

    @staticmethod
    def _argv(agent: LocalAgentSpec, env: dict[str, str]) -> list[str]:
        if agent.entrypoint is not None:
            return [
                sys.executable,
                "-m",
                "darl.activities.runners.agl_entrypoint",
                agent.entrypoint,
            ]
        argv = [expand(part) for part in agent.command or []]
        if "/" not in argv[0] and shutil.which(argv[0], path=env.get("PATH")) is None:
            raise agent_spec_error(f"agent command {argv[0]!r} is not on PATH")
        return argv

    async def _after_exit(self, pid: int) -> None:
        """The leader is gone (or going): kill what the agent left in its group, then reap."""
        self._signal_group(pid, signal.SIGKILL)
        proc = self._children.pop(pid, None)
        if proc is not None:
            await wait_for_exit(pid, self._kill_grace)
            if proc.poll() is None:
                log.warning("agent process %d did not exit after SIGKILL", pid)

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        if pgid <= 1:  # 0 would be our own group; never signal init
            raise ValueError(f"refusing to signal process group {pgid}")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def stop_leftover_agents(agents_dir: Path, grace_seconds: float = 5.0) -> int:
    """Kill every agent under `agents_dir` still running; returns how many there were.

    A stopping worker leaves its agents running on purpose (the next worker re-attaches to
    them). Whoever stops the whole machine's stack for good calls this, so nothing is left
    behind; a rollout whose agent was killed this way gets a new attempt when it resumes.
    Synchronous, for shutdown paths with or without an event loop.
    """
    leaders = []
    for path in agents_dir.glob(f"*/attempt-*/{HANDLE_FILE}"):
        handle = AgentHandle.model_validate_json(path.read_text())
        if handle.data["pid"] is None:
            continue
        pid, create_time, boot_time = _leader_of(handle)
        if _is_our_leader(pid, create_time, boot_time):
            leaders.append(psutil.Process(pid))
    for leader in leaders:
        LocalProcessRunner._signal_group(leader.pid, signal.SIGTERM)
    psutil.wait_procs(leaders, timeout=grace_seconds)
    for leader in leaders:
        LocalProcessRunner._signal_group(leader.pid, signal.SIGKILL)
    return len(leaders)
