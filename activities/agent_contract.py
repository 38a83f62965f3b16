"""The agent contract (docs/architecture.md): the addresses, token and variables a rollout
attempt hands to its agent, whatever runs it (local process, HTTP service, Kubernetes Job)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from darl.activities.errors import ActivitiesError
from darl.workflows.contracts import RolloutSpec
from darl.workflows.json_paths import value_at
from darl.workflows.rollout_token import PrefixClaim, ReplayClaim, TokenClaims, mint_token

# The token outlives the rollout timeout by this much, so a slow last call is not refused.
TOKEN_SLACK_SECONDS = 300

# Never handed to an agent: the keys that could mint tokens or drive the gateway.
SECRET_ENV_VARS = frozenset({"DARL_TOKEN_SECRET", "DARL_ADMIN_KEY"})


# Agent Lightning's name for the task in an `env_map` value: `input` is the whole task,
# `input.<path>` a value inside it. Any other value is a literal (its gsm8k and search_r1
# configs set `{"MODEL": "Qwen/Qwen2.5-1.5B"}` this way).
TASK_ROOT = "input"


# Linux starts no program with an environment string (`NAME=value`) over 32 pages
# (MAX_ARG_STRLEN): "Argument list too long". The task goes in DARL_TASK only while its JSON
# is well within that (the environment and the arguments together have a limit too); it is
# always in the file DARL_TASK_FILE names, for an agent DARL starts (local, sandboxed,
# Kubernetes). An `env_map` value has no file, so one over the limit is refused.
ENV_STRING_MAX_BYTES = 32 * 4096 - 1
TASK_ENV_MAX_BYTES = 64 * 1024


class TaskFieldError(ActivitiesError):
    """A value of the task that an `env_map` (or a reward's answer key) cannot take."""


class TaskPathError(TaskFieldError, LookupError):
    """An `env_map` path (or a reward's answer key) names a value the task does not have."""


class TaskValueTooLargeError(TaskFieldError, ValueError):
    """An `env_map` value too large for an environment variable (ENV_STRING_MAX_BYTES)."""


def check_env_string(name: str, value: str, shown: str) -> None:
    """Refuse `NAME=value` over what Linux takes in an environment; `shown` says what the
    value is (the task's field, as the `env_map` names it)."""
    size = len(name.encode()) + 1 + len(value.encode())
    if size > ENV_STRING_MAX_BYTES:
        raise TaskValueTooLargeError(
            f"env_map {name}: {shown} is {size:,} bytes as an environment string, "
            f"over the {ENV_STRING_MAX_BYTES + 1:,} Linux takes; read it from the task file "
            "(DARL_TASK_FILE) instead"
        )


def task_field(task: Any, path: str, shown: str | None = None) -> Any:
    """The value at the dotted `path` inside `task` (any JSON value): an object's field by
    name, a list's item by index (`items.0`); the empty path is the task itself. `shown` is
    the path as the user wrote it, for the error."""
    try:
        return value_at(task, path)
    except LookupError:
        raise TaskPathError(f"task has no field {shown if shown is not None else path!r}") from None


def task_path(value: str) -> str | None:
    """The path inside the task that an `env_map` value names, or None for a literal."""
    if value == TASK_ROOT:
        return ""
    if value.startswith(TASK_ROOT + "."):
        return value.removeprefix(TASK_ROOT + ".")
    return None


def env_map_values(task: Any, env_map: Mapping[str, str]) -> dict[str, str]:
    """Agent Lightning's `env_map`, as its local runner reads it: `input` and `input.<path>`
    are the task and a value in it (a path the task lacks is an error), anything else is the
    value itself; strings go as they are, anything else as JSON."""
    values = {}
    for name, spec in env_map.items():
        path = task_path(spec)
        value = spec if path is None else task_field(task, path, shown=spec)
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        shown = "its literal value" if path is None else f"the task's {spec!r}"
        check_env_string(name, text, shown)
        values[name] = text
    return values


def task_env(task: Any) -> dict[str, str]:
    """DARL_TASK, while the task's JSON fits TASK_ENV_MAX_BYTES (else nothing: the agent
    reads DARL_TASK_FILE)."""
    text = json.dumps(task)
    return {"DARL_TASK": text} if len(text.encode()) <= TASK_ENV_MAX_BYTES else {}


@dataclass(frozen=True)
class AgentContract:
    rollout_id: str
    attempt: int
    mode: str
    token: str
    base_url: str
    # The Anthropic SDK appends /v1/messages itself.
    anthropic_base_url: str
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
        self,
        spec: RolloutSpec,
        attempt: int,
        traceparent: str | None,
        env_map: Mapping[str, str],
        replay_from: Sequence[int] = (),
    ) -> AgentContract:
        """The attempt's contract; with `replay_from` (earlier attempts, newest first) or a
        rollout that starts from a prefix (`spec.prefix`), its token tells the gateway to
        answer the agent's requests from their record where they equal it (rule 10)."""
        replay = None
        if replay_from or spec.prefix is not None:
            prefix = spec.prefix
            replay = ReplayClaim(
                sources=tuple(replay_from),
                normalize=tuple(spec.replay.normalize),
                patterns=tuple(spec.replay.patterns),
                prefix=None
                if prefix is None
                else PrefixClaim(prefix.rollout_id, prefix.attempt, prefix.calls),
            )
        gateway = self.gateway_url.rstrip("/")
        rollout = spec.rollout_id
        # The agent sees the task without the grader's hidden fields (the hidden tests, the
        # gold patch): in DARL_TASK and in what env_map reads.
        task = spec.agent_task()
        token = mint_token(
            self.token_secret,
            TokenClaims(
                rollout_id=rollout,
                attempt=attempt,
                mode=spec.mode.value,
                expires_at=int(time.time() + spec.timeouts.agent_seconds + TOKEN_SLACK_SECONDS),
                traceparent=traceparent,
                replay=replay,
            ),
        )
        base_url = f"{gateway}/rollouts/{rollout}/v1"
        anthropic_base_url = f"{gateway}/rollouts/{rollout}"
        result_url = f"{gateway}/rollouts/{rollout}/result"
        mode = spec.mode.value
        agl_base = f"{gateway}/proxy/rollout/{rollout}/attempt/{attempt}/mode/{mode}/openai/v1"
        agl_events = f"{gateway}/api/rollouts/{rollout}/attempt/{attempt}/events"
        env = {
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": token,
            "ANTHROPIC_BASE_URL": anthropic_base_url,
            "ANTHROPIC_API_KEY": token,
            "DARL_ROLLOUT_ID": rollout,
            "DARL_ATTEMPT": str(attempt),
            "DARL_RUN_ID": spec.run_id,
            "DARL_GROUP_ID": spec.group_id,
            **task_env(task),
            "DARL_MODE": spec.mode.value,
            "DARL_RESULT_URL": result_url,
            "AGL_OPENAI_BASE_URL": agl_base,
            "AGL_EVENT_URL": agl_events,
            "AGL_KEY": token,
            # The OpenAI Agents SDK sends its traces to api.openai.com with OPENAI_API_KEY (it
            # does not follow OPENAI_BASE_URL): that would hand the rollout token to a third
            # party. Traces of a rollout are DARL's (TRACEPARENT).
            "OPENAI_AGENTS_DISABLE_TRACING": "1",
            **env_map_values(task, env_map),
        }
        if traceparent:
            env["TRACEPARENT"] = traceparent
        return AgentContract(
            rollout_id=rollout,
            attempt=attempt,
            mode=spec.mode.value,
            token=token,
            base_url=base_url,
            anthropic_base_url=anthropic_base_url,
            result_url=result_url,
            agl_base_url=agl_base,
            agl_event_url=agl_events,
            traceparent=traceparent,
            env=env,
        )


def inherited_env() -> dict[str, str]:
    """The worker's environment minus DARL's secrets: what a local agent process starts from."""
    return {k: v for k, v in os.environ.items() if k not in SECRET_ENV_VARS}
