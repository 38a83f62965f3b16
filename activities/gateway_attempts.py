"""A rollout's attempts at the gateway, over its admin API: opened before the agent starts,
closed once the agent has ended, when the gateway refuses the attempt's calls, hands over its
call events (rule 1) and says what DARL's infrastructure did to the attempt (rule 7)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import aiohttp
from temporalio.exceptions import ApplicationError

from darl.workflows.contracts import ModelCallEvent, PrefixSpec, ReplayOutcome

log = logging.getLogger(__name__)

# How long await_agent keeps trying to close an attempt at the gateway before it fails (and
# Temporal retries it: the agent has exited, so the retry only closes again).
CLOSE_GIVE_UP_SECONDS = 30.0
CLOSE_TIMEOUT = aiohttp.ClientTimeout(total=30.0)
OPEN_TIMEOUT = aiohttp.ClientTimeout(total=10.0)


@dataclass(frozen=True)
class AttemptCloseReport:
    """What the gateway answers when it closes an attempt."""

    # What DARL's infrastructure did to it (rule 7): its 5xx answers, the gateway's outages.
    incidents: list[str]
    # Its model calls that got no answer (status, protocol, error), as the gateway recorded them.
    failed_calls: list[str]
    # Every call event of the attempt, read from the store, when the close was asked to return
    # them and there were no more than asked; None when the gateway signalled them instead.
    events: list[ModelCallEvent] | None = None
    # What the attempt made of the record it replayed (when the close named one).
    replay: ReplayOutcome | None = None


class GatewayAttempts:
    """Opens an attempt at the gateway before its agent starts, and closes it once its agent
    has ended. The gateway then refuses the attempt's calls and hands over its call events: in
    its answer, or signalled to the workflow before it answers; await_agent returns only after
    that, so the workflow scores a complete trajectory."""

    def __init__(self, admin_url: str, admin_key: str, session: aiohttp.ClientSession) -> None:
        """`session` is borrowed (not closed here)."""
        self._admin_url = admin_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {admin_key}"}
        self._session = session

    async def close_attempt(
        self,
        rollout_id: str,
        attempt: int,
        give_up_after: float,
        started_at: float | None = None,
        return_events_up_to: int = 0,
        replay_from: list[int] | None = None,
        prefix: PrefixSpec | None = None,
    ) -> AttemptCloseReport:
        """Close the attempt; returns what DARL's infrastructure did to it while its agent ran
        (since `started_at`, epoch seconds): the gateway's 5xx answers and outages; its model
        calls that got no answer; and, with `return_events_up_to` > 0, its call events (at
        most that many, else the gateway signals them); with `replay_from` (earlier attempts,
        newest first) or the `prefix` its rollout starts from, what the attempt made of their
        record (rule 10). Idempotent: a retried close returns the same events.

        Retries while the gateway is unreachable or answers 5xx; raises ApplicationError
        (retryable: the activity tries again) once `give_up_after` seconds have passed, and a
        non-retryable one if the gateway refuses (a wrong admin key)."""
        url = f"{self._admin_url}/admin/rollouts/{rollout_id}/attempts/{attempt}/close"
        body: dict[str, object] = {} if started_at is None else {"started_at": started_at}
        if return_events_up_to > 0:
            body["return_events_up_to"] = return_events_up_to
        if replay_from:
            body["replay_from"] = replay_from
        if prefix is not None:
            body["prefix"] = prefix.model_dump()
        deadline = time.monotonic() + give_up_after
        delay = 0.5
        while True:
            try:
                async with self._session.post(
                    url, json=body, headers=self._headers, timeout=CLOSE_TIMEOUT
                ) as response:
                    status, content = response.status, await response.read()
            except (aiohttp.ClientError, TimeoutError) as err:
                problem = repr(err)
            else:
                if status < 400:
                    # A torn answer raises here: the activity is retried and closes again.
                    closed = json.loads(content)
                    events = closed.get("events")
                    replay = closed.get("replay")
                    return AttemptCloseReport(
                        list(closed.get("infra_incidents") or []),
                        list(closed.get("failed_calls") or []),
                        None
                        if events is None
                        else [ModelCallEvent.model_validate(e) for e in events],
                        None if replay is None else ReplayOutcome.model_validate(replay),
                    )
                optional = [key for key in ("return_events_up_to", "replay_from") if key in body]
                if status in (400, 422) and optional:
                    # A gateway that does not know these fields refuses them: closed without
                    # them, it signals the events, and says nothing of a replay.
                    for key in optional:
                        body.pop(key)
                    continue
                text = content[:300].decode(errors="replace")
                if status < 500:
                    raise ApplicationError(
                        f"gateway refused to close {rollout_id}/{attempt}: {status} {text}",
                        type="GatewayRefused",
                        non_retryable=True,
                    )
                problem = f"{status} {text}"
            if time.monotonic() + delay > deadline:
                raise ApplicationError(
                    f"could not close {rollout_id}/{attempt} at the gateway: {problem}",
                    type="GatewayUnavailable",
                )
            log.warning("closing %s/%d at the gateway: %s; retrying", rollout_id, attempt, problem)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def open_attempt(self, rollout_id: str, attempt: int) -> bool:
        """Tell the gateway the attempt's workflow runs and its agent is about to start (its
        calls then ask Temporal nothing); returns whether the gateway had closed the attempt
        already (True too if it cannot tell: a gateway down, or one older than the route)."""
        url = f"{self._admin_url}/admin/rollouts/{rollout_id}/attempts/{attempt}/open"
        try:
            async with self._session.post(
                url, headers=self._headers, timeout=OPEN_TIMEOUT
            ) as response:
                if response.status != 200:
                    return True
                content = await response.read()
        except (aiohttp.ClientError, TimeoutError):
            return True
        return bool(json.loads(content).get("closed"))
