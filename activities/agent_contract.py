"""The agent contract (docs/architecture.md): the addresses, token and variables a rollout
attempt hands to its agent, whatever runs it (local process, HTTP service, Kubernetes Job)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from darl.workflows.contracts import RolloutSpec
from darl.workflows.rollout_token import TokenClaims, mint_token

# The token outlives the rollout timeout by this much, so a slow last call is not refused.
TOKEN_SLACK_SECONDS = 300

# Never handed to an agent: the keys that could mint tokens or drive the gateway.
SECRET_ENV_VARS = frozenset({"DARL_TOKEN_SECRET", "DARL_ADMIN_KEY"})


class TaskPathError(KeyError):
    """An `env_map` path names a field the task does not have."""


def task_field(task: Mapping[str, Any], dotted_path: str) -> Any:
    value: Any = task
    for part in dotted_path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise TaskPathError(f"task has no field {dotted_path!r}")
        value = value[part]
    return value


def env_map_values(task: Mapping[str, Any], env_map: Mapping[str, str]) -> dict[str, str]:
    """Agent Lightning's `env_map`: strings as they are, anything else as JSON."""
    values = {}
    for name, path in env_map.items():
        value = task_field(task, path)
        values[name] = value if isinstance(value, str) else json.dumps(value)
    return values


@dataclass(frozen=True)
class AgentContract:
    rollout_id: str
    attempt: int
    mode: str
    token: str
    base_url: str
    result_url: str
    agl_base_url: str
    agl_event_url: str
    traceparent: str | None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ContractIssuer:
    """Mints a rollout token and builds the contract for one attempt.

    `gateway_url` is the gateway as the agent reaches it (a Service name for Kubernetes Jobs).
    """

    gateway_url: str
    token_secret: bytes

    def issue(
        self, spec: RolloutSpec, attempt: int, traceparent: str | None, env_map: Mapping[str, str]
    ) -> AgentContract:
        gateway = self.gateway_url.rstrip("/")
        rollout = spec.rollout_id
        token = mint_token(
            self.token_secret,
            TokenClaims(
                rollout_id=rollout,
                attempt=attempt,
                mode=spec.mode.value,
                expires_at=int(time.time() + spec.timeouts.agent_seconds + TOKEN_SLACK_SECONDS),
                traceparent=traceparent,
            ),
        )
        base_url = f"{gateway}/rollouts/{rollout}/v1"
        result_url = f"{gateway}/rollouts/{rollout}/result"
        mode = spec.mode.value
        agl_base = f"{gateway}/proxy/rollout/{rollout}/attempt/{attempt}/mode/{mode}/openai/v1"
        agl_events = f"{gateway}/api/rollouts/{rollout}/attempt/{attempt}/events"
        env = {
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": token,
            "DARL_ROLLOUT_ID": rollout,
            "DARL_ATTEMPT": str(attempt),
            "DARL_RUN_ID": spec.run_id,
            "DARL_GROUP_ID": spec.group_id,
            "DARL_TASK": json.dumps(spec.task),
            "DARL_MODE": spec.mode.value,
            "DARL_RESULT_URL": result_url,
            "AGL_OPENAI_BASE_URL": agl_base,
            "AGL_EVENT_URL": agl_events,
            "AGL_KEY": token,
            **env_map_values(spec.task, env_map),
        }
        if traceparent:
            env["TRACEPARENT"] = traceparent
        return AgentContract(
            rollout_id=rollout,
            attempt=attempt,
            mode=spec.mode.value,
            token=token,
            base_url=base_url,
            result_url=result_url,
            agl_base_url=agl_base,
            agl_event_url=agl_events,
            traceparent=traceparent,
            env=env,
        )


def inherited_env() -> dict[str, str]:
    """The worker's environment minus DARL's secrets: what a local agent process starts from."""
    return {k: v for k, v in os.environ.items() if k not in SECRET_ENV_VARS}
