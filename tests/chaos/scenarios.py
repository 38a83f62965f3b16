"""The kills the chaos tier makes: one of each component, at the moments that matter."""

from __future__ import annotations

from tests.chaos.checks import Kill
from tests.chaos.harness import (
    AGENT_SERVICE_NAME,
    GATEWAY,
    IN_SYNC,
    IN_TRAIN_STEP,
    PAUSED_FOR_SYNC,
    POLICY,
    POLICY_FORGETTING,
    ROLLING_OUT,
    ROLLOUT_WORKER,
    TEMPORAL,
    TRAINER,
)

# (component, when) of each kill of a run whose agent is the digits agent service.
HTTP_KILLS = [
    (ROLLOUT_WORKER, ROLLING_OUT),
    (TRAINER, IN_TRAIN_STEP),
    (TRAINER, IN_SYNC),
    (GATEWAY, ROLLING_OUT),
    (GATEWAY, PAUSED_FOR_SYNC),
    (POLICY, ROLLING_OUT),
    (POLICY_FORGETTING, ROLLING_OUT),
    (AGENT_SERVICE_NAME, ROLLING_OUT),
    (TEMPORAL, ROLLING_OUT),
]
# A run whose agents are local processes: their worker is killed under them.
LOCAL_KILLS = [(ROLLOUT_WORKER, ROLLING_OUT)]
# A run whose gateway is two replicas behind HAProxy: one replica is killed with calls in
# flight on it, and again while the replicas are paused for a sync.
REPLICA_KILLS = [(GATEWAY, ROLLING_OUT), (GATEWAY, PAUSED_FOR_SYNC)]


def in_sequence(kills: list[tuple[str, str]]) -> tuple[list[Kill], int]:
    """All kills in one run, one from each step on; steps enough that the run is still
    going when the last one strikes (a kill and its stall take a few steps' time)."""
    return [Kill(c, w, from_step=i + 1) for i, (c, w) in enumerate(kills)], 2 * len(kills) + 4
