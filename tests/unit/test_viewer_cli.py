"""`darl viewer` and `darl trajectory` without flags read what the dev stack under the same
home writes: its trajectory store, runs and agents directories, and its Web UI."""

from __future__ import annotations

import os
from pathlib import Path

from darl.deploy.cli.viewer import DEFAULT_UI_URL, viewer_settings
from darl.deploy.devstack import DevPorts, DevStack
from darl.deploy.stack_file import StackEndpoints, write_stack_file


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_viewer_reads_where_the_stack_under_its_home_writes(tmp_path: Path) -> None:
    stack = DevStack(tmp_path)
    processes = {p.name: p for p in stack.components(stack.env(), tmp_path / "logs")}
    settings = viewer_settings(tmp_path, None, None, None, None)
    assert str(settings.store_dir) == flag(processes["gateway"].argv, "--store-dir")
    assert str(settings.runs_dir) == flag(processes["trainer-worker"].argv, "--runs-dir")
    assert str(settings.agents_dir) == flag(processes["worker"].argv, "--agents-dir")
    assert settings.ui_url == DEFAULT_UI_URL  # no stack running under this home


def test_the_viewer_links_to_the_running_stacks_web_ui_unless_told(tmp_path: Path) -> None:
    moved = DevStack(tmp_path, DevPorts(ui=8390))
    assert moved.ui_url is not None
    write_stack_file(
        tmp_path,
        StackEndpoints(
            temporal_address=moved.temporal.address,
            ui_url=moved.ui_url,
            gateway_url=moved.gateway_url,
            policy_url=moved.policy_url,
            pid=os.getpid(),
        ),
    )
    assert viewer_settings(tmp_path, None, None, None, None).ui_url == "http://127.0.0.1:8390"
    given = viewer_settings(tmp_path, tmp_path / "s", None, None, "http://ui:1/")
    assert (given.ui_url, given.store_dir) == ("http://ui:1", (tmp_path / "s").resolve())
