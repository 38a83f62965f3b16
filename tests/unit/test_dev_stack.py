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
