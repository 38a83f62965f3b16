"""The SWE task set (examples/swe): the shipped instances are complete SWE-bench/SWE-smith rows
that DARL's trainer and the instance loader read unchanged; the mirrors rebuild to exactly
their base commits whatever the user's git configuration; three instances, checked with real
git and pytest, grade as SWE-bench grades; and the generator makes such instances from a
repository it has never seen."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from darl.examples.swe import instances
from darl.examples.swe.make_tasks import make_tasks
from darl.examples.swe.mirrors import git_environment
from darl.trainer.datasets import load_tasks

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "examples" / "swe" / "tasks.jsonl"
ROWS = [json.loads(line) for line in TASKS.read_text().splitlines()]
FIELDS = {
    "instance_id",
    "repo",
    "base_commit",
    "patch",
    "test_patch",
    "problem_statement",
    "hints_text",
    "created_at",
    "version",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "image_name",
}
INSTANCE_ID = re.compile(r"darl-swe__(?P<name>[a-z]+)\.func_pm_[a-z_]+__[0-9a-f]{8}")


def added_lines(patch: str) -> list[str]:
    return [line[1:] for line in patch.splitlines() if line[:1] == "+" and line[:3] != "+++"]


def files_of(patch: str) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/", patch, flags=re.MULTILINE)


def hidden_files(row: dict) -> list[str]:
    return sorted({test.split("::")[0] for test in row["FAIL_TO_PASS"]})


def test_the_shipped_instances_are_complete_swe_smith_rows() -> None:
    assert len(ROWS) >= 50
    assert len({row["instance_id"] for row in ROWS}) == len(ROWS)
    per_repo: dict[str, int] = {}
    for row in ROWS:
        name = row["instance_id"]
        assert set(row) == FIELDS, name
        match = INSTANCE_ID.fullmatch(name)
        assert match, name
        assert row["repo"] == f"darl-swe/{match['name']}"
        assert row["image_name"] == f"{row['repo']}:{name.split('.', 1)[1]}"
        assert re.fullmatch(r"[0-9a-f]{40}", row["base_commit"]), name
        assert row["FAIL_TO_PASS"] and row["PASS_TO_PASS"], name
        assert not set(row["FAIL_TO_PASS"]) & set(row["PASS_TO_PASS"]), name
        for test in row["FAIL_TO_PASS"] + row["PASS_TO_PASS"]:
            assert re.fullmatch(r"tests/test_\w+\.py::test_\w+", test), test
        # The fix touches code only; the test patch adds back exactly the hidden test files.
        assert files_of(row["patch"]) and not any(
            f.startswith("tests/") for f in files_of(row["patch"])
        )
        assert files_of(row["test_patch"]) == hidden_files(row), name
        assert row["test_patch"].count("new file mode 100644") == len(hidden_files(row))
        per_repo[row["repo"]] = per_repo.get(row["repo"], 0) + 1
    assert set(per_repo) == {f"darl-swe/{p.name}" for p in (ROOT / "examples/swe/repos").iterdir()}
    assert min(per_repo.values()) >= 10, per_repo


def test_the_trainer_and_the_loader_read_the_file_unchanged() -> None:
    assert load_tasks(TASKS).rows == ROWS
    assert instances.load_instances(TASKS) == ROWS


def test_problem_statements_do_not_hold_the_fix() -> None:
    for row in ROWS:
        statement = row["problem_statement"]
        assert "```python\n>>> " in statement and "I expected" in statement, row["instance_id"]
        fix = [line.strip() for line in added_lines(row["patch"]) if line.strip()]
        assert fix, row["instance_id"]
        assert not [line for line in fix if line in statement], row["instance_id"]


@pytest.fixture(scope="module")
def mirrors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mirrors built by the CLI under a git configuration that would change every hash
    (another identity, CRLF conversion, signing) were it read."""
    home = tmp_path_factory.mktemp("home")
    hostile = home / "gitconfig"
    hostile.write_text(
        "[user]\n\tname = Someone Else\n\temail = else@example.com\n"
        "[core]\n\tautocrlf = true\n[commit]\n\tgpgSign = true\n"
    )
    out = tmp_path_factory.mktemp("mirrors")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": str(hostile), "GIT_AUTHOR_DATE": "1 +0100"}
    command = [sys.executable, "-m", "darl.examples.swe.make_tasks", "mirrors", "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


def git(*args: str, cwd: Path | None = None, stdin: str = "") -> str:
    done = subprocess.run(
        ["git", *args],
        cwd=cwd,
        input=stdin,
        env=git_environment(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def test_mirrors_rebuild_the_shipped_base_commits(mirrors: Path) -> None:
    for row in ROWS:
        git_dir = mirrors / instances.mirror_name(row["repo"])
        branch = git(f"--git-dir={git_dir}", "rev-parse", f"refs/heads/{row['instance_id']}")
        assert branch.strip() == row["base_commit"], row["instance_id"]
        parent = git(f"--git-dir={git_dir}", "rev-parse", f"{row['base_commit']}^")
        assert parent == git(f"--git-dir={git_dir}", "rev-parse", "refs/heads/main")


def pytest_outcomes(workdir: Path, tests: list[str]) -> dict[str, str]:
    """PASSED/FAILED/ERROR per test id, from a plain `python -m pytest -rA` run."""
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *tests]
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=120
    )
    outcomes = {}
    for line in done.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR"):
            outcomes[rest.split(" - ")[0]] = word
    return outcomes


def most_hidden(repo: str) -> dict:
    """The repository's instance with the most hidden test files (the hardest to restore)."""
    return max((r for r in ROWS if r["repo"] == repo), key=lambda r: len(hidden_files(r)))


@pytest.mark.parametrize("repo", ["darl-swe/textkit", "darl-swe/ledger", "darl-swe/confparse"])
def test_an_instance_grades_as_swe_bench_grades(mirrors: Path, tmp_path: Path, repo: str) -> None:
    row = most_hidden(repo)
    fail, passing = row["FAIL_TO_PASS"], row["PASS_TO_PASS"]
    work = tmp_path / "testbed"
    git("clone", "--quiet", str(mirrors / instances.mirror_name(repo)), str(work))
    git("checkout", "--quiet", "--detach", row["base_commit"], cwd=work)
    assert hidden_files(row) and not any((work / f).exists() for f in hidden_files(row))
    assert (work / "tests").is_dir()  # the other tests are there to run

    git("apply", "-", cwd=work, stdin=row["test_patch"])
    before = pytest_outcomes(work, fail + passing)
    assert {before.get(t) for t in fail} == {"FAILED"}, before
    assert {before.get(t) for t in passing} == {"PASSED"}, before

    git("apply", "-", cwd=work, stdin=row["patch"])
    after = pytest_outcomes(work, fail + passing)
    assert {after.get(t) for t in fail + passing} == {"PASSED"}, after


SWE_BENCH_ROW = {
    "repo": "astropy/astropy",
    "instance_id": "astropy__astropy-12907",
    "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
    "patch": "diff --git a/astropy/modeling/separable.py b/astropy/modeling/separable.py\n",
    "test_patch": "diff --git a/astropy/modeling/tests/test_separable.py b/...\n",
    "problem_statement": "Modeling's `separability_matrix` does not compute separability...",
    "hints_text": "",
    "created_at": "2022-03-03T15:14:54Z",
    "version": "4.3",
    "FAIL_TO_PASS": '["astropy/modeling/tests/test_separable.py::test_separable[compound_model6]"]',
    "PASS_TO_PASS": '["astropy/modeling/tests/test_separable.py::test_coord_matrix"]',
    "environment_setup_commit": "298ccb478e6bf092953bca67a3d29dc6c35f6752",
}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_swe_bench_row_loads_unchanged_with_its_json_string_test_lists(tmp_path: Path) -> None:
    smith_row = {**SWE_BENCH_ROW, "FAIL_TO_PASS": ["a.py::t"], "PASS_TO_PASS": []}
    path = write_lines(tmp_path / "x.jsonl", [json.dumps(SWE_BENCH_ROW), "", json.dumps(smith_row)])
    loaded = instances.load_instances(path)
    assert loaded == [SWE_BENCH_ROW, smith_row]
    assert instances.test_ids(loaded[0], "FAIL_TO_PASS") == [
        "astropy/modeling/tests/test_separable.py::test_separable[compound_model6]"
    ]
    assert instances.test_ids(loaded[1], "FAIL_TO_PASS") == ["a.py::t"]
    assert instances.test_ids(loaded[1], "PASS_TO_PASS") == []


@pytest.mark.parametrize(
    ("second_line", "error"),
    [
        (
            json.dumps({k: v for k, v in SWE_BENCH_ROW.items() if k != "base_commit"}),
            r"x\.jsonl:2: the instance lacks the field base_commit$",
        ),
        ('{"instance_id": "a", ', r"x\.jsonl:2: not valid JSON"),
        (json.dumps({**SWE_BENCH_ROW, "PASS_TO_PASS": "tests/a.py"}), r"x\.jsonl:2: PASS_TO_PASS"),
        (json.dumps([SWE_BENCH_ROW]), r"x\.jsonl:2: an instance is a JSON object, not list"),
    ],
    ids=["missing-field", "bad-json", "bad-test-list", "not-an-object"],
)
def test_a_row_that_is_not_an_instance_is_refused_with_its_line(
    tmp_path: Path, second_line: str, error: str
) -> None:
    path = write_lines(tmp_path / "x.jsonl", [json.dumps(SWE_BENCH_ROW), second_line])
    with pytest.raises(instances.InstanceError, match=error):
        instances.load_instances(path)


def test_mirror_names_follow_swe_smith() -> None:
    assert instances.mirror_name("darl-swe/textkit") == "darl-swe__textkit"
    assert instances.mirror_name("swesmith/oauthlib__oauthlib.1fd52536") == (
        "swesmith__oauthlib__oauthlib.1fd52536"
    )
    with pytest.raises(instances.InstanceError, match="not 'owner/name'"):
        instances.mirror_name("textkit")


TALLY = {
    "pyproject.toml": '[project]\nname = "tally"\nversion = "0.1.0"\n\n'
    '[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["."]\n',
    "tally/__init__.py": "",
    "tally/core.py": (
        "def clamp(value, low, high):\n"
        "    if value < low:\n"
        "        return low\n"
        "    if value > high:\n"
        "        return high\n"
        "    return value\n"
    ),
    "tests/test_low.py": (
        "from tally.core import clamp\n\n\n"
        "def test_below():\n    assert clamp(-5, 0, 10) == 0\n\n\n"
        "def test_inside():\n    assert clamp(5, 0, 10) == 5\n"
    ),
    "tests/test_high.py": (
        "from tally.core import clamp\n\n\n"
        "def test_above():\n    assert clamp(15, 0, 10) == 10\n\n\n"
        "def test_at_the_top():\n    assert clamp(10, 0, 10) == 10\n"
    ),
}


def test_the_generator_makes_checked_instances_from_a_new_repository(tmp_path: Path) -> None:
    for path, text in TALLY.items():
        (tmp_path / "tally" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tally" / path).write_text(text)
    rows, candidates = make_tasks(3, repos=tmp_path)
    assert len(rows) == 3 and candidates["tally"] >= 3
    for row in rows:
        assert set(row) == FIELDS and row["repo"] == "darl-swe/tally"
        # Every failing test is in a hidden file, and only those files are hidden.
        assert files_of(row["test_patch"]) == hidden_files(row)
        assert set(row["FAIL_TO_PASS"]) | set(row["PASS_TO_PASS"]) == {
            "tests/test_low.py::test_below",
            "tests/test_low.py::test_inside",
            "tests/test_high.py::test_above",
            "tests/test_high.py::test_at_the_top",
        }
        assert files_of(row["patch"]) == ["tally/core.py"]
        assert "`clamp`" in row["problem_statement"]
