"""Child processes of the dev stack (and of the tests): started with their output in a log
file, tied to their parent's life, ready when their ready file appears, stopped with SIGTERM
and, past a grace period, SIGKILL. Nothing is left behind."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from darl.deploy.errors import DeployError

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Linux: the child gets SIGTERM if the process that started it dies (even by SIGKILL).
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ProcessFailedError(DeployError, RuntimeError):
    """A component exited, or never became ready; the message carries its log tail."""


class ManagedProcess:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        ready_file: Path | None = None,
        cwd: Path | None = None,
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else dict(os.environ)
        self.ready_file = ready_file
        self.cwd = cwd
        # Inherited by the child (a listening socket bound here, port from the kernel).
        self.pass_fds = tuple(pass_fds)
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def darl(cls, name: str, args: Sequence[str], run_dir: Path, **kwargs: Any) -> ManagedProcess:
        """A `darl <args>` component with its log and ready file under `run_dir`."""
        ready = run_dir / f"{name}.ready.json"
        argv = [sys.executable, "-m", "darl.deploy.cli", *args, "--ready-file", str(ready)]
        return cls(name, argv, run_dir / f"{name}.log", ready_file=ready, **kwargs)

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.ready_file is not None:
            self.ready_file.unlink(missing_ok=True)
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                pass_fds=self.pass_fds,
                preexec_fn=_die_with_parent,
                # A session of its own: a terminal's Ctrl-C (SIGINT to the whole foreground
                # group) reaches only the process that started it, which stops its
                # components in order (Temporal last: a worker or gateway that outlives it
                # waits on it to say goodbye).
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ProcessFailedError(f"{self.name} was not started")
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        """Block until the ready file appears; raise with the log tail if the process dies."""
        if self.ready_file is None:
            raise ProcessFailedError(f"{self.name} has no ready file")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                return json.loads(self.ready_file.read_text())
            if not self.running():
                raise ProcessFailedError(f"{self.name} exited early:\n{self.log_tail()}")
            time.sleep(0.05)
        raise ProcessFailedError(f"{self.name} not ready within {timeout:g}s:\n{self.log_tail()}")

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace`; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %gs; killing it", self.name, grace)
                self.proc.kill()
                self.proc.wait(timeout=grace)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (for crash tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_tail(self, size: int = 3000) -> str:
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return ""
        return data[-size:].decode("utf-8", errors="replace")
