"""DARL's Temporal search attributes: what makes rollouts findable in the Web UI and with
`temporal workflow list --query 'DarlRun="r1" AND DarlStatus="failed_agent"'`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

if TYPE_CHECKING:
    from darl.workflows.contracts import RolloutSpec

RUN = SearchAttributeKey.for_keyword("DarlRun")
GROUP = SearchAttributeKey.for_keyword("DarlGroup")
STATUS = SearchAttributeKey.for_keyword("DarlStatus")
MODE = SearchAttributeKey.for_keyword("DarlMode")
REWARD = SearchAttributeKey.for_float("DarlReward")
POLICY_VERSION = SearchAttributeKey.for_int("DarlPolicyVersion")
# The trainer's last applied step (TrainingWorkflow only).
STEP = SearchAttributeKey.for_int("DarlStep")

ALL: tuple[SearchAttributeKey[Any], ...] = (RUN, GROUP, STATUS, MODE, REWARD, POLICY_VERSION, STEP)

# The `--search-attribute Name=Type` spelling the dev server takes.
_CLI_TYPES = {"KEYWORD": "Keyword", "DOUBLE": "Double", "INT": "Int"}


def dev_server_flags() -> list[str]:
    flags: list[str] = []
    for key in ALL:
        flags += ["--search-attribute", f"{key.name}={_CLI_TYPES[key.indexed_value_type.name]}"]
    return flags


def rollout_attributes(spec: RolloutSpec, status: str) -> TypedSearchAttributes:
    """What a rollout starts with: set at start by its starter, or upserted by the workflow."""
    return TypedSearchAttributes(
        [
            SearchAttributePair(RUN, spec.run_id),
            SearchAttributePair(GROUP, spec.group_id),
            SearchAttributePair(MODE, spec.mode.value),
            SearchAttributePair(POLICY_VERSION, spec.policy_version),
            SearchAttributePair(STATUS, status),
        ]
    )
