"""Where a rollout stands in its workflow: its status, moved only as the status table allows,
its attempt, the calls and reports it took in and what its attempts found; every change shown
on the Web UI and each move published (rollout_visibility). Deterministic: workflow state."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributeUpdate

from darl.workflows import search_attributes as sa
from darl.workflows.contracts import ModelCallEvent, RolloutProgress, RolloutResult, RolloutSpec
from darl.workflows.rollout_inbox import RolloutInbox
from darl.workflows.rollout_result import RolloutFindings, rollout_progress, rollout_result
from darl.workflows.rollout_status import RolloutStatus, check_transition
from darl.workflows.rollout_visibility import RolloutVisibility


class RolloutState:
    """One rollout's standing, owned by its workflow. `inbox` holds the current attempt's
    calls and reports; `findings` what the attempts found, which the result says."""

    def __init__(self, spec: RolloutSpec) -> None:
        self._spec = spec
        self.status = RolloutStatus.PENDING
        self.attempt = 0
        self.inbox = RolloutInbox(starts_from_prefix=spec.prefix is not None)
        self.findings = RolloutFindings()
        self._visibility = RolloutVisibility(spec)

    def publish_start(self) -> None:
        self._visibility.publish_start(self.status)
        self._show()

    def start_attempt(self, attempt: int) -> None:
        self.attempt = attempt
        self.inbox.open(attempt)
        self.findings.start_attempt()
        self.move_to(RolloutStatus.LAUNCHING)

    def take_calls(self, events: list[ModelCallEvent], by_signal: bool = True) -> None:
        self.inbox.take_calls(events, by_signal)
        self._show()

    def move_to(
        self, status: RolloutStatus, also: list[SearchAttributeUpdate[Any]] | None = None
    ) -> None:
        """Move to `status` (IllegalTransitionError if the table forbids it), publishing it
        with `also`."""
        self.status = check_transition(self.status, status)
        self._show()
        self._visibility.publish_status(status, self.attempt, self._serving_version(), also)

    def succeed(self, reward: float) -> None:
        self.findings.reward = reward
        self.move_to(RolloutStatus.SUCCEEDED, [sa.REWARD.value_set(reward)])

    def finish_as(self, status: RolloutStatus, error: str) -> None:
        self.findings.error = error
        self.move_to(status)

    def infra_failure(self, error: str) -> bool:
        """The attempt failed for DARL's reasons: FAILED_INFRA, which a next attempt may
        follow. Returns True: the attempt is to be retried."""
        self.findings.error = error
        self.move_to(RolloutStatus.FAILED_INFRA)
        workflow.logger.warning("rollout attempt %d: %s", self.attempt, error)
        return True

    def show_earlier_result(self, earlier: RolloutResult) -> None:
        """This execution returns the result of one that already ran the rollout."""
        workflow.logger.warning(
            "rollout %s already ran to %s; returning that result",
            earlier.rollout_id,
            earlier.status,
        )
        self._visibility.publish_earlier_result(earlier, self._serving_version())

    def result(self, started: datetime) -> RolloutResult:
        """The rollout's result as it stands, for a run that started at `started`."""
        return rollout_result(
            self._spec,
            status=self.status,
            attempts=self.attempt,
            inbox=self.inbox,
            findings=self.findings,
            duration_seconds=(workflow.now() - started).total_seconds(),
        )

    def progress(self) -> RolloutProgress:
        return rollout_progress(
            self._spec,
            status=self.status,
            attempt=self.attempt,
            inbox=self.inbox,
            findings=self.findings,
        )

    def _serving_version(self) -> int:
        return self.inbox.serving_version(at_start=self._spec.policy_version)

    def _show(self) -> None:
        self._visibility.show(
            status=self.status,
            attempt=self.attempt,
            calls=len(self.inbox.calls),
            replayed=self.inbox.replayed_calls(),
            serving_version=self._serving_version(),
            reward=self.findings.reward,
            error=self.findings.error,
        )
