"""The tutorial docs/tutorials/your-own-agent.md, run as a reader runs it: the `$ ` lines of
its console blocks marked `<!-- tutorial-step -->`, in order, each through bash, in a fresh
directory that holds examples/tutorial/'s files (the files the page includes). The commands
are the page's text but for the stack's ports: each default port the page names is replaced
by a free one, and `darl dev` gets the flags that move it there (`darl train` moves the
config's endpoints to the stack's ports by itself).

What is checked is what the page claims: the agent answers by hand, the rollout succeeds and
its trajectory and viewer page show it, the run trains steps and writes metrics.jsonl and
reward.png, `darl stop` ends it with its summary, and Ctrl-C on `darl dev` leaves no process
behind. Whether the reward rises over a whole run is the page's captured output, not checked
here (the test stops the run after STEPS steps)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from darl.deploy.processes import ManagedProcess
from darl.deploy.progress import HEADER
from tests.conftest import BIN
from tests.integration.dev_server import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "tutorials" / "your-own-agent.md"
FILES = ROOT / "examples" / "tutorial"
STEP_BLOCK = re.compile(r"<!-- tutorial-step -->\n```console\n(.*?)```", re.DOTALL)
# `darl dev`'s default ports (as the page names them) -> its flag that moves each.
DEFAULT_PORTS = {
    7233: "--temporal-port",
    8233: "--ui-port",
    8100: "--gateway-port",
    8200: "--policy-port",
    8300: "--agent-port",
    8400: "--viewer-port",
}
# What the page runs, in order (each a command's start): the test knows how to run each.
EXPECTED = [
    "mkdir echo-agent && cd echo-agent",
    "darl dev ",
    "DARL_TASK=",
    "darl rollout ",
    "darl trajectory ",
    "darl train ",
    "darl status ",
    "tail ",
    "darl stop ",
]
STEPS = 2  # trained before the test stops the run, as the page's `darl stop` does
COMMAND_TIMEOUT = 120


def page_commands() -> list[str]:
    commands = []
    for block in STEP_BLOCK.finditer(PAGE.read_text()):
        commands += [line[2:] for line in block.group(1).splitlines() if line.startswith("$ ")]
    return commands


class Reader:
    """A reader's shells: a clean environment with DARL's bin on PATH, one directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir = root / "echo-agent"
        self.ports = {default: free_port() for default in DEFAULT_PORTS}
        self.env = {
            "PATH": f"{BIN}:/usr/bin:/bin",
            "HOME": str(root / "home"),
            "XDG_STATE_HOME": str(root / "state"),
            "LANG": "C.UTF-8",
        }

    def moved(self, command: str) -> str:
        for default, port in self.ports.items():
            command = command.replace(f":{default}", f":{port}")
        return command

    def port_flags(self) -> str:
        return " ".join(f"{flag} {self.ports[port]}" for port, flag in DEFAULT_PORTS.items())

    def run(self, command: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["bash", "-c", self.moved(command)],
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            env=self.env,
            cwd=cwd or self.dir,
            check=False,
        )
        print(f"$ {command}\n{done.stdout}{done.stderr}")  # pytest shows it when a check fails
        assert done.returncode == 0, f"$ {command}\n{done.stdout}\n{done.stderr}"
        return done

    def start(self, name: str, command: str) -> ManagedProcess:
        """A command left running (its own session, as in a shell of its own)."""
        argv = ["bash", "-c", f"exec {self.moved(command)}"]
        return ManagedProcess(
            name, argv, self.root / f"{name}.out", env=self.env, cwd=self.dir
        ).start()

    def url(self, default_port: int) -> str:
        return f"http://127.0.0.1:{self.ports[default_port]}"


def wait_for(check, timeout: float, what: str, process: ManagedProcess) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert process.running(), f"{process.name} exited: {process.log_tail()}"
        assert time.monotonic() < deadline, f"{what} not within {timeout:g}s: {process.log_tail()}"
        time.sleep(0.5)


def processes_under(directory: Path) -> list[psutil.Process]:
    """Processes whose working directory is in `directory` (the agents, the stack)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if Path(proc.cwd()).is_relative_to(directory):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@contextmanager
def left_running(process: ManagedProcess) -> Iterator[ManagedProcess]:
    """The process, killed with its session if the test leaves it running."""
    try:
        yield process
    finally:
        if process.running():
            os.killpg(process.pid, signal.SIGKILL)
            process.proc.wait(timeout=30)


def metrics_lines(reader: Reader) -> list[dict]:
    path = reader.dir / ".darl" / "runs" / "tutorial" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_page_says_which_commands_it_runs() -> None:
    commands = page_commands()
    assert len(commands) == len(EXPECTED), commands
    for command, start in zip(commands, EXPECTED, strict=True):
        assert command.startswith(start), (command, start)


@pytest.mark.timeout(420)
def test_the_tutorial_as_the_page_shows_it(tmp_path: Path) -> None:
    commands = page_commands()
    assert [c for c, e in zip(commands, EXPECTED, strict=True) if not c.startswith(e)] == []
    (mkdir, dev, by_hand, rollout, trajectory, train, status, tail, stop) = commands
    reader = Reader(tmp_path)
    reader.run(mkdir, cwd=tmp_path)
    for path in FILES.iterdir():  # the files the page has the reader write
        if path.is_file():
            shutil.copy(path, reader.dir / path.name)

    with left_running(reader.start("darl-dev", f"{dev} {reader.port_flags()}")) as stack:
        wait_for(
            lambda: b"Ctrl-C stops everything" in stack.log_path.read_bytes(),
            180,
            "darl dev up",
            stack,
        )

        answered = reader.run(by_hand).stdout
        assert re.fullmatch(r"prompt '7=' -> answer '.*'\n", answered), answered

        rolled = reader.run(rollout).stdout
        result = json.loads(rolled[rolled.index("{") :])
        assert result["status"] == "succeeded" and result["calls"] == 1, rolled
        assert 0 <= result["reward"] <= 1, rolled
        shown = reader.run(trajectory).stdout
        assert "7=" in shown, shown
        viewer = httpx.get(f"{reader.url(8400)}/rollouts/try-7", timeout=30)
        assert viewer.status_code == 200 and "try-7" in viewer.text

        with left_running(reader.start("darl-train", train)) as follow:
            wait_for(lambda: len(metrics_lines(reader)) >= STEPS, 240, "the steps", follow)
            assert HEADER in reader.run(status).stdout.splitlines()
            last = reader.run(tail).stdout.splitlines()
            assert len(last) == 1 and all("reward_mean" in json.loads(line) for line in last)
            reader.run(stop)
            assert follow.proc is not None
            assert follow.proc.wait(timeout=120) == 0, follow.log_tail()
        followed = follow.log_path.read_text()
        assert re.search(r"tutorial: \d+ steps in", followed), followed
        assert (reader.dir / ".darl" / "runs" / "tutorial" / "reward.png").stat().st_size > 0
        assert httpx.get(f"{reader.url(8400)}/runs/tutorial", timeout=30).status_code == 200

        os.killpg(stack.pid, signal.SIGINT)  # Ctrl-C in the stack's shell
        assert stack.proc is not None
        assert stack.proc.wait(timeout=60) == 0, stack.log_tail()

    deadline = time.monotonic() + 15
    while (left := processes_under(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], [(p.pid, p.cmdline()) for p in left]
