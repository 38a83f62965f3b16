"""The agent's one way out of its sandbox: inside the sandbox's network namespace (loopback
only) it listens on 127.0.0.1:<gateway port> and forwards each connection to a Unix socket that
DARL's supervisor serves outside, which connects it to the gateway. It runs the agent as its
child and exits with the agent's status. The agent's environment (its rollout token) comes
through a pipe, not the bridge's own environment, and the bridge makes itself non-dumpable
once it has it: a command the agent runs cannot read the token in the bridge's or the
sandbox's init's /proc entries (the agent's own are the harness's to protect).

Standalone, standard library only: the sandbox sees this one file, not DARL's source tree.
The supervisor outside reuses `splice`.

    python -I -S bridge.py --port 8000 --socket /run/darl/gateway.sock -- AGENT ARGV...
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import json
import os
import sys
from collections.abc import Sequence

CHUNK = 1 << 16
# The variable naming the descriptor the supervisor writes the agent's environment to.
AGENT_ENV_FD = "DARL_AGENT_ENV_FD"
PR_SET_DUMPABLE = 4


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction to its end, then pass the end on (a half-close)."""
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    """Join two connections both ways until both directions have ended."""
    try:
        await asyncio.gather(_relay(a[0], b[1]), _relay(b[0], a[1]))
    finally:
        for _, writer in (a, b):
            writer.close()


async def _to_socket(
    socket_path: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        upstream = await asyncio.wait_for(asyncio.open_unix_connection(socket_path), 10)
    except (OSError, TimeoutError) as err:
        sys.stderr.write(f"darl sandbox bridge: the gateway socket is unreachable: {err!r}\n")
        writer.close()
        return
    await splice((reader, writer), upstream)


def _agent_env() -> dict[str, str]:
    """The agent's environment, from the pipe the supervisor writes it to (it holds the
    rollout token); then this process is made non-dumpable, so a process of the agent that is
    not privileged cannot read it in this one's memory."""
    with os.fdopen(int(os.environ[AGENT_ENV_FD]), "rb") as pipe:
        env = json.loads(pipe.read())
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    return env


async def bridge(port: int, socket_path: str, command: Sequence[str]) -> int:
    """Serve the port, run the agent; the agent's exit status (128 + signal if killed)."""
    server = await asyncio.start_server(
        functools.partial(_to_socket, socket_path), "127.0.0.1", port
    )
    try:
        agent = await asyncio.create_subprocess_exec(*command, env=_agent_env())
    except OSError as err:
        sys.stderr.write(f"darl sandbox: cannot start the agent {command[0]!r}: {err}\n")
        return 127
    code = await agent.wait()
    server.close()
    return code if code >= 0 else 128 - code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("command", nargs="+")
    args = parser.parse_args(argv)
    return asyncio.run(bridge(args.port, args.socket, args.command))


if __name__ == "__main__":
    sys.exit(main())
