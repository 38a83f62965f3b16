"""What a rollout shows outside its history while it runs: its status, reward and last serving
version as search attributes, upserted only when they say something a reader needs (each upsert
is a history event and a visibility write), and the details the Web UI shows on its page."""

from __future__ import annotations

from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributeUpdate

from darl.workflows import search_attributes as sa
from darl.workflows.contracts import ONE_ACTIVITY_REVISION, RolloutResult, RolloutSpec
from darl.workflows.rollout_status import RolloutStatus

# Statuses a rollout passes through in a moment; not published as search attributes.
BRIEF_STATUSES = frozenset({RolloutStatus.LAUNCHING, RolloutStatus.SCORING})


class RolloutVisibility:
    """Publishes one rollout's search attributes and current details. The server's work per
    rollout is what bounds rollouts per second, so it upserts as little as it can."""

    def __init__(self, spec: RolloutSpec) -> None:
        self._spec = spec
        # Once: the task can be large, and the details are rewritten at every change.
        self._summary = sa.rollout_summary(spec)
        self._published_version = spec.policy_version
        # With one activity an attempt's RUNNING is not published on a first attempt.
        self._one_activity = spec.revision >= ONE_ACTIVITY_REVISION

    def publish_start(self, status: RolloutStatus) -> None:
        """The attributes a rollout starts with. A starter that set them (the trainer does)
        saves the server an upsert per rollout."""
        initial = sa.rollout_attributes(self._spec, status.value)
        given = workflow.info().typed_search_attributes
        if any(given.get(pair.key) != pair.value for pair in initial):
            workflow.upsert_search_attributes([p.key.value_set(p.value) for p in initial])

    def publish_status(
        self,
        status: RolloutStatus,
        attempt: int,
        serving_version: int,
        also: list[SearchAttributeUpdate[Any]] | None = None,
    ) -> None:
        """The status the rollout moved to, with `also` and a changed serving version.
        Brief statuses are left to the `status` query, and so is RUNNING on a first attempt
        with one activity (a retry's replaces failed_infra)."""
        if status in BRIEF_STATUSES or (
            self._one_activity and status == RolloutStatus.RUNNING and attempt == 1
        ):
            return
        updates: list[SearchAttributeUpdate[Any]] = [
            sa.STATUS.value_set(status.value),
            *(also or []),
        ]
        # The last serving version rides on the status upserts the rollout makes anyway (an
        # attempt's end, the final status) rather than costing an upsert per call. Replay
        # compares an upsert's command type, not its attributes, so whether a history's
        # upserts carry it never matters to a replay.
        if serving_version != self._published_version:
            updates.append(sa.POLICY_VERSION.value_set(serving_version))
            self._published_version = serving_version
        workflow.upsert_search_attributes(updates)

    def publish_earlier_result(self, earlier: RolloutResult, serving_version: int) -> None:
        """The result of the execution that already ran this rollout, which this one returns."""
        also = [] if earlier.reward is None else [sa.REWARD.value_set(earlier.reward)]
        workflow.upsert_search_attributes([sa.STATUS.value_set(earlier.status.value), *also])
        self.show(
            status=earlier.status,
            attempt=earlier.attempts,
            calls=earlier.calls,
            replayed=earlier.replayed_calls,
            serving_version=serving_version,
            reward=earlier.reward,
            error=earlier.error,
        )

    def show(
        self,
        *,
        status: RolloutStatus,
        attempt: int,
        calls: int,
        replayed: int,
        serving_version: int,
        reward: float | None,
        error: str | None,
    ) -> None:
        """What the Web UI's workflow page shows as current details. Workflow memory only (the
        `__temporal_workflow_metadata` query reads it), so keeping it current costs nothing."""
        workflow.set_current_details(
            sa.rollout_details(
                self._summary,
                max_attempts=self._spec.max_attempts,
                status=status.value,
                attempt=attempt,
                calls=calls,
                replayed=replayed,
                policy_version=serving_version,
                reward=reward,
                error=error,
            )
        )
