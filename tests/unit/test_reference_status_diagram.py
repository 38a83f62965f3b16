"""The rollout status page draws the legal moves as a diagram written by hand: it must be the
table itself (`TRANSITIONS`), every edge and no other, with the final statuses ending there."""

from __future__ import annotations

import re
from pathlib import Path

from darl.workflows.rollout_status import FINAL_STATUSES, TRANSITIONS, RolloutStatus

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "rollout-status.md"
EDGE = re.compile(r"^\s*(\S+)\s*-->\s*(\S+)\s*$")


def drawn_edges() -> set[tuple[str, str]]:
    text = PAGE.read_text()
    diagram = text.split("```mermaid", 1)[1].split("```", 1)[0]
    return {m.groups() for line in diagram.splitlines() if (m := EDGE.match(line))}


def test_the_status_diagram_is_the_transition_table() -> None:
    edges = drawn_edges()
    moves = {(a, b) for a, b in edges if "[*]" not in (a, b)}
    assert moves == {(a.value, b.value) for a, targets in TRANSITIONS.items() for b in targets}
    assert {b for a, b in edges if a == "[*]"} == {RolloutStatus.PENDING.value}
    assert {a for a, b in edges if b == "[*]"} == {s.value for s in FINAL_STATUSES}


def test_the_status_table_names_every_status() -> None:
    rows = set(re.findall(r"^\| `(\w+)` \|", PAGE.read_text(), re.MULTILINE))
    assert rows == {s.value for s in RolloutStatus}
