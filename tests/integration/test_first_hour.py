"""A newcomer's first hour: what a user sees when Temporal is not (yet) there. Every client
command says so in one line with the fix and exits non-zero; the viewer starts anyway and
serves its 503 page until Temporal is back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
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
