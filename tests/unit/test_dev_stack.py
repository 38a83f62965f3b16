"""The embedded stack's wiring: what its policy server and gateway keep across restarts is
kept per model, so `darl dev` (the tiny model) after `make demo` (the digits model, trained
to version 20) starts at version 0 instead of holding every call for weights it never had."""

from __future__ import annotations

from pathlib import Path

from darl.deploy.devstack import DevStack


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def serving_paths(home: Path, model: str) -> tuple[str, str]:
    stack = DevStack(home, model=model)
    processes = {p.name: p for p in stack.components(stack.env(), home / "logs")}
    return (
        flag(processes["policy-server"].argv, "--state-file"),
        flag(processes["gateway"].argv, "--journal-dir"),
    )


def test_serving_state_is_kept_per_model(tmp_path: Path) -> None:
    tiny = serving_paths(tmp_path, "tiny")
    digits = serving_paths(tmp_path, "digits")
    home = tmp_path.resolve()
    assert tiny == (
        str(home / "serving/tiny/policy-server-8200.json"),
        str(home / "serving/tiny/gateway"),
    )
    assert digits == (
        str(home / "serving/digits/policy-server-8200.json"),
        str(home / "serving/digits/gateway"),
    )
    # The calls themselves stay in one store: runs of either model read them.
    stack = DevStack(tmp_path, model="digits")
    gateway = {p.name: p for p in stack.components(stack.env(), tmp_path)}["gateway"]
    assert flag(gateway.argv, "--store-dir") == str(home / "trajectories")


def test_the_viewer_is_a_component_on_its_port(tmp_path: Path) -> None:
    from darl.deploy.devstack import DevPorts

    assert DevPorts().viewer == 8400
    stack = DevStack(tmp_path, DevPorts(temporal=7300, ui=8234, viewer=8401))
    viewer = {p.name: p for p in stack.components(stack.env(), tmp_path)}["viewer"]
    home = tmp_path.resolve()
    assert viewer.argv[viewer.argv.index("viewer") :] == [
        "viewer",
        "--port",
        "8401",
        "--temporal-address",
        "127.0.0.1:7300",
        "--namespace",
        "default",
        "--store-dir",
        str(home / "trajectories"),
        "--runs-dir",
        str(home / "runs"),
        "--agents-dir",
        str(home / "agents"),
        "--ui-url",
        "http://127.0.0.1:8234",
        "--ready-file",
        str(tmp_path / "viewer.ready.json"),
    ]
    assert stack.viewer_url == "http://127.0.0.1:8401"
    assert stack.endpoints().viewer_url == "http://127.0.0.1:8401"
    # Without the Web UI the viewer links to none.
    headless = DevStack(tmp_path, ui=False)
    viewer = {p.name: p for p in headless.components(headless.env(), tmp_path)}["viewer"]
    assert "--ui-url" not in viewer.argv


def test_stopping_the_stack_removes_its_stack_file(tmp_path: Path) -> None:
    from darl.deploy.stack_file import read_stack_file, write_stack_file

    stack = DevStack(tmp_path)
    write_stack_file(stack.home, stack.endpoints())
    assert read_stack_file(tmp_path) == stack.endpoints()
    stack.stop()
    assert read_stack_file(tmp_path) is None
