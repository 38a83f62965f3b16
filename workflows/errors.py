"""The root of DARL's exceptions and the one way a validation failure becomes one line.

Every exception DARL raises on purpose derives from `DarlError` through its layer's base, so a
caller can catch one layer, or all of DARL, without catching Python's own errors:

    DarlError
    ├── WorkflowsError        darl.workflows: contracts, tokens, status table
    │   ├── TokenError                a rollout token missing, malformed, forged or expired
    │   │   └── TokenExpiredError
    │   ├── IllegalTransitionError    a status move the table does not allow
    │   ├── RewardFailedError         the reward function failed in await_agent
    │   └── EarlierRunError           the rollout id already has a result (control flow)
    ├── ActivitiesError       darl.activities: agent runners, rewards
    ├── GatewayError          darl.gateway (its tree is drawn in darl.gateway.errors)
    ├── ServingError          darl.serving: policy servers, the tiny model, vLLM launcher
    ├── TrainerError          darl.trainer: aggregation, backends, weight sync
    ├── ViewerError           darl.viewer
    └── DeployError           darl.deploy: the CLI, config files, processes

Each other layer draws its own subtree in the docstring of its `errors` module
(`darl.activities.errors`, `darl.serving.errors`, `darl.trainer.errors`, `darl.viewer.errors`).
An exception that is also a kind of Python error keeps that base too (`TokenError` is a
`ValueError`), so code that caught the builtin still does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class DarlError(Exception):
    """Anything DARL raises on purpose."""


class WorkflowsError(DarlError):
    """Raised by `darl.workflows`: a contract, token or status rule broken."""


def one_line(errors: Sequence[Mapping[str, Any]], whole: str = "input") -> str:
    """Pydantic's validation errors as one line naming each field:
    `messages: Field required; n: Input should be ...`. An error about the whole input (an
    empty location) is named `whole`."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or whole}: {e['msg']}" for e in errors)
