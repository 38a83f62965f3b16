"""The accounting invariant of a training run, shared by its workflow and integration tests:
every rollout the run started ended in exactly one counter (or is still out)."""

from __future__ import annotations

from darl.workflows.training_state import Counters


def assert_accounted(c: Counters, inflight: int = 0) -> None:
    assert c.ended() + inflight == c.rollouts_started, c
    assert c.unknown_reports == 0, c
