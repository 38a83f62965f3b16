"""The trajectory store: where the full record of every model call lives (request, response,
token ids, logprobs), so that none of it has to go through workflow history.

`TrajectoryStore` is the interface; `DirectoryTrajectoryStore` keeps one append-only JSONL file
per rollout attempt, `S3TrajectoryStore` (`gateway/s3_store.py`) one object per call. Both store
prompts as deltas (`gateway/store_codec.py`), and both let several gateway replicas append to
one attempt: sequences stay unique and gap-free. `open_store` (`gateway/store_url.py`) picks one
from a URL.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from darl.gateway.errors import GatewayError
from darl.gateway.store.record import CallRecord, FailedCall

log = logging.getLogger(__name__)


class StoreUnavailableError(GatewayError, RuntimeError):
    """The store cannot be used at all (a bucket that does not exist, no credentials)."""


class AppendRefusedError(GatewayError):
    """The store refused a call for what the attempt already holds: decided under the
    attempt's lock (directory) or by the conditional write of the call's sequence (S3), so
    every replica sharing the store sees the same decision."""


class AttemptClosedError(AppendRefusedError):
    """The attempt was closed (`mark_closed`) before the call could be written."""


class CallBudgetSpentError(AppendRefusedError):
    """The attempt holds MAX_CALLS_PER_ATTEMPT calls: the sequence the call would take is past
    its budget."""


class AlreadyReplayedError(AppendRefusedError):
    """A replayed call (rule 10) whose recorded call a call of the attempt reproduces already:
    a recorded call is served at most once. `reproduced`: every recorded call the attempt's
    calls reproduce, as the store saw them when it refused."""

    def __init__(self, message: str, reproduced: frozenset[str]) -> None:
        super().__init__(message)
        self.reproduced = reproduced


class ReplayOverError(AppendRefusedError):
    """A replayed call (rule 10) of an attempt that holds a live call: once a live answer may
    have reached the agent, nothing more is served from the record."""


class TrajectoryStore(Protocol):
    async def append(self, record: CallRecord) -> CallRecord:
        """Durably add a call; the store assigns `sequence`. Returns the record as stored.
        Only then may the gateway signal the call and answer the agent. Raises
        `AttemptClosedError` once `mark_closed` ran for the attempt, `CallBudgetSpentError`
        when the attempt holds MAX_CALLS_PER_ATTEMPT calls already; for a record that
        reproduces a recorded call (`replayed_from`), `AlreadyReplayedError` when the
        attempt holds a call that reproduces it, `ReplayOverError` when it holds a live call
        (nothing is written then)."""

    async def read(
        self, rollout_id: str, attempt: int | None = None, call_ids: list[str] | None = None
    ) -> list[CallRecord]:
        """The calls of a rollout (one attempt, or all), in order, whole; with `call_ids`, only
        those (the committed calls a RolloutResult names)."""

    def ref(self, record: CallRecord) -> str:
        """A string that locates the record (goes into the ModelCallEvent)."""

    async def delivered(self, rollout_id: str, attempt: int) -> int:
        """The highest sequence whose event reached the workflow (-1: none yet)."""

    async def mark_delivered(self, rollout_id: str, attempt: int, sequence: int) -> None:
        """Remember that events up to `sequence` reached the workflow. The mark never moves
        back: a replica that marks an older sequence after another marked a newer one keeps
        the newer."""

    def read_sync(
        self, rollout_id: str, attempt: int | None = None, call_ids: list[str] | None = None
    ) -> list[CallRecord]:
        """`read` for a caller on a thread of its own (never on an event loop's thread)."""

    async def attempts(self, rollout_id: str) -> list[int]:
        """The attempts of the rollout that have calls in the store, in order."""

    def where(self, rollout_id: str) -> str:
        """Where the rollout's records live, for a message to a person."""

    async def check(self) -> None:
        """Raise `StoreUnavailableError` when the store cannot be used (a bucket that does not
        exist, no credentials): called once at start, so a bad store is not a 500 per call."""

    async def aclose(self) -> None:
        """Let go of connections (the store stays usable; it reconnects when used)."""

    def forget(self, rollout_id: str, attempt: int) -> None:
        """The attempt has ended: drop what is cached for appending to it."""

    async def record_incident(self, rollout_id: str, attempt: int, what: str) -> None:
        """Durably note that DARL's infrastructure failed the attempt's agent (a 5xx the
        gateway answered it), for whichever gateway closes the attempt."""

    async def incidents(self, rollout_id: str, attempt: int) -> list[str]:
        """The attempt's recorded incidents, oldest first."""

    async def record_event(
        self, rollout_id: str, attempt: int, event: dict[str, Any]
    ) -> dict[str, Any]:
        """Durably keep an event the attempt's agent sent (Agent Lightning's events other than
        rewards); returns it as stored (with its timestamp)."""

    async def events(self, rollout_id: str, attempt: int) -> list[dict[str, Any]]:
        """The attempt's recorded events, oldest first."""

    async def record_failed_call(self, failure: FailedCall) -> None:
        """Durably note a model call of the attempt that got no answer."""

    async def failed_calls(self, rollout_id: str, attempt: int) -> list[FailedCall]:
        """The attempt's failed calls, oldest first."""

    async def mark_closed(self, rollout_id: str, attempt: int) -> None:
        """Remember that the attempt's agent ended: its calls are refused from now on, also
        by a gateway that starts later. Exclusive with `append`: once this returns, every
        append to the attempt either is in what `read` returns or raises
        `AttemptClosedError`. Idempotent."""

    async def is_closed(self, rollout_id: str, attempt: int) -> bool:
        """Whether `mark_closed` was called for the attempt."""
