"""What a chaos run is checked for, from outside DARL's accounting (see harness.py): pure
functions over what the run left behind (the store's records, the policy server's log of its
answers, the agents' log of their runs, the steps' inputs from Temporal), so that they are
tested on their own (tests/chaos/test_checks.py) to find what they must find."""

from __future__ import annotations

import collections
import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any

from darl.gateway.store.record import CallRecord
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
    # Replay (rule 10): agents the run's killer SIGKILLed at a random call, calls answered
    # from an earlier attempt's record, calls the policy generated again (a live call with
    # the prompt of a recorded call of its rollout, or a replayed call it was asked for), and
    # trained trajectories that are not one episode (a replayed call unlike its record, a
    # live call before a replayed one, a call whose prompt does not extend the one before).
    agents_killed: int = 0
    branches_killed: int = 0
    replayed_calls: int = 0
    regenerated_calls: int = 0
    inconsistent_trajectories: int = 0

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
                self.regenerated_calls,
                self.inconsistent_trajectories,
            )
        )


def check_versions(
    report: ChaosReport, records: dict[str, CallRecord], policy_log: list[dict[str, Any]]
) -> None:
    """Each stored call against the last answer the policy server logged for its call id
    (an earlier one may be an answer from old weights the gateway threw away): the same
    version, the same tokens. A call the server never logged is unproven. A replayed call is
    held to the answer of the call it reproduces, first generated (rule 10)."""
    answered: dict[str, dict[str, Any]] = {}
    for line in policy_log:
        if line.get("call_id"):
            answered[line["call_id"]] = line
    report.calls = len(records)
    for record in records.values():
        line = answered.get(_generated_as(record, records))
        if line is None:
            report.unproven_calls += 1
        elif (
            line["policy_version"] != record.policy_version
            or line["token_ids"][0] != record.completion_token_ids()
        ):
            report.mislabelled_calls += 1


def _generated_as(record: CallRecord, records: dict[str, CallRecord]) -> str:
    """The call id under which the policy generated this record's answer: its own, or that
    of the first call of the chain of replays it ends."""
    seen: set[str] = set()
    while record.replayed_from is not None and record.call_id not in seen:
        seen.add(record.call_id)
        source = records.get(record.replayed_from)
        if source is None:
            return record.replayed_from
        record = source
    return record.call_id


# What a member's calls are named when the store does not hold what its rollout committed.
NOT_AS_COMMITTED = "(not as its rollout committed)"


def name_trained_calls(
    steps: dict[int, TrainStepRequest], records: list[CallRecord]
) -> dict[int, TrainStepRequest]:
    """The steps with each member's call ids, as the trainer read them: the first `calls` of
    its attempt in the store, if their digest is the one its rollout committed (else a name
    no record has, which every check below counts)."""
    stored: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
    for record in sorted(records, key=lambda r: r.sequence):
        if not record.unreceived:  # no part of its attempt's trajectory
            stored[(record.rollout_id, record.attempt)].append(record.call_id)
    named = {}
    for number, request in steps.items():
        groups = []
        for group in request.groups:
            members = []
            for member in group.members:
                if member.call_ids is None:
                    ids = stored.get((member.rollout_id, member.attempt), [])[: member.calls]
                    digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()
                    if len(ids) < member.calls or digest != member.digest:
                        ids = [NOT_AS_COMMITTED]
                    member = member.model_copy(update={"call_ids": ids})
                members.append(member)
            groups.append(group.model_copy(update={"members": members}))
        named[number] = request.model_copy(update={"groups": groups})
    return named


def check_replays(
    report: ChaosReport,
    records: dict[str, CallRecord],
    steps: dict[int, TrainStepRequest],
    policy_log: list[dict[str, Any]],
) -> None:
    """Rule 10, from the store and the policy server's log: no call generated twice, and
    every trained trajectory one consistent episode (for agents whose calls extend each
    other: the replay runs' token-in, token-out agent)."""
    generated = {line["call_id"] for line in policy_log if line.get("call_id")}
    prompts: dict[str, collections.Counter[tuple[int, ...]]] = collections.defaultdict(
        collections.Counter
    )
    for record in records.values():
        if record.replayed_from is None:
            prompts[record.rollout_id][tuple(record.prompt_token_ids)] += 1
            continue
        report.replayed_calls += 1
        if record.call_id in generated:
            report.regenerated_calls += 1
    report.regenerated_calls += sum(
        n - 1 for counts in prompts.values() for n in counts.values() if n > 1
    )
    for request in steps.values():
        for group in request.groups:
            for member in group.members:
                calls = [records.get(call_id) for call_id in member.call_ids or []]
                if not _one_episode(calls, records):
                    report.inconsistent_trajectories += 1


def _one_episode(calls: list[CallRecord | None], records: dict[str, CallRecord]) -> bool:
    if any(call is None for call in calls):
        return False
    episode = [call for call in calls if call is not None]
    replayed = [call.replayed_from is not None for call in episode]
    if replayed != sorted(replayed, reverse=True):  # a replayed call after a live one
        return False
    for call in episode:
        source = records.get(call.replayed_from or "")
        if call.replayed_from is not None and (
            source is None
            or source.response != call.response
            or source.prompt_token_ids != call.prompt_token_ids
        ):
            return False
    for before, after in itertools.pairwise(episode):
        context = before.prompt_token_ids + before.completion_token_ids()
        if after.prompt_token_ids[: len(context)] != context:
            return False
    return True


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
                for call_id in member.call_ids or []:
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
        if not record.unreceived:  # no part of its attempt's trajectory
            stored[(record.rollout_id, record.attempt)].append(record.call_id)
    for request in steps.values():
        for group in request.groups:
            for member in group.members:
                if stored.get((member.rollout_id, member.attempt), []) != member.call_ids:
                    report.trajectories_not_stored += 1
