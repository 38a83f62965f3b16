"""Named failures of the activities. DARL's own code raises and catches `ActivitiesError`s:

    ActivitiesError
    ├── TaskFieldError              a task value an env_map or answer key cannot take
    │   ├── TaskPathError           a path the task lacks                          LookupError
    │   └── TaskValueTooLargeError  a value too large for an environment variable  ValueError
    └── RewardFunctionError         no usable reward function, or no finite number ValueError

What crosses to a workflow is a Temporal ApplicationError whose `type` the workflow reads
(never the message), made by the functions below."""

from __future__ import annotations

from temporalio.exceptions import ApplicationError

from darl.workflows.errors import DarlError
from darl.workflows.names import (
    AGENT_LOST_ERROR,
    AGENT_SPEC_ERROR,
    REWARD_SPEC_ERROR,
    TRAINING_CONFIG_ERROR,
    WEIGHT_SYNC_ERROR,
)

# A trajectory a step must train is not in the store as its rollout committed it.
TRAJECTORY_LOST = "TrajectoryLost"


class ActivitiesError(DarlError):
    """Raised by `darl.activities`: an agent spec or reward that cannot work on a task."""


def agent_spec_error(message: str) -> ApplicationError:
    """The agent spec cannot start an agent (no such command or entrypoint): not retried."""
    return ApplicationError(message, type=AGENT_SPEC_ERROR, non_retryable=True)


def reward_spec_error(message: str) -> ApplicationError:
    """The rollout's reward cannot work: bad input, not retried; nothing was started."""
    return ApplicationError(message, type=REWARD_SPEC_ERROR, non_retryable=True)


def agent_lost_error(message: str) -> ApplicationError:
    """The agent vanished without an exit status (killed from outside, machine lost): the
    attempt failed for infra reasons and the workflow starts a new one."""
    return ApplicationError(message, type=AGENT_LOST_ERROR, non_retryable=True)


def agent_service_unavailable(message: str) -> ApplicationError:
    """An agent HTTP service could not be reached: retried by the activity's retry policy."""
    return ApplicationError(message, type="AgentServiceUnavailable")


def agent_stopped_error(message: str) -> ApplicationError:
    """The attempt was stopped (its rollout cancelled) before or while its agent started."""
    return ApplicationError(message, type="AgentStopped", non_retryable=True)


def training_config_error(message: str) -> ApplicationError:
    """The run cannot work as configured (its data, reward, backend or a step's batch): the
    training workflow fails, saying why; not retried."""
    return ApplicationError(message, type=TRAINING_CONFIG_ERROR, non_retryable=True)


def service_unreachable(message: str) -> ApplicationError:
    """Something the run needs does not answer yet: retried a while (AT_START), then fatal."""
    return ApplicationError(message, type="Unreachable")


def trajectory_lost_error(message: str) -> ApplicationError:
    """A step's trajectory is not in the store as its rollout committed it: not retried."""
    return ApplicationError(message, type=TRAJECTORY_LOST, non_retryable=True)


def weight_sync_error(message: str) -> ApplicationError:
    """The policy servers could not take (or get back) the step's weights: not retried."""
    return ApplicationError(message, type=WEIGHT_SYNC_ERROR, non_retryable=True)
