"""The grader's rules that need no process: which tests a task lists (as SWE-bench writes
them), which outcomes count as passed, which paths the tests read, and how a sandboxed agent's
gateway address is rewritten to its bridge."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest

from darl.activities.sandbox.agent import Gateway
from darl.activities.sandbox.canaries import Canaries, plant
from darl.activities.sandbox.errors import SandboxSpecError
from darl.activities.sandbox.grading import listed_tests
from darl.activities.sandbox.outcomes import Records, Verdict, declared_xfail, judge
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


CANARIES = Canaries("t.py", "t.py::test_canary_pass", "t.py::test_canary_fail")
HONEST = [
    {"event": "pytest"},
    {"nodeid": "t.py::ok", "when": "call", "outcome": "passed"},
    {"nodeid": "t.py::xfailed", "when": "call", "outcome": "skipped", "xfail": True},
    {"nodeid": "t.py::declared[1]", "when": "call", "outcome": "skipped", "xfail": True},
    {"nodeid": "t.py::skipped", "when": "setup", "outcome": "skipped"},
    {"nodeid": "t.py::teardown", "when": "call", "outcome": "passed"},
    {"nodeid": "t.py::teardown", "when": "teardown", "outcome": "failed"},
    {"nodeid": "t.py::failed", "when": "call", "outcome": "failed"},
    {"nodeid": "t.py::test_canary_pass", "when": "call", "outcome": "passed"},
    {"nodeid": "t.py::test_canary_fail", "when": "call", "outcome": "failed"},
    {"event": "finish", "exitstatus": 1},
]
LISTED = ["t.py::ok", "t.py::xfailed", "t.py::declared[1]", "t.py::teardown", "t.py::failed"]


def verdict(records: list[dict[str, object]], exit_code: int | None = 1) -> Verdict:
    text = "".join(json.dumps(r) + "\n" for r in records) + "not json\n[1]\n"
    return judge(Records.read(text), LISTED, [CANARIES], {"t.py::declared"}, exit_code)


def test_a_test_passes_only_with_a_passing_call_and_no_failed_phase() -> None:
    """An xfail counts only where DARL's copy of the test file declares it."""
    assert verdict(HONEST) == Verdict(["t.py::ok", "t.py::declared[1]"])
    assert not Records.read("").started


@pytest.mark.parametrize(
    ("change", "exit_code", "void"),
    [
        ({"event": "foreign", "what": "hook"}, 1, "tampering: pytest ran hooks DARL did not"),
        ({"event": "altered", "nodeid": "t.py::ok"}, 1, "tampering: the run of a test"),
        (None, 0, "pytest exited 0 (its session said 1)"),
        (None, 2, "pytest exited 2 (its session said 1)"),
        (None, 137, "pytest exited 137"),
        ("no finish", 1, "the test run ended before pytest finished its session"),
        (
            {"nodeid": "t.py::test_canary_fail", "when": "call", "outcome": "passed"},
            1,
            "tampering: the canary test that must fail",
        ),
        (
            {"nodeid": "t.py::test_canary_fail", "when": "call", "outcome": "skipped", "xfail": 1},
            1,
            "tampering: the canary test that must fail",
        ),
        ("no canary pass", 1, "the canary test that must pass did not pass"),
        (
            {"nodeid": "t.py::test_canary_pass", "when": "teardown", "outcome": "failed"},
            1,
            "the canary test that must pass did not pass",
        ),
    ],
)
def test_a_run_that_did_not_end_as_an_honest_one_counts_for_nothing(
    change: object, exit_code: int, void: str
) -> None:
    records = [r for r in HONEST if r.get("event") != "finish"]
    if change == "no canary pass":
        records = [r for r in records if r.get("nodeid") != CANARIES.must_pass]
    elif isinstance(change, dict):
        records = [r for r in records if r.get("nodeid") != change.get("nodeid")] + [change]
    if change != "no finish":
        records.append({"event": "finish", "exitstatus": 1})
    found = verdict(records, exit_code)
    assert found.passed == [] and found.void is not None and found.void.startswith(void)


def test_the_declared_expected_failures(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.xfail(reason='known')\ndef test_marked():\n    pass\n\n"
        "def test_imperative():\n    pytest.xfail('later')\n\n"
        "@pytest.mark.parametrize('x', [1, pytest.param(2, marks=pytest.mark.xfail)])\n"
        "def test_a_param(x):\n    pass\n\n"
        "def test_plain():\n    pass\n\n"
        "@pytest.mark.xfail\nclass TestAll:\n    def test_in(self):\n        pass\n\n"
        "class TestSome:\n    def test_not(self):\n        pass\n"
    )
    (tmp_path / "m.py").write_text(
        "import pytest\npytestmark = [pytest.mark.xfail]\n\ndef test_any():\n    pass\n"
    )
    assert declared_xfail(tmp_path, ["t.py", "m.py", "missing.py"]) == {
        "t.py::test_marked",
        "t.py::test_imperative",
        "t.py::test_a_param",
        "t.py::TestAll::test_in",
        "m.py::test_any",
    }


