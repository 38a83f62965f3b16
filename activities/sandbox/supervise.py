"""The outside half of a sandboxed agent: one process per attempt, in the agent's process
group, that serves the Unix socket bound into the sandbox (forwarding each connection to the
gateway's real address) and runs bwrap as its child. It lives exactly as long as the agent:
it exits with the agent's status when bwrap does, and bwrap (`--die-with-parent`) and all it
holds die with it when the runner kills the group. How bwrap reports on its command
(`BwrapLaunch`) is here too, for the grader's runs.

    python -m darl.activities.sandbox.supervise <attempt dir>/sandbox.json
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from darl.activities.sandbox.bridge import AGENT_ENV_FD, splice

CONFIG_FILE = "sandbox.json"
SOCKET_FILE = "gateway.sock"
# Written when bwrap could not make the sandbox or start the bridge (its message is in the
# agent's log): the runner reports a sandbox that cannot work, not an agent that failed.
FAILED_FILE = "sandbox_failed"
# Keeps the supervisor's process group findable (DARL_AGENT_KEY) out of the sandbox.
WITHHELD_VARIABLES = frozenset({"DARL_AGENT_KEY"})


@dataclass(frozen=True)
class SupervisorConfig:
    """What the runner hands the supervisor (a file in the attempt's directory): bwrap's
    argv, bwrap's own environment (no secret: the agent's comes through a pipe), the
    gateway's real address and who may connect to the socket to it."""

    bwrap_argv: list[str]
    bwrap_env: dict[str, str]
    gateway_host: str
    gateway_port: int
    # The sandbox's host user (a root worker's sandbox runs as one), who must be able to
    # connect to the socket.
    socket_owner: int | None = None

    def write(self, attempt_dir: Path) -> Path:
        path = attempt_dir / CONFIG_FILE
        path.write_text(json.dumps(asdict(self)))
        return path


class BwrapLaunch:
    """bwrap's command line for `argv` (bwrap's path, its options, `--`, the command): the
    options go through a memfd (`--args`), so a process in the sandbox reading /proc/1/cmdline
    learns none of the host's paths bound into it, and bwrap reports to a pipe
    (`--json-status-fd`), where it writes an `exit-code` record only when it made the sandbox
    and its command ran. A context manager owning both descriptors."""

    def __init__(self, argv: Sequence[str]) -> None:
        end = list(argv).index("--")  # bwrap reads options from --args, not the command
        self._args = os.memfd_create("bwrap-args")
        data = b"".join(os.fsencode(arg) + b"\0" for arg in argv[1:end])
        view = memoryview(data)
        while view:
            view = view[os.write(self._args, view) :]
        os.lseek(self._args, 0, os.SEEK_SET)
        self._status, self._status_write = os.pipe()
        status, args = str(self._status_write), str(self._args)
        self.argv = [argv[0], "--json-status-fd", status, "--args", args, *argv[end:]]
        self.pass_fds = (self._status_write, self._args)
        self._open = [self._args, self._status, self._status_write]

    def __enter__(self) -> BwrapLaunch:
        return self

    def __exit__(self, *_: object) -> None:
        for fd in self._open:
            os.close(fd)
        self._open.clear()

    def spawned(self) -> None:
        """bwrap holds its copies now: the status pipe ends when bwrap and its sandbox do."""
        for fd in (self._args, self._status_write):
            os.close(fd)
            self._open.remove(fd)

    def status(self) -> tuple[bool, int | None]:
        """Whether the command ran, and the host's pid of the sandbox's init (whose exit is
        the end of every process in the sandbox). Blocks until bwrap has exited (run it in a
        thread)."""
        chunks = []
        while chunk := os.read(self._status, 65536):
            chunks.append(chunk)
        records = b"".join(chunks)
        init = re.search(rb'"child-pid": *(\d+)', records)
        return b'"exit-code"' in records, int(init[1]) if init else None


async def _to_gateway(
    host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        upstream = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    except (OSError, TimeoutError) as err:
        sys.stderr.write(f"darl sandbox: gateway {host}:{port} unreachable: {err!r}\n")
        writer.close()
        return
    await splice((reader, writer), upstream)


async def supervise(config: SupervisorConfig, attempt_dir: Path) -> int:
    # The socket is bound by a name relative to the attempt's directory: a Unix socket's
    # path is limited to 107 bytes, an attempt's directory is not.
    os.chdir(attempt_dir)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SOCKET_FILE)  # left by a launch that died before its agent started
    forward = functools.partial(_to_gateway, config.gateway_host, config.gateway_port)
    server = await asyncio.start_unix_server(forward, path=SOCKET_FILE)
    if config.socket_owner is not None:
        os.chown(SOCKET_FILE, config.socket_owner, config.socket_owner)
    # The agent's environment (its token) goes to the bridge through a pipe, not through
    # bwrap's environment: the sandbox's init and the bridge, which a command of the agent
    # could read in /proc, never hold it in theirs.
    agent_env = {k: v for k, v in os.environ.items() if k not in WITHHELD_VARIABLES}
    env_read, env_write = os.pipe()
    try:
        with BwrapLaunch(config.bwrap_argv) as launch:
            sandbox = await asyncio.create_subprocess_exec(
                *launch.argv,
                stdin=asyncio.subprocess.DEVNULL,
                env={**config.bwrap_env, AGENT_ENV_FD: str(env_read)},
                pass_fds=(*launch.pass_fds, env_read),
            )
            os.close(env_read)
            launch.spawned()
            handing = asyncio.to_thread(_hand_over, env_write, json.dumps(agent_env).encode())
            code, _ = await asyncio.gather(sandbox.wait(), handing)
            ran, _ = await asyncio.to_thread(launch.status)
    finally:
        server.close()
    if not ran:
        (attempt_dir / FAILED_FILE).write_text(f"bwrap exited {code} without running the agent")
    return code if code >= 0 else 128 - code


def _hand_over(fd: int, data: bytes) -> None:
    """Write the agent's environment to the bridge (blocks while the pipe is full; ends when
    the sandbox has it or is gone)."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BrokenPipeError:
        pass  # the sandbox ended before reading it: bwrap's status says why
    finally:
        os.close(fd)


def main() -> int:
    config_path = Path(sys.argv[1]).resolve()
    config = SupervisorConfig(**json.loads(config_path.read_text()))
    return asyncio.run(supervise(config, config_path.parent))


if __name__ == "__main__":
    sys.exit(main())
