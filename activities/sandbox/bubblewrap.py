"""Debian's bubblewrap (`bwrap`) as DARL runs an agent or a grader's tests in it: a fresh root
showing the system read-only (/usr, and of /etc only the files programs need, with an
/etc/passwd of its own), the Python read-only, the workspace read-write at the workdir, a
private /tmp of a bounded size, and nothing else of the host; every namespace unshared (the
network is loopback only), no capability, no user namespace inside, and the limits of
`SandboxLimits` on every process (`prlimit`, util-linux's).

It runs as an unprivileged user whatever the worker runs as: uid 1000 inside. A worker that
runs as root sets the sandbox up as root (so it can show paths only root may reach, such as a
Python under /root) and runs its command as a host uid of the sandbox's own (`sandbox_uid`,
never root, owning the workspace), through a second bwrap that takes away user namespaces;
a worker that is not root runs bwrap unprivileged, in a user namespace. Running as root,
bwrap keeps all capabilities in the sandbox unless told otherwise (checked here: root in a
sandbox without `--cap-drop ALL` remounted a read-only bind writable and wrote to the host's
/usr), hence `--cap-drop ALL` but for the two that switching the user takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from darl.activities.heartbeats import Heartbeater
from darl.activities.processes import wait_for_exit
from darl.activities.sandbox.errors import SandboxSpecError
from darl.activities.sandbox.supervise import BwrapLaunch
from darl.workflows.contracts import SandboxLimits

# The system as this Debian lays it out; a path that is a link on the host (merged /usr) is
# the same link in the sandbox.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What of /etc a sandbox shows (those the host has): the loader's cache, time, locale and
# name service settings, certificates, Debian's alternatives (many commands are links
# through them), shells' start-up files. Never passwd, shadow or the host's own names.
ETC_ENTRIES = (
    "alternatives",
    "bash.bashrc",
    "ca-certificates",
    "ca-certificates.conf",
    "debian_version",
    "gai.conf",
    "gitconfig",
    "host.conf",
    "inputrc",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "locale.alias",
    "localtime",
    "magic",
    "magic.mime",
    "mime.types",
    "nsswitch.conf",
    "os-release",
    "profile",
    "protocols",
    "services",
    "ssl",
    "terminfo",
    "timezone",
)
# DARL's own files inside a sandbox: the bridge, the gateway's socket, the task, the plugin.
RUN_DIR = "/run/darl"
HOME = "/tmp"
# The user a sandbox's processes run as, as the sandbox shows it, with the /etc files that
# name it.
INSIDE_UID = 1000
ETC_FILES = {
    "passwd": (
        "root:x:0:0:root:/root:/bin/sh\n"
        f"sandbox:x:{INSIDE_UID}:{INSIDE_UID}:sandbox:{HOME}:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    ),
    "group": f"root:x:0:\nsandbox:x:{INSIDE_UID}:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    "hostname": "sandbox\n",
}
# A worker that runs as root runs each sandbox as a host uid in this range, made from the
# sandbox's key (`sandbox_uid`): no user of the host, never root. Two sandboxes that share
# one see nothing of each other (their own pid, IPC and network namespaces and files).
SANDBOX_UID_BASE = 1_500_000_000
SANDBOX_UID_RANGE = 100_000_000
# The OOM killer's preference for a sandbox's processes (the most): a sandbox that runs the
# machine out of memory loses its own processes, not the worker.
OOM_SCORE_ADJ = 1000

NO_BWRAP = (
    "sandbox isolation 'bubblewrap' needs bwrap on PATH: install it with `apt-get install "
    'bubblewrap`, or set "isolation": "none" knowing that it isolates nothing'
)
NO_UTIL_LINUX = (
    "sandbox isolation 'bubblewrap' needs util-linux's {} on PATH (apt-get install util-linux)"
)

# How long the end of a sandbox's init may take once bwrap has gone: the kernel kills every
# process of the sandbox before its init is gone.
SANDBOX_END_SECONDS = 10.0

# Variables of the worker's environment that a sandboxed process keeps (locale, terminal,
# time zone, PATH); everything else it gets is set for it.
KEPT_VARIABLES = frozenset({"PATH", "LANG", "LANGUAGE", "TERM", "TZ"})


@dataclass(frozen=True)
class SandboxTools:
    """The programs a sandbox is made with: bwrap, and util-linux's setpriv (to switch to
    the sandbox's user), choom and prlimit (its OOM score and limits)."""

    bwrap: str
    setpriv: str
    choom: str
    prlimit: str


def find_tools() -> SandboxTools:
    """The sandbox's programs, or SandboxSpecError with the one line that says what to do."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxSpecError(NO_BWRAP)
    found = {}
    for name in ("setpriv", "choom", "prlimit"):
        path = shutil.which(name)
        if path is None:
            raise SandboxSpecError(NO_UTIL_LINUX.format(name))
        found[name] = path
    return SandboxTools(bwrap=bwrap, **found)


def sandbox_uid(key: str) -> int | None:
    """The host uid the sandbox keyed `key` runs as when the worker is root (None when it is
    not: the sandbox then runs as the worker's user, in a user namespace)."""
    if os.geteuid() != 0:
        return None
    digest = hashlib.sha256(key.encode()).digest()
    return SANDBOX_UID_BASE + int.from_bytes(digest[:8], "big") % SANDBOX_UID_RANGE


def give_to(path: Path, uid: int | None) -> None:
    """Make `uid` (a sandbox's, or None for the worker's own) own the tree at `path`, links
    themselves not followed (synchronous, for a thread)."""
    if uid is None:
        return
    os.lchown(path, uid, uid)
    pending = [str(path)]  # a stack, not os.walk's recursion: a tree may be deep
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                os.lchown(entry.path, uid, uid)
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)


