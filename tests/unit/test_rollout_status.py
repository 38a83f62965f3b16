import pytest

from darl.workflows.rollout_status import (
    FINAL_STATUSES,
    TRANSITIONS,
    IllegalTransitionError,
    RolloutStatus,
    check_transition,
)


def test_every_status_has_a_row() -> None:
    assert set(TRANSITIONS) == set(RolloutStatus)


def test_final_statuses_only_leave_for_a_retry() -> None:
    for status in FINAL_STATUSES - {RolloutStatus.FAILED_INFRA}:
        assert TRANSITIONS[status] == frozenset()
    # An infra failure waits for its retry, which a cancellation can pre-empt.
    assert TRANSITIONS[RolloutStatus.FAILED_INFRA] == {
        RolloutStatus.LAUNCHING,
        RolloutStatus.CANCELLED,
    }


def test_an_agent_failure_is_never_retried() -> None:
    with pytest.raises(IllegalTransitionError):
        check_transition(RolloutStatus.FAILED_AGENT, RolloutStatus.LAUNCHING)
    with pytest.raises(IllegalTransitionError):
        check_transition(RolloutStatus.TIMED_OUT, RolloutStatus.LAUNCHING)


def test_a_rollout_cannot_skip_running() -> None:
    with pytest.raises(IllegalTransitionError):
        check_transition(RolloutStatus.LAUNCHING, RolloutStatus.SUCCEEDED)
    assert (
        check_transition(RolloutStatus.SCORING, RolloutStatus.SUCCEEDED) is RolloutStatus.SUCCEEDED
    )
