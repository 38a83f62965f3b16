"""`darl rollout` starts a spec that says no revision at the current one (a user starting a
rollout today means today's command sequence), and one that says a revision at that one (a
history of an earlier release replays as it was)."""

from __future__ import annotations

import json
from pathlib import Path

from darl.deploy.cli.rollout import with_current_revision
from darl.workflows.contracts import CURRENT_REVISION, RolloutSpec

ROOT = Path(__file__).resolve().parents[2]


def spec_without_revision() -> dict[str, object]:
    data = json.loads((ROOT / "examples" / "arithmetic" / "rollout.json").read_text())
    data.pop("revision", None)
    return data


def test_a_spec_without_a_revision_starts_the_current_one() -> None:
    spec = RolloutSpec.model_validate(spec_without_revision())
    assert spec.revision == 1  # what the field means to a history without it
    assert with_current_revision(spec).revision == CURRENT_REVISION


def test_a_spec_that_says_its_revision_keeps_it() -> None:
    spec = RolloutSpec.model_validate({**spec_without_revision(), "revision": 1})
    assert with_current_revision(spec).revision == 1


def test_the_examples_say_the_current_revision() -> None:
    for path in sorted((ROOT / "examples").rglob("rollout*.json")):
        assert json.loads(path.read_text())["revision"] == CURRENT_REVISION, path