def _run_canaries(tree: Path, planted: Canaries) -> dict[str, str]:
    namespace: dict[str, object] = {}
    exec(compile((tree / planted.file).read_text(), planted.file, "exec"), namespace)
    outcomes = {}
    for nodeid in (planted.must_pass, planted.must_fail):
        try:
            namespace[nodeid.rsplit("::", 1)[1]]()  # type: ignore[operator]
            outcomes[nodeid] = "passed"
        except AssertionError:
            outcomes[nodeid] = "failed"
    return outcomes


MODULE_A = '''\
"""Tests of a."""
from os.path import join


def test_join_paths():
    assert join("a") == "a"


class TestMore:
    def test_join_more(self):
        assert join("a", "b") == "a/b"


def test_last():
    pass
'''


def test_canaries_are_named_like_the_listed_tests_and_drawn_fresh(tmp_path: Path) -> None:
    """A pair in every listed file that can hold them, each canary named like that file's
    listed tests, anywhere between its tests (never above its imports), bodies and places
    drawn fresh; the file's own tests untouched."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(MODULE_A)
    (tmp_path / "tests" / "test_b.py").write_text("def test_b_one():\n    pass\n")
    (tmp_path / "tests" / "test_marked.py").write_text(
        "import pytest\n\npytestmark = pytest.mark.skip\n\n\ndef test_skipped():\n    pass\n"
    )
    listed = [
        "tests/test_a.py::test_join_paths",
        "tests/test_a.py::TestMore::test_join_more[x]",
        "tests/test_b.py::test_b_one",
        "tests/test_marked.py::test_skipped",
    ]
    seen, places = set(), set()
    for seed in range(30):
        tree = tmp_path / f"copy-{seed}"
        shutil.copytree(tmp_path / "tests", tree / "tests")
        planted = plant(tree, listed, random.Random(seed))
        # Never in a file whose module-wide marks would apply to them.
        assert [p.file for p in planted] == ["tests/test_a.py", "tests/test_b.py"]
        for pair in planted:
            assert pair.must_pass != pair.must_fail
            assert _run_canaries(tree, pair) == {
                pair.must_pass: "passed",
                pair.must_fail: "failed",
            }
        for nodeid in (planted[0].must_pass, planted[0].must_fail):
            name = nodeid.rsplit("::", 1)[1]
            assert name.startswith("test_join_") and name.endswith(("_paths", "_more")), name
        text = (tree / planted[0].file).read_text()
        assert text.startswith('"""Tests of a."""\nfrom os.path import join\n')
        assert "assert join is not None" in text
        # Take the canaries out again: the file's own tests are as they were.
        kept = text
        for nodeid in (planted[0].must_pass, planted[0].must_fail):
            name = re.escape(nodeid.rsplit("::", 1)[1])
            kept = re.sub(rf"\n\n\ndef {name}\(\):\n(    .*\n)+", "\n", kept)
        assert re.sub(r"\n+", "\n", kept) == re.sub(r"\n+", "\n", MODULE_A)
        seen.add(text)
        places.add(text.index(planted[0].must_fail.rsplit("::", 1)[1]))
    assert len(seen) == 30 and len(places) > 3


def test_canaries_go_to_a_file_of_their_own_when_no_listed_file_can_hold_them(
    tmp_path: Path,
) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_m.py").write_text("import pytest\npytestmark = []\n")
    [planted] = plant(tmp_path, ["tests/test_m.py::test_x"], random.Random(1))
    assert planted.file.startswith("tests/test_") and planted.file != "tests/test_m.py"
    assert _run_canaries(tmp_path, planted) == {
        planted.must_pass: "passed",
        planted.must_fail: "failed",
    }


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
        ("sub/.gitattributes", True),
        ("pkg/calc.py", False),
        ("docs/testing.md", False),
    ],
)
def test_the_paths_tests_read(path: str, read: bool) -> None:
    assert read_by_tests(path) is read


def test_modules_that_would_shadow_pytest_or_the_standard_library() -> None:
    """Of any importable kind, where a test run finds top-level modules: the repository's top
    or a folder that is not a package."""
    packages = {"pkg", "pkg/json"}.__contains__
    for shadow in (
        "pytest.py",
        "json/__init__.py",
        "tomllib.cpython-311-x86_64-linux-gnu.so",
        "pdb.abi3.so",
        "src/tomllib.so",
        "tests/pdb.py",
        "pluggy/__init__.so",
        "sub/dir/inspect.pyc",
    ):
        assert shadows_a_module(shadow, packages), shadow
    for kept in ("calc.py", "pkg/json.py", "pkg/json/__init__.py", "tomllib.txt", "pdb"):
        assert not shadows_a_module(kept, packages), kept


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
