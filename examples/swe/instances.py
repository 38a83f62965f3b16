"""SWE-bench and SWE-smith task instances from a local JSONL file, read as written: each
row stays the dict it is (a DARL task), checked only for the fields a coding rollout needs.
Nothing is downloaded."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# What a sandboxed rollout and its grader read: the repository at its commit, the issue,
# and the tests that grade it.
REQUIRED_FIELDS = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)
TEST_FIELDS = ("FAIL_TO_PASS", "PASS_TO_PASS")


class InstanceError(ValueError):
    """A row that is not a SWE-bench/SWE-smith instance, or a file that cannot be read."""


def load_instances(path: Path | str) -> list[dict[str, Any]]:
    """The instances of a JSONL file, a JSON object per non-blank line, unchanged. A row
    lacking a required field, or whose test lists are neither lists of test ids nor JSON
    strings of them, is an error naming its line."""
    path = Path(path)
    rows = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    rows.append(_instance(path, number, line))
    except (OSError, UnicodeDecodeError) as err:
        raise InstanceError(f"{path} cannot be read: {err}") from err
    if not rows:
        raise InstanceError(f"{path} holds no instances")
    return rows


def _instance(path: Path, number: int, line: str) -> dict[str, Any]:
    where = f"{path}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise InstanceError(f"{where}: not valid JSON ({err.msg})") from err
    if not isinstance(row, dict):
        raise InstanceError(f"{where}: an instance is a JSON object, not {type(row).__name__}")
    missing = [field for field in REQUIRED_FIELDS if field not in row]
    if missing:
        raise InstanceError(f"{where}: the instance lacks the field {', '.join(missing)}")
    for field in TEST_FIELDS:
        try:
            test_ids(row, field)
        except InstanceError as err:
            raise InstanceError(f"{where}: {err}") from err
    return row


def test_ids(instance: Mapping[str, Any], field: str) -> list[str]:
    """The test ids of FAIL_TO_PASS or PASS_TO_PASS: a list (SWE-smith) or a JSON string
    of one (SWE-bench on Hugging Face)."""
    value = instance.get(field)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise InstanceError(f"{field} is a string but not a JSON list ({err.msg})") from err
    if not isinstance(value, list) or not all(isinstance(test, str) for test in value):
        raise InstanceError(
            f"{field} must be a list of test ids or a JSON string of one, not {value!r:.80}"
        )
    return value


# Not a test, although pytest would collect it by its name wherever it is imported.
test_ids.__test__ = False  # type: ignore[attr-defined]


def mirror_name(repo: str) -> str:
    """The directory of a repository's mirror, SWE-smith's naming: "owner/name" -> "owner__name"."""
    owner, slash, name = repo.partition("/")
    if not slash or not owner or not name or "/" in name:
        raise InstanceError(f"repo {repo!r} is not 'owner/name'")
    return f"{owner}__{name}"
