"""How DARL's activities heartbeat: one callable type, one cadence rule, one no-op. Here, in
the contracts layer, because the timeouts it follows are the workflows' and both the rollout
runners and the trainer backends (which must not import each other) heartbeat."""

from __future__ import annotations

from collections.abc import Callable

# `activity.heartbeat` (details optional) or what stands in for it.
Heartbeat = Callable[..., None]

# The shortest cadence, however short a heartbeat timeout is made.
SHORTEST_SECONDS = 0.2


def heartbeat_interval(timeout_seconds: float | None, longest: float) -> float:
    """Three heartbeats per heartbeat timeout (a lost one or two do not time the activity
    out), at most `longest` apart, and `longest` when there is no heartbeat timeout."""
    if timeout_seconds is None:
        return longest
    return min(max(timeout_seconds / 3, SHORTEST_SECONDS), longest)


def no_heartbeat(*details: object) -> None:
    """The heartbeat of a call made outside an activity (tests, the CLI)."""
