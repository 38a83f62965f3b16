"""What a chaos run is checked for, from outside DARL's accounting (see harness.py): pure
functions over what the run left behind (the store's records, the policy server's log of its
answers, the agents' log of their runs, the steps' inputs from Temporal), so that they are
tested on their own (tests/chaos/test_checks.py) to find what they must find."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from darl.gateway.store import CallRecord
from darl.workflows.training_messages import TrainStepRequest


@dataclass(frozen=True)
class Kill:
    component: str
    when: str
    # Aim at this step of the run or later (leaves the run time to settle between kills).
    from_step: int


@dataclass
class KillOutcome:
    kill: Kill
    at_step: int
    killed_at: float  # time.monotonic()
    back_after: float
    stall: float | None = None


@dataclass
class ChaosReport:
    """What the run showed, counted from outside DARL's accounting."""

    run_id: str
    agent: str
    wall_seconds: float
    kills: list[KillOutcome]
    problems: list[str] = field(default_factory=list)  # run-level checks that did not hold
    rollouts: int = 0
    rollouts_failed: int = 0
    extra_attempts: int = 0
    twin_executions: int = 0
    twin_agent_runs: int = 0
    calls: int = 0
    mislabelled_calls: int = 0
    unproven_calls: int = 0
    stale_trained_calls: int = 0
    answers_not_stored: int = 0
    answers_not_in_result: int = 0
    # Trained rollouts whose final attempt's records in the store are not its calls, once each.
    trajectories_not_stored: int = 0

    @property
    def clean(self) -> bool:
        return not self.problems and not any(
            (
                self.rollouts_failed,
                self.twin_executions,
                self.twin_agent_runs,
                self.mislabelled_calls,
                self.unproven_calls,
                self.stale_trained_calls,
                self.answers_not_stored,
                self.answers_not_in_result,
                self.trajectories_not_stored,
            )
        )


def check_versions(
    report: ChaosReport, records: dict[str, CallRecord], policy_log: list[dict[str, Any]]
) -> None:
    """Each stored call against the last answer the policy server logged for its call id
    (an earlier one may be an answer from old weights the gateway threw away): the same
    version, the same tokens. A call the server never logged is unproven."""
    answered: dict[str, dict[str, Any]] = {}
    for line in policy_log:
        if line.get("call_id"):
            answered[line["call_id"]] = line
    report.calls = len(records)
    for call_id, record in records.items():
        line = answered.get(call_id)
        if line is None:
            report.unproven_calls += 1
        elif (
            line["policy_version"] != record.policy_version
            or line["token_ids"][0] != record.completion_token_ids()
        ):
            report.mislabelled_calls += 1


def check_staleness(
    report: ChaosReport,
    records: dict[str, CallRecord],
    steps: dict[int, TrainStepRequest],
    max_staleness: int,
) -> None:
    """Step s trains with policy s - 1 on the servers: a call served by weights more than
    `max_staleness` versions older (or missing from the store) is a stale trained call."""
    for step, request in steps.items():
        for group in request.groups:
            for member in group.members:
                for call_id in member.call_ids:
                    record = records.get(call_id)
                    if record is None or (step - 1) - record.policy_version > max_staleness:
                        report.stale_trained_calls += 1


def check_agents(
    report: ChaosReport,
    run_id: str,
    records: dict[str, CallRecord],
    steps: dict[int, TrainStepRequest],
    agent_log: list[dict[str, Any]],
) -> None:
    """The agents' own account: one run per (rollout, attempt); every answer a run received
    is in the store; a trained rollout's calls are exactly the answers its one run got."""
    runs: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
    received: dict[str, list[str]] = collections.defaultdict(list)
    for line in agent_log:
        if "rollout_id" in line:
            if line["rollout_id"].startswith(run_id):
                runs[(line["rollout_id"], int(line["attempt"]))].append(line["run"])
        elif "call_id" in line:
            received[line["run"]].append(line["call_id"])
    report.twin_agent_runs = sum(len(r) - 1 for r in runs.values())
    report.extra_attempts = sum(1 for _, attempt in runs if attempt > 1)
    mine = {run for group in runs.values() for run in group}
    report.answers_not_stored = sum(
        1 for run in mine for call_id in received[run] if call_id not in records
    )
    for request in steps.values():
        for group in request.groups:
            for member in group.members:
                agent_runs = runs.get((member.rollout_id, member.attempt), [])
                got = [c for run in agent_runs for c in received[run]]
                if len(agent_runs) != 1 or got != member.call_ids:
                    report.answers_not_in_result += 1


def check_trajectories(
    report: ChaosReport, records: list[CallRecord], steps: dict[int, TrainStepRequest]
) -> None:
    """The store's side: a trained rollout's final attempt holds exactly the calls it trained
    on, each recorded once (no call lost between replicas, none recorded twice, none recorded
    after the attempt closed)."""
    stored: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
    for record in sorted(records, key=lambda r: r.sequence):
        stored[(record.rollout_id, record.attempt)].append(record.call_id)
    for request in steps.values():
        for group in request.groups:
            for member in group.members:
                if stored.get((member.rollout_id, member.attempt), []) != member.call_ids:
                    report.trajectories_not_stored += 1
