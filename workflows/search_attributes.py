"""What a rollout shows outside its history: DARL's Temporal search attributes, which make
rollouts findable in the Web UI and with `temporal workflow list --query 'DarlRun="r1" AND
DarlStatus="failed_agent"'`, and the summary and details the Web UI shows on its page."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

if TYPE_CHECKING:
    from pydantic import JsonValue

    from darl.workflows.contracts import RolloutSpec

RUN = SearchAttributeKey.for_keyword("DarlRun")
GROUP = SearchAttributeKey.for_keyword("DarlGroup")
STATUS = SearchAttributeKey.for_keyword("DarlStatus")
MODE = SearchAttributeKey.for_keyword("DarlMode")
REWARD = SearchAttributeKey.for_float("DarlReward")
# On a rollout: its last serving version, the policy version that served the last model call
# its workflow received (the highest sequence of its latest attempt with calls); the version at
# start until a call arrives. It is published with the status upserts a rollout makes anyway
# (when an attempt ends, and with its final status), never an upsert per call, so while an
# attempt runs it can trail that attempt's calls. On a run: the version the trainer serves now.
POLICY_VERSION = SearchAttributeKey.for_int("DarlPolicyVersion")
# The trainer's last applied step (TrainingWorkflow only).
STEP = SearchAttributeKey.for_int("DarlStep")

ALL: tuple[SearchAttributeKey[Any], ...] = (RUN, GROUP, STATUS, MODE, REWARD, POLICY_VERSION, STEP)

# The `--search-attribute Name=Type` spelling the dev server takes.
_CLI_TYPES = {"KEYWORD": "Keyword", "DOUBLE": "Double", "INT": "Int"}

# UTF-8 bytes of a task's short form; the server refuses a static summary over 200 bytes.
TASK_SHORT_FORM_BYTES = 120
# UTF-8 bytes of the error in a rollout's current details (a log tail can be long).
ERROR_LINE_BYTES = 200


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


# --- the Web UI's summary and details (Temporal markdown; pure, so workflow code may call it) --


def _clipped(text: str, limit: int) -> str:
    """`text` in at most `limit` UTF-8 bytes, cut at a character and ended by an ellipsis."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - len("…".encode())].decode(errors="ignore") + "…"


def task_short_form(task: JsonValue) -> str:
    """A task on one line of at most TASK_SHORT_FORM_BYTES: a string as itself, any other
    JSON value as compact JSON, whitespace runs folded, backticks (which would end the code
    span it is shown in) as quotes."""
    text = task if isinstance(task, str) else json.dumps(task, ensure_ascii=False)
    return _clipped(" ".join(text.replace("`", "'").split()), TASK_SHORT_FORM_BYTES)


def rollout_summary(spec: RolloutSpec) -> str:
    """The static summary a starter gives a rollout: its mode and its task's short form, one
    line within the server's 200 bytes (`train · {"question": "1+1"}`)."""
    return f"{spec.mode.value} · `{task_short_form(spec.task)}`"


def rollout_details(
    summary: str,
    *,
    status: str,
    attempt: int,
    max_attempts: int,
    calls: int,
    policy_version: int,
    reward: float | None,
    error: str | None,
    replayed: int = 0,
) -> str:
    """A rollout's current details: where it stands, its reward once scored, its error on one
    line, and its `summary` (so a rollout started without one, by the temporal CLI, says it
    too)."""
    facts = [f"**{status}**"]
    if reward is not None:
        facts.append(f"reward {reward:g}")
    if attempt:
        facts.append(f"attempt {attempt} of {max_attempts}")
    facts.append(f"{calls} call{'' if calls == 1 else 's'}")
    if replayed:
        facts.append(f"{replayed} replayed")
    facts.append(f"policy v{policy_version}")
    lines = [" · ".join(facts)]
    if error and error.strip():
        lines.append(_clipped(" ".join(error.split()), ERROR_LINE_BYTES))
    lines.append(summary)
    return "\n\n".join(lines)