def write_etc(folder: Path) -> tuple[tuple[str, str], ...]:
    """Write the sandbox's own /etc files (its user, its host name) into `folder`; the
    (host file, sandbox path) pairs a layout shows."""
    folder.mkdir(exist_ok=True)
    shown = []
    for name, text in ETC_FILES.items():
        (folder / name).write_text(text)
        shown.append((str(folder / name), f"/etc/{name}"))
    return tuple(shown)


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
    `files` host files at sandbox paths (read-only, the /etc files of `write_etc` among
    them), `writable` host paths at sandbox paths, and the workspace read-write at
    `workdir`, where the command starts; `limits` for its processes and `uid` the host user
    they run as (`sandbox_uid`)."""

    workspace: Path
    workdir: str
    limits: SandboxLimits
    uid: int | None
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


def bwrap_argv(tools: SandboxTools, layout: SandboxLayout, command: Sequence[str]) -> list[str]:
    """The argv running `command` in the layout (the module's docstring says how)."""
    if layout.uid is None:
        argv = [tools.bwrap, "--unshare-all", "--unshare-user", "--disable-userns"]
        argv += ["--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID), "--cap-drop", "ALL"]
    else:
        # No user namespace yet: bwrap sets the root up as root, then hands over to setpriv.
        argv = [tools.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc"]
        argv += ["--unshare-uts", "--unshare-cgroup-try", "--cap-drop", "ALL"]
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
    mounts = _Mounts()
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += mounts.add("--ro-bind", path, path)
    for name in ETC_ENTRIES:
        if os.path.lexists(f"/etc/{name}"):
            argv += mounts.add("--ro-bind-try", f"/etc/{name}", f"/etc/{name}")
    argv += mounts.add("--dev", None, "/dev") + mounts.add("--proc", None, "/proc")
    tmp_size = str(layout.limits.tmp_mb * 1024 * 1024)
    argv += mounts.add("--tmpfs", None, "/tmp", ["--perms", "1777", "--size", tmp_size])
    for path in dict.fromkeys(layout.read_only):
        argv += mounts.add("--ro-bind", path, path)
    for source, target in layout.files:
        argv += mounts.add("--ro-bind", source, target)
    for source, target in layout.writable:
        argv += mounts.add("--bind", source, target)
    argv += mounts.add("--bind", str(layout.workspace), layout.workdir)
    # Last: the root bwrap made (and the mount points in it) read-only.
    argv += ["--remount-ro", "/", "--chdir", layout.workdir, "--"]
    if layout.uid is not None:
        uid = str(layout.uid)
        argv += [tools.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        argv += ["--inh-caps=-all", "--no-new-privs", "--", tools.bwrap, "--unshare-user"]
        argv += ["--disable-userns", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID)]
        argv += ["--dev-bind", "/", "/", "--chdir", layout.workdir, "--"]
    return [*argv, *limited(tools, layout.limits), *command]


def limited(tools: SandboxTools, limits: SandboxLimits) -> list[str]:
    """The prefix that runs a command under the limits, the OOM killer's first choice."""
    mib = 1024 * 1024
    return [
        tools.choom,
        "-n",
        str(OOM_SCORE_ADJ),
        "--",
        tools.prlimit,
        f"--as={limits.memory_mb * mib}",
        f"--nproc={limits.processes}",
        f"--cpu={limits.cpu_seconds}",
        f"--fsize={limits.file_size_mb * mib}",
        "--core=0",
        "--",
    ]


class _Mounts:
    """The mounts of a sandbox's root in order, each with the directories above it that
    bwrap makes: traversable by anyone (bwrap copies the host's modes for the ones it makes,
    and /root's 0700 would hide a Python under it), unless a host folder bound earlier
    already holds them."""

    def __init__(self) -> None:
        self._targets: list[Path] = []
        self._made: set[Path] = set()

    def add(
        self, option: str, source: str | None, target: str, modifiers: Sequence[str] = ()
    ) -> list[str]:
        argv: list[str] = []
        for parent in reversed(Path(target).parents[:-1]):
            if parent in self._made or any(parent.is_relative_to(t) for t in self._targets):
                continue
            argv += ["--perms", "0755", "--dir", str(parent)]
            self._made.add(parent)
        if option != "--tmpfs":  # a tmpfs's folders are bwrap's to make, host folders not
            self._targets.append(Path(target))
        return [*argv, *modifiers, option, *([source] if source is not None else []), target]


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
    heartbeater: Heartbeater,
    cwd: Path | None = None,
    bwrap: bool = True,
    hand_over: Sequence[int] = (),
) -> SandboxRun:
    """Run a command to its end (bwrap's argv, or a plain one when `bwrap` is False), its
    output to `log_path`, in a process group of its own that is killed whole at `timeout`.
    The descriptors `hand_over` are the command's too, and closed here once it has them."""
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        try:
            launch = stack.enter_context(BwrapLaunch(argv)) if bwrap else None
            with log_path.open("ab") as log:
                proc = await asyncio.create_subprocess_exec(
                    *(launch.argv if launch else argv),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    env=dict(env),
                    cwd=cwd,
                    pass_fds=(*(launch.pass_fds if launch else ()), *hand_over),
                    start_new_session=True,
                )
        finally:
            for fd in hand_over:
                os.close(fd)
        if launch:
            launch.spawned()
        timed_out = await _wait_or_kill(proc, began + timeout, heartbeater)
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
    proc: asyncio.subprocess.Process, deadline: float, heartbeater: Heartbeater
) -> bool:
    """Await the process, heartbeating; at the deadline kill its group: True if it did (a
    process that has ended by the deadline was not killed, however late it is awaited)."""
    try:
        async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
            await heartbeater(proc.wait())
        return False
    except TimeoutError:
        if proc.returncode is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return True
