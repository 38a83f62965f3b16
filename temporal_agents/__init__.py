"""DARL's side of agents written as Temporal workflows (the SDK's OpenAI Agents and LangGraph
integrations), on the user's worker: `DarlPlugin` carries the attempt DARL started the agent
workflow for into its activities, where `current_attempt()`, `DarlModelProvider` and DARL's
httpx clients send the model requests to the attempt's gateway. Workflow code may import it:
its imports pass through Temporal's sandbox."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from darl.temporal_agents.attempt import AgentAttempt, NoAgentAttemptError, current_attempt
    from darl.temporal_agents.plugin import PLUGIN_NAME, DarlPlugin
    from darl.temporal_agents.transport import (
        IDEMPOTENCY_KEY_HEADER,
        darl_async_httpx_client,
        darl_httpx_client,
    )

if TYPE_CHECKING:
    from darl.temporal_agents.model_provider import DarlModelProvider

__all__ = [
    "IDEMPOTENCY_KEY_HEADER",
    "PLUGIN_NAME",
    "AgentAttempt",
    "DarlModelProvider",
    "DarlPlugin",
    "NoAgentAttemptError",
    "current_attempt",
    "darl_async_httpx_client",
    "darl_httpx_client",
]


def __getattr__(name: str) -> Any:
    # The OpenAI Agents SDK is imported only by who asks for its model provider.
    if name == "DarlModelProvider":
        from darl.temporal_agents.model_provider import DarlModelProvider

        return DarlModelProvider
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
