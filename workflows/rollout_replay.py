"""Which recorded calls a rollout's attempt replays (rule 10): the lineage of attempts whose
record a new attempt is handed, and what the final attempt made of its record and of the prefix
a branch starts from. Deterministic: workflow state."""

from __future__ import annotations

from typing import Literal

from darl.workflows.contracts import PrefixSpec, ReplayOutcome


class ReplayLineage:
    """The attempts whose recorded calls the next attempt replays, newest first: every
    attempt lost to an infrastructure failure, the last one first. Launch and await requests
    carry it; the attempt's token names it to the gateway."""

    def __init__(self, resume: Literal["replay", "restart"]) -> None:
        self._resume = resume
        self.attempts: list[int] = []

    def extend(self, lost_attempt: int) -> None:
        """`lost_attempt` hands the calls it recorded to the next attempt, which replays them.
        Its record holds the calls it replayed itself, so a third attempt replays the second;
        and if it was lost before its replay was over, the calls it had yet to replay continue
        it (the gateway reads that in the records: the lineage names where to look). Every
        lost attempt is named, whether or not the workflow heard of a call of it: answers its
        agent never received (it died while they were at the policy server) are recorded but
        never signalled, and an attempt that recorded nothing costs the gateway one read of
        an empty record before it continues with the attempt before. A rollout that resumes
        by `restart` hands on nothing."""
        if self._resume == "replay":
            self.attempts = [lost_attempt, *self.attempts]


def prefix_calls(replay: ReplayOutcome | None, seen_replaying_the_prefix: int) -> int:
    """The final attempt's calls that reproduced the prefix, as its close said; for an
    attempt whose close never came (cancelled at the run's end), the calls the workflow saw
    replayed from the prefix, so that they are never counted as a resumption."""
    if replay is not None:
        return replay.prefix_calls
    return seen_replaying_the_prefix


def prefix_diverged_at(prefix: PrefixSpec | None, replay: ReplayOutcome | None) -> int | None:
    """Where a rollout that starts from a prefix left it before its end, as the close of the
    final attempt said; None when it reproduced it whole, or nobody could say."""
    if prefix is None or replay is None or replay.prefix_calls >= prefix.calls:
        return None
    return replay.prefix_calls
