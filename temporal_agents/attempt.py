"""The DARL attempt an agent workflow runs for, as the activities of that workflow see it: what
travels in the memo and headers (`AgentAttempt`), the activity's own context (set by
DarlPlugin's activity interceptor) and the `Idempotency-Key` of each of its model requests."""

from __future__ import annotations

import contextvars
import hashlib
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError


class NoAgentAttemptError(ApplicationError):
    """A model request was made where no DARL attempt is known: outside an activity, on a
    worker without DarlPlugin, or in a workflow DARL did not start. Not retryable: a retry of
    the activity would not find one either."""

    def __init__(self) -> None:
        super().__init__(
            "no DARL attempt in this context: model requests to DARL's gateway must be made in "
            "an activity of an agent workflow that DARL started (its memo carries the attempt), "
            "on a worker whose client or worker has darl.temporal_agents.DarlPlugin()",
            type="NoAgentAttempt",
            non_retryable=True,
        )


@dataclass(frozen=True)
class AgentAttempt:
    """One attempt of a DARL rollout: where its model requests go and the token that names it
    there (DARL's RolloutWorkflow writes it into the agent workflow's memo)."""

    base_url: str
    token: str
    rollout_id: str
    attempt: int

    @classmethod
    def from_value(cls, value: object) -> AgentAttempt:
        """The attempt from its memo or header value (a JSON object); ValueError when the value
        is not one, naming what is wrong."""
        if not isinstance(value, Mapping):
            raise ValueError(f"a DARL attempt is a JSON object, got {type(value).__name__}")
        fields: dict[str, type] = {"base_url": str, "token": str, "rollout_id": str, "attempt": int}
        wrong = sorted(
            name
            for name, kind in fields.items()
            if not isinstance(value.get(name), kind) or isinstance(value.get(name), bool)
        )
        if wrong:
            raise ValueError(
                f"a DARL attempt needs {', '.join(f'{n} ({fields[n].__name__})' for n in wrong)}"
            )
        return cls(**{name: value[name] for name in fields})

    def to_value(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ActivityAttempt:
    """The attempt of one activity execution and the model requests it made so far. A retry of
    the activity is a new execution: its count starts again, so its n-th request carries the
    same key as the n-th request of the try before. The requests of one execution made at once
    are numbered in the order they are sent."""

    attempt: AgentAttempt
    workflow_run_id: str
    activity_id: str
    # Temporal's try of the activity (1: its first); a request of the first try that is no
    # model client's retry has a key never sent before.
    activity_try: int = 1
    # A local activity (run in the workflow task): its tries are not Temporal's to count.
    local: bool = False
    requests: int = 0
    # A request's identity -> the key it was given, for the model client's retries of it.
    _given: dict[str, str] = field(default_factory=dict)

    def idempotency_key(self, identity: str | None, *, retry: bool) -> tuple[str, bool]:
        """The key of a request, and whether it may have been sent before: the key its first
        try was given when it is the model client's retry of a request of this identity, else
        the next n; sent before, maybe, on any try but Temporal's first, and on any try of a
        local activity (one its worker lost restarts at try 1 when the workflow task is
        retried)."""
        if retry and identity is not None and identity in self._given:
            return self._given[identity], True
        self.requests += 1
        key = f"{self.execution}/{self.requests}"
        if identity is not None:
            self._given[identity] = key
        return key, self.activity_try > 1 or self.local

    @property
    def execution(self) -> str:
        """The activity's run and id as a key's stem: as they are when they make a valid key
        (visible ASCII, short: Temporal's own ids are), else their digest."""
        stem = f"{self.workflow_run_id}/{self.activity_id}"
        if _KEY_STEM.fullmatch(stem):
            return stem
        return "sha256:" + hashlib.sha256(stem.encode()).hexdigest()[:40]


# What a key's stem may be as it is: the gateway takes keys of 1 to 200 visible ASCII
# characters, and the stem leaves room for the request's number.
_KEY_STEM = re.compile(r"[!-~]{1,180}")


_activity_attempt: contextvars.ContextVar[ActivityAttempt | None] = contextvars.ContextVar(
    "darl_activity_attempt", default=None
)


def enter_activity(attempt: AgentAttempt) -> contextvars.Token[ActivityAttempt | None]:
    """Called by DarlPlugin's activity interceptor as an activity execution starts."""
    info = activity.info()
    return _activity_attempt.set(
        ActivityAttempt(
            attempt,
            workflow_run_id=info.workflow_run_id or "",
            activity_id=info.activity_id,
            activity_try=info.attempt,
            local=info.is_local,
        )
    )


def leave_activity(token: contextvars.Token[ActivityAttempt | None]) -> None:
    _activity_attempt.reset(token)


def current_attempt() -> AgentAttempt | None:
    """The DARL attempt of the running activity; None outside an activity of an agent workflow
    DARL started (or on a worker without DarlPlugin)."""
    running = _activity_attempt.get()
    return running.attempt if running is not None else None


def current_activity_attempt() -> ActivityAttempt:
    """The running activity's attempt and request count; NoAgentAttemptError when none."""
    running = _activity_attempt.get()
    if running is None:
        raise NoAgentAttemptError()
    return running
