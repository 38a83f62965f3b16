"""A Temporal dev server of a test's own, on a SQLite file (WAL, as the dev stack runs it), so
the test can SIGKILL it and start it again on its database."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from darl.deploy.devstack import wait_for_port
from darl.deploy.processes import ManagedProcess
from darl.deploy.temporal_connection import TemporalSettings
from darl.workflows import search_attributes as sa
from tests.conftest import BIN

# Ports free_port handed out in this process: never handed out twice.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free port on loopback for a server the test starts (and may start again on it).

    Taken below the kernel's ephemeral range: a port from that range could be taken by another
    program (an outgoing connection's local port, a bind to port 0) between this check and the
    server's bind, which would then fail ("address already in use"; the dev server exits). Below
    that range only a program that names the port can take it."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port found on 127.0.0.1 below {low}")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 unless configured otherwise)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class DevServer:
    """`temporal server start-dev` on a SQLite file (WAL, as the dev stack runs it)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.settings = TemporalSettings(address=f"127.0.0.1:{self.port}")
        self.process: ManagedProcess | None = None

    def start(self) -> None:
        argv = [
            str(BIN / "temporal"),
            "server",
            "start-dev",
            "--ip",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--db-filename",
            str(self.root / "temporal.db"),
            "--sqlite-pragma",
            "journal_mode=wal",
            "--sqlite-pragma",
            "synchronous=normal",
            "--log-level",
            "warn",
            "--headless",
            *sa.dev_server_flags(),
        ]
        self.process = ManagedProcess("temporal", argv, self.root / "logs" / "temporal.log")
        self.process.start()
        wait_for_port("127.0.0.1", self.port, 60, self.process)

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
