"""The grader's rules that need no process: which tests a task lists (as SWE-bench writes
them), which outcomes count as passed, which paths the tests read, and how a sandboxed agent's
gateway address is rewritten to its bridge."""

from __future__ import annotations

import json

import pytest

from darl.activities.sandbox.agent import Gateway
from darl.activities.sandbox.errors import SandboxSpecError
from darl.activities.sandbox.grading import listed_tests, passed_tests
from darl.activities.sandbox.tampering import patch_paths, read_by_tests, shadows_a_module


def test_tests_are_listed_from_lists_or_json_strings_once_each() -> None:
    task = {
        "FAIL_TO_PASS": json.dumps(["t.py::a", "t.py::b"]),
        "PASS_TO_PASS": ["t.py::a", "u.py::c"],
    }
    assert listed_tests(task) == ["t.py::a", "t.py::b", "u.py::c"]


@pytest.mark.parametrize(
    "task",
    [
        {"FAIL_TO_PASS": "[not json", "PASS_TO_PASS": []},
        {"FAIL_TO_PASS": [1], "PASS_TO_PASS": []},
        {"FAIL_TO_PASS": [], "PASS_TO_PASS": []},
        {"FAIL_TO_PASS": ["-p evil"], "PASS_TO_PASS": []},
        {"FAIL_TO_PASS": ["../outside.py::t"], "PASS_TO_PASS": []},
    ],
)
def test_unusable_test_lists_are_refused(task: dict[str, object]) -> None:
    with pytest.raises(SandboxSpecError):
        listed_tests(task)


def test_a_test_passes_only_with_a_passing_call_and_no_failed_phase() -> None:
    records = [
        {"event": "pytest"},
        {"nodeid": "ok", "when": "call", "outcome": "passed"},
        {"nodeid": "xfailed", "when": "call", "outcome": "skipped", "xfail": True},
        {"nodeid": "skipped", "when": "setup", "outcome": "skipped"},
        {"nodeid": "teardown", "when": "call", "outcome": "passed"},
        {"nodeid": "teardown", "when": "teardown", "outcome": "failed"},
        {"nodeid": "failed", "when": "call", "outcome": "failed"},
    ]
    text = "".join(json.dumps(r) + "\n" for r in records) + "not json\n[1]\n"
    assert passed_tests(text) == ({"ok", "xfailed"}, True)
    assert passed_tests("") == (set(), False)


@pytest.mark.parametrize(
    ("path", "read"),
    [
        ("tests/test_x.py", True),
        ("pkg/tests/data.json", True),
        ("pkg/x_test.py", True),
        ("deep/conftest.py", True),
        ("sub/pytest.ini", True),
        ("pyproject.toml", True),
        ("a/__pycache__/m.cpython-311.pyc", True),
        ("x.pth", True),
        ("sitecustomize.py", True),
        ("pkg/calc.py", False),
        ("docs/testing.md", False),
    ],
)
def test_the_paths_tests_read(path: str, read: bool) -> None:
    assert read_by_tests(path) is read


def test_top_level_modules_that_would_shadow_pytest_or_the_standard_library() -> None:
    assert shadows_a_module("pytest.py") and shadows_a_module("json/__init__.py")
    assert not shadows_a_module("calc.py") and not shadows_a_module("pkg/json.py")


def test_the_paths_a_patch_touches() -> None:
    patch = (
        "diff --git a/t.py b/t.py\n--- a/t.py\n+++ b/t.py\n@@\n"
        "diff --git a/n.py b/n.py\n--- /dev/null\n+++ b/n.py\n"
    )
    assert patch_paths(patch) == ["t.py", "n.py"]


def test_the_gateway_address_becomes_the_bridge() -> None:
    gateway = Gateway.of("http://gateway.darl:80/rollouts/r1/v1")
    assert (gateway.host, gateway.port, gateway.inside_port) == ("gateway.darl", 80, 8080)
    env = {
        "OPENAI_BASE_URL": "http://gateway.darl:80/rollouts/r1/v1",
        "OTHER": "http://gateway.darl:8000/kept",
    }
    assert gateway.rewrite(env) == {
        "OPENAI_BASE_URL": "http://127.0.0.1:8080/rollouts/r1/v1",
        "OTHER": "http://gateway.darl:8000/kept",
    }
    with pytest.raises(SandboxSpecError, match="plain http"):
        Gateway.of("https://gateway.darl/rollouts/r1/v1")
