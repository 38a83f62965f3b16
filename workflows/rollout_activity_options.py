"""How the RolloutWorkflow calls its activities: the retry policy of each (launch, await,
stop, reward, report), the margin await_agent gets past the rollout timeout, and how long one
try of the report may take."""

from __future__ import annotations

from datetime import timedelta

from temporalio.common import RetryPolicy

from darl.workflows.names import AGENT_LOST_ERROR, AGENT_SPEC_ERROR

# With one activity (`RolloutWorkflow._one_activity`): await_agent's margin past the rollout
# timeout to close the attempt and score it. Without: the workflow keeps a timer, and
# await_agent enforces its own deadline this long after it, in case the workflow cannot cancel
# it (its workers down).
RUNNER_DEADLINE_GRACE = timedelta(seconds=60)
# A launch is tried a few times; past them, the attempt is an infra failure and the next
# attempt launches afresh. An agent spec that cannot start anything is not retried.
LAUNCH_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_attempts=3,
    non_retryable_error_types=[AGENT_SPEC_ERROR],
)
# A retry after a lost heartbeat re-attaches to the running agent (rule 3); an agent gone
# without an exit status is the attempt's infra failure at once.
AWAIT_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=20,
    non_retryable_error_types=[AGENT_LOST_ERROR],
)
# Stopping an agent whose launch was cancelled: a few tries, then a warning.
STOP_RETRY = RetryPolicy(maximum_attempts=3)
# compute_reward: a few tries; past them, the rollout failed for infra reasons.
REWARD_RETRY = RetryPolicy(maximum_attempts=3)
# The report's local activity: each try is a signal's round trip (batched), retried while the
# trainer's Temporal is unreachable; past the last try the trainer looks the rollout up
# (`reconcile_after_seconds`).
REPORT_TRY_TIMEOUT = timedelta(seconds=30)
REPORT_RETRIES = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=10,
)
