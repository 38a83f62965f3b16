"""Test runs for make_tasks: a pytest plugin that records each test's outcome and, for a
failure, the test line it failed at, the error and the values its assert compared; and a
server that has imported pytest once and forks a child per run, so the hundreds of runs a
task set takes cost a fork each instead of an interpreter start."""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Generator, Iterable
from pathlib import Path
from typing import Any

import pytest
from _pytest.config import default_plugins

# Where a run started as `python -m pytest -p darl.examples.swe.pytest_runs` writes.
OUTCOMES_ENV = "DARL_SWE_OUTCOMES"
PYTEST_ARGS = ["-q", "-p", "no:cacheprovider"]
# For runs that only need each test's outcome: no assert rewriting, none of the plugins
# outcomes do not depend on. Four times faster, and a task set takes hundreds of runs.
OUTCOMES_ONLY_ARGS = [
    "--assert=plain",
    *(f"-pno:{name}" for name in ("logging", "warnings", "doctest", "junitxml", "pastebin")),
    *(f"-pno:{name}" for name in ("stepwise", "faulthandler", "legacypath")),
]
_REPR_LIMIT = 400
SERVER = "darl.examples.swe.pytest_runs"
DEFAULT_CPU_SECONDS = 30
# The backstop for a run that hangs without using CPU.
WALL_SECONDS = 600


class PytestServerError(RuntimeError):
    """The server died, or a run it made wrote no outcomes."""


class OutcomeRecorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, dict[str, Any]] = {}
        self.running: str | None = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, Any]:
        self.running = item.nodeid
        try:
            return (yield)
        finally:
            self.running = None

    def pytest_assertrepr_compare(self, op: str, left: object, right: object) -> None:
        # Called as a failing assert's comparison is explained, with the actual objects.
        if self.running is not None:
            record = self.tests.setdefault(self.running, {})
            record["compared"] = [op, _short(left), _short(right)]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        record = self.tests.setdefault(item.nodeid, {})
        if report.when == "call" or report.outcome != "passed":
            record["outcome"] = "failed" if report.failed else report.outcome
        if report.failed and call.excinfo is not None:
            in_test = [e for e in call.excinfo.traceback if Path(e.path) == item.path]
            message = str(call.excinfo.value).strip().splitlines() or [""]
            record["line"] = in_test[-1].lineno + 1 if in_test else None
            record["error"] = call.excinfo.typename
            record["message"] = message[0]
            record["details"] = [line.strip() for line in message[1:10]]
        return report

    def pytest_sessionfinish(self) -> None:
        self.path.write_text(json.dumps(self.tests, indent=1, sort_keys=True))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[:_REPR_LIMIT] + "..."


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get(OUTCOMES_ENV)
    if path:
        config.pluginmanager.register(OutcomeRecorder(Path(path)), "darl-swe-outcomes")


def _run_child(job: dict[str, Any]) -> int:
    """In the forked child: the test session, its output discarded. A bug that loops is
    stopped by CPU time, not wall time, so a busy machine never cuts a good run short (and
    the same bugs are kept everywhere); the alarm is the backstop for one that sleeps."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    seconds = max(1, int(job["cpu_seconds"]))
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
    signal.alarm(WALL_SECONDS)
    os.chdir(job["workdir"])
    sys.path.insert(0, job["workdir"])  # as `python -m pytest` puts the working directory
    recorder = OutcomeRecorder(Path(job["report"]))
    args = [*PYTEST_ARGS, *([] if job["detailed"] else OUTCOMES_ONLY_ARGS), *job["tests"]]
    return int(pytest.main(args, plugins=[recorder]))


def serve() -> None:
    """A job per line on stdin ({"workdir", "tests", "cpu_seconds", "report", "detailed"}), a
    line on stdout for each when its child is done: {"exit": code} or {"timed_out": bool}."""
    sys.dont_write_bytecode = True
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # pytest alone, as the repos need
    # What every session imports, imported once here rather than in each child.
    for name in default_plugins:
        importlib.import_module(f"_pytest.{name}")
    for line in sys.stdin:
        job = json.loads(line)
        child = os.fork()
        if child == 0:
            code = 3
            try:
                code = _run_child(job)
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        if os.WIFSIGNALED(status):
            stopped = os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL, signal.SIGALRM)
            answer: dict[str, Any] = {"timed_out": stopped}
        else:
            answer = {"exit": os.WEXITSTATUS(status)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


class PytestServer:
    """A `pytest_runs` server of this interpreter: a test session per call, in a fork."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(
        self,
        workdir: Path,
        tests: Iterable[str] = (),
        *,
        detailed: bool = True,
        cpu_seconds: int = DEFAULT_CPU_SECONDS,
    ) -> dict[str, dict[str, Any]] | None:
        """Each test's record (all tests when none are named), with what a failing assert
        compared when `detailed`; None when the run used more than `cpu_seconds` or died."""
        stdin, stdout = self._process.stdin, self._process.stdout
        if stdin is None or stdout is None:
            raise PytestServerError("the pytest server has no pipes")
        with tempfile.TemporaryDirectory(prefix="darl-swe-outcomes-") as scratch:
            report = Path(scratch) / "outcomes.json"
            job = {
                "workdir": str(workdir),
                "tests": list(tests),
                "detailed": detailed,
                "cpu_seconds": cpu_seconds,
                "report": str(report),
            }
            stdin.write(json.dumps(job) + "\n")
            stdin.flush()
            # The child is stopped by its CPU limit or the server's alarm: an answer comes.
            answer = stdout.readline()
            if not answer:
                raise PytestServerError(f"the pytest server exited ({self._process.poll()})")
            if "exit" not in json.loads(answer):
                return None
            if not report.is_file():
                raise PytestServerError(f"pytest wrote no outcomes in {workdir}: {answer.strip()}")
            return json.loads(report.read_text())

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(timeout=30)


class PytestServers:
    """A server per worker thread, all closed together."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._servers: list[PytestServer] = []

    def get(self) -> PytestServer:
        server = getattr(self._local, "server", None)
        if server is None:
            server = self._local.server = PytestServer()
            with self._lock:
                self._servers.append(server)
        return server

    def __enter__(self) -> PytestServers:
        return self

    def __exit__(self, *_: object) -> None:
        for server in self._servers:
            server.close()


if __name__ == "__main__":
    serve()
