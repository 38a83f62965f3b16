"""Debian's bubblewrap (`bwrap`) as DARL runs an agent or a grader's tests in it: a fresh root
showing the system directories and the Python read-only, the workspace read-write at the
workdir, a private /tmp, and nothing else of the host; every namespace unshared (the network
is loopback only), every capability dropped, no user namespace inside.

Running as root, bwrap keeps all capabilities in the sandbox unless told otherwise (checked
here: root in a sandbox without `--cap-drop ALL` remounted a read-only bind writable and wrote
to the host's /usr), hence `--cap-drop ALL`; `--disable-userns` stops a nested user namespace
from handing them back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from darl.activities.processes import wait_for_exit
from darl.activities.sandbox.errors import SandboxSpecError
from darl.activities.sandbox.supervise import BwrapLaunch
from darl.workflows.heartbeats import Heartbeat

# The system as this Debian lays it out; a path that is a link on the host (merged /usr) is
# the same link in the sandbox.
SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# DARL's own files inside a sandbox: the bridge, the gateway's socket, the task, the plugin.
RUN_DIR = "/run/darl"
HOME = "/tmp"

NO_BWRAP = (
    "sandbox isolation 'bubblewrap' needs bwrap on PATH: install it with `apt-get install "
    'bubblewrap`, or set "isolation": "none" knowing that it isolates nothing'
)

# How long the end of a sandbox's init may take once bwrap has gone: the kernel kills every
# process of the sandbox before its init is gone.
SANDBOX_END_SECONDS = 10.0

# Variables of the worker's environment that a sandboxed process keeps (locale, terminal,
# time zone, PATH); everything else it gets is set for it.
KEPT_VARIABLES = frozenset({"PATH", "LANG", "LANGUAGE", "TERM", "TZ"})


def find_bwrap() -> str:
    """bwrap's path, or SandboxSpecError with the one line that says what to do."""
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxSpecError(NO_BWRAP)
    return found


def base_python() -> str:
    """The interpreter the worker's Python is built on (a virtual environment's base): it
    lies under `sys.base_prefix`, which every sandbox shows."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    path = Path(sys.base_prefix) / "bin" / version
    if not path.exists():
        raise SandboxSpecError(f"the worker's base Python is not at {path}")
    return str(path)


def kept_environment(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k in KEPT_VARIABLES or k.startswith("LC_")} | {
        "HOME": HOME,
        "TMPDIR": "/tmp",
    }


@dataclass(frozen=True)
class SandboxLayout:
    """What a sandbox shows besides the system: `read_only` host paths at the same place,
    `files` host files at sandbox paths (read-only), `writable` host paths at sandbox paths,
    and the workspace read-write at `workdir`, where the command starts."""

    workspace: Path
    workdir: str
    read_only: tuple[str, ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    writable: tuple[tuple[str, str], ...] = ()


def shown(path: str, read_only: Sequence[str]) -> bool:
    """True when a sandbox showing `read_only` shows the host's absolute `path` there too."""
    return any(Path(path).is_relative_to(root) for root in (*SYSTEM_PATHS, *read_only))


def check_read_only(paths: Sequence[str]) -> None:
    relative = [p for p in paths if not os.path.isabs(p)]
    if relative:
        raise SandboxSpecError(f"sandbox.read_only paths must be absolute: {', '.join(relative)}")
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise SandboxSpecError(f"sandbox.read_only paths do not exist: {', '.join(missing)}")


def bwrap_argv(bwrap: str, layout: SandboxLayout, command: Sequence[str]) -> list[str]:
    """bwrap's argv running `command` in the layout (the options are the module's
    docstring)."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
    argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for path in dict.fromkeys(layout.read_only):
        argv += ["--ro-bind", path, path]
    for source, target in layout.files:
        argv += ["--ro-bind", source, target]
    for source, target in layout.writable:
        argv += ["--bind", source, target]
    argv += ["--bind", str(layout.workspace), layout.workdir]
    # Last: the root bwrap made (and the mount points in it) read-only.
    argv += ["--remount-ro", "/", "--chdir", layout.workdir, "--", *command]
    return argv


@dataclass(frozen=True)
class SandboxRun:
    exit_code: int | None
    timed_out: bool
    # False when bwrap could not make the sandbox or start its command.
    started: bool
    seconds: float


async def run_sandboxed(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    timeout: float,
    heartbeat: Heartbeat,
    heartbeat_every: float,
    cwd: Path | None = None,
    bwrap: bool = True,
) -> SandboxRun:
    """Run a command to its end (bwrap's argv, or a plain one when `bwrap` is False), its
    output to `log_path`, in a process group of its own that is killed whole at `timeout`."""
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        launch = stack.enter_context(BwrapLaunch(argv)) if bwrap else None
        with log_path.open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                *(launch.argv if launch else argv),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=dict(env),
                cwd=cwd,
                pass_fds=launch.pass_fds if launch else (),
                start_new_session=True,
            )
        if launch:
            launch.spawned()
        timed_out = await _wait_or_kill(proc, began + timeout, heartbeat, heartbeat_every)
        with contextlib.suppress(ProcessLookupError):  # what the command left behind
            os.killpg(proc.pid, signal.SIGKILL)
        ran, init = await asyncio.to_thread(launch.status) if launch else (True, None)
        if init is not None:
            await wait_for_exit(init, SANDBOX_END_SECONDS)
    return SandboxRun(
        exit_code=None if timed_out else proc.returncode,
        timed_out=timed_out,
        started=timed_out or ran,
        seconds=time.monotonic() - began,
    )


async def _wait_or_kill(
    proc: asyncio.subprocess.Process, deadline: float, heartbeat: Heartbeat, every: float
) -> bool:
    """Await the process, heartbeating; at the deadline kill its group: True if it did."""
    while proc.returncode is None:
        left = deadline - time.monotonic()
        if left <= 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), min(left, every))
        heartbeat()
    return False
