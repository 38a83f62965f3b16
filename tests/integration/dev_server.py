"""A Temporal dev server of a test's own, on a SQLite file (WAL, as the dev stack runs it), so
the test can SIGKILL it and start it again on its database."""

from __future__ import annotations

import socket
from pathlib import Path

from darl.deploy.devstack import wait_for_port
from darl.deploy.processes import ManagedProcess
from darl.deploy.temporal_connection import TemporalSettings
from darl.workflows import search_attributes as sa
from tests.conftest import BIN


def free_port() -> int:
    # The dev server must come back on the same port, so the test picks it (a small race
    # with other programs binding ports, acceptable on a test machine).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
