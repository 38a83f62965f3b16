"""A newcomer's first hour: what a user sees when Temporal is not (yet) there. Every client
command says so in one line with the fix and exits non-zero; the viewer starts anyway and
serves its 503 page until Temporal is back."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from darl.deploy.processes import ManagedProcess
from tests.integration.dev_server import DevServer, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [
    ["rollout", str(ROOT / "examples" / "arithmetic" / "rollout.json")],
    ["train", str(ROOT / "examples" / "digits" / "train.yaml")],
    ["status", "some-run"],
    ["pause", "some-run"],
    ["resume", "some-run"],
    ["stop", "some-run"],
    ["trajectory", "some-rollout"],
]


def darl(args: list[str], home: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "DARL_HOME": str(home / ".darl"),
        "XDG_STATE_HOME": str(home / "state"),
    }
    return subprocess.run(
        [sys.executable, "-m", "darl.deploy.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
        check=False,
    )


async def test_every_client_command_says_in_one_line_that_temporal_is_not_there(
    tmp_path: Path,
) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    runs = await asyncio.gather(
        *(
            asyncio.to_thread(darl, [*args, "--temporal-address", address], tmp_path, tmp_path)
            for args in COMMANDS
        )
    )
    for args, run in zip(COMMANDS, runs, strict=True):
        assert run.returncode == 1, (args, run.stdout, run.stderr)
        assert "Traceback" not in run.stderr, (args, run.stderr)
        errors = [line for line in run.stderr.splitlines() if line.strip()]
        assert len(errors) == 1, (args, run.stderr)
        assert errors[0].startswith(f"error: cannot reach Temporal at {address}"), errors
        assert "is `darl dev` running? pass --temporal-address or --home" in errors[0]


async def test_the_viewer_serves_its_503_page_until_temporal_is_back(tmp_path: Path) -> None:
    server = DevServer(tmp_path)  # not started yet
    viewer = ManagedProcess.darl(
        "viewer",
        ["viewer", "--port", "0", "--temporal-address", server.settings.address],
        tmp_path / "logs",
        env={"PATH": "/usr/bin:/bin", "DARL_HOME": str(tmp_path / ".darl")},
        cwd=tmp_path,
    )
    viewer.start()
    try:
        url = (await asyncio.to_thread(viewer.wait_ready, 60))["url"]
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            down = await http.get("/")
            assert down.status_code == 503
            assert f"has not reached Temporal at {server.settings.address}" in down.text
            await asyncio.to_thread(server.start)
            async with asyncio.timeout(30):
                while (await http.get("/")).status_code != 200:
                    await asyncio.sleep(0.25)
            assert "Training runs" in (await http.get("/")).text
    finally:
        viewer.stop()
        server.stop()


@pytest.mark.timeout(300)
async def test_ctrl_c_stops_darl_dev_under_load_in_order_and_within_its_grace(
    tmp_path: Path,
) -> None:
    """A terminal's Ctrl-C (SIGINT to the whole foreground group) while a run trains: only
    `darl dev` gets it and stops its components in order, each within its grace (none killed
    for ignoring SIGTERM: before, Temporal died with the rest and the worker and the gateway
    hung on their goodbyes to it until killed, 10 s each)."""
    home = tmp_path / "home"
    ports = [str(free_port()) for _ in range(6)]
    flags = ["--temporal-port", "--ui-port", "--gateway-port", "--policy-port", "--agent-port"]
    argv = [sys.executable, "-m", "darl.deploy.cli", "dev", "--home", str(home), "--model"]
    argv += ["digits", "--agent-service", "darl.examples.digits.agent_service:app"]
    argv += [part for flag, port in zip(flags, ports, strict=False) for part in (flag, port)]
    argv += ["--viewer-port", ports[5]]
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    env.pop("TEMPORAL_ADDRESS", None)
    out = tmp_path / "dev.out"
    # A session of its own (ManagedProcess's): a terminal's foreground group, as it were.
    dev = ManagedProcess("darl-dev", argv, out, env=env, cwd=tmp_path).start()
    try:
        async with asyncio.timeout(180):
            while b"Ctrl-C stops everything" not in out.read_bytes():
                assert dev.running(), out.read_text()
                await asyncio.sleep(0.5)
        config = ROOT / "examples" / "digits" / "train.yaml"
        train = await asyncio.to_thread(
            darl,
            ["train", str(config), "--run-id", "ctrl-c", "--home", str(home)],
            tmp_path,
            tmp_path,
        )
        assert train.returncode == 0, train.stderr
        async with asyncio.timeout(120):
            while not any((home / "trajectories").glob("ctrl-c*/attempt-*.jsonl")):
                await asyncio.sleep(0.2)
        os.killpg(dev.pid, signal.SIGINT)  # as a terminal does: the whole group
        started = time.monotonic()
        assert dev.proc is not None
        code = await asyncio.to_thread(dev.proc.wait, 60)
        seconds = time.monotonic() - started
    finally:
        if dev.running():
            os.killpg(dev.pid, signal.SIGKILL)
    said = out.read_text()
    assert code == 0, said
    assert "ignored SIGTERM" not in said, said
    assert seconds < 20, f"stopped in {seconds:.1f}s: {said[-2000:]}"
