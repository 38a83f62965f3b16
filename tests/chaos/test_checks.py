"""The chaos checks find what they must find: fed a run's leftovers with one defect planted
each (a call labelled with the wrong version, a call the policy server never answered, a
stale trained call, a twin agent run, an answer the store lacks, a trajectory that is not
what its agent received, a trained attempt whose records in the store differ), each check
counts it, and counts nothing in the clean case."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from darl.gateway.store.record import CallRecord
from darl.workflows.training_messages import TrainGroup, TrainMember, TrainStepRequest
from tests.chaos.checks import (
    ChaosReport,
    check_agents,
    check_replays,
    check_staleness,
    check_trajectories,
    check_versions,
    name_trained_calls,
)

RUN = "chaos-test"


def record(call_id: str, version: int, tokens: list[int], attempt: int = 1) -> CallRecord:
    return CallRecord(
        call_id=call_id,
        rollout_id=f"{RUN}.e0.t0.0",
        attempt=attempt,
        sequence=0,
        endpoint="completions",
        upstream="http://policy",
        policy_version=version,
        created_at=0.0,
        latency_ms=1.0,
        retry_count=0,
        streamed=False,
        request={"prompt": "1="},
        response={"choices": [{"text": "1", "token_ids": tokens, "prompt_token_ids": [3]}]},
        prompt_token_ids=[3],
    )


def report() -> ChaosReport:
    return ChaosReport(RUN, "http", 0.0, [])


def step(number: int, call_ids: list[str], attempt: int = 1) -> TrainStepRequest:
    member = TrainMember(
        rollout_id=f"{RUN}.e0.t0.0", attempt=attempt, call_ids=call_ids, reward=1.0
    )
    return TrainStepRequest(
        run_id=RUN,
        run_dir=None,
        step=number,
        backend={"model_dir": "m"},
        aggregation={},
        groups=[TrainGroup(group_id="g", members=[member])],
    )


def test_versions_are_checked_against_what_the_policy_server_answered() -> None:
    records = {"a": record("a", 2, [5]), "b": record("b", 3, [6]), "c": record("c", 3, [7])}
    log = [
        {"call_id": "a", "policy_version": 0, "token_ids": [[9]]},  # thrown away, then
        {"call_id": "a", "policy_version": 2, "token_ids": [[5]]},  # the recorded answer
        {"call_id": "b", "policy_version": 2, "token_ids": [[6]]},  # labelled 3: wrong
        {"call_id": None, "policy_version": 3, "token_ids": [[1]]},
    ]
    found = report()
    check_versions(found, records, log)
    assert (found.calls, found.mislabelled_calls, found.unproven_calls) == (3, 1, 1)
    clean = report()
    check_versions(clean, {"a": records["a"]}, log)
    assert (clean.mislabelled_calls, clean.unproven_calls) == (0, 0)


def test_a_trained_call_older_than_max_staleness_is_counted() -> None:
    records = {"old": record("old", 1, [5]), "ok": record("ok", 3, [6])}
    found = report()
    # Step 4 trains with policy 3 serving: version 1 is 2 behind, version 3 is current.
    check_staleness(found, records, {4: step(4, ["old", "ok"])}, max_staleness=1)
    assert found.stale_trained_calls == 1
    lenient = report()
    check_staleness(lenient, records, {4: step(4, ["old", "ok"])}, max_staleness=2)
    assert lenient.stale_trained_calls == 0


def agent_log(*runs: tuple[str, int, list[str]]) -> list[dict]:
    lines: list[dict] = []
    for run, attempt, call_ids in runs:
        lines.append({"run": run, "rollout_id": f"{RUN}.e0.t0.0", "attempt": attempt})
        lines += [{"run": run, "call_id": c} for c in call_ids]
    return lines


def test_the_agents_own_account_catches_twins_and_lost_answers() -> None:
    records = {"a": record("a", 0, [5]), "b": record("b", 0, [6], attempt=2)}
    steps = {1: step(1, ["b"], attempt=2)}
    clean = report()
    check_agents(clean, RUN, records, steps, agent_log(("r1", 1, ["a"]), ("r2", 2, ["b"])))
    assert (clean.twin_agent_runs, clean.answers_not_stored, clean.answers_not_in_result) == (
        0,
        0,
        0,
    )
    assert clean.extra_attempts == 1

    twin = report()  # attempt 2 ran twice: its trajectory is not one run's
    check_agents(
        twin, RUN, records, steps, agent_log(("r1", 1, ["a"]), ("r2", 2, ["b"]), ("r3", 2, []))
    )
    assert twin.twin_agent_runs == 1 and twin.answers_not_in_result == 1

    lost = report()  # an answer the agent got that the store does not have
    check_agents(lost, RUN, records, steps, agent_log(("r1", 1, ["a", "x"]), ("r2", 2, ["b"])))
    assert lost.answers_not_stored == 1

    short = report()  # the trajectory trained is not what the agent received
    check_agents(short, RUN, records, steps, agent_log(("r2", 2, ["b", "a"])))
    assert short.answers_not_in_result == 1


def test_a_trained_attempt_must_be_its_records_in_the_store_once_each() -> None:
    a, b = record("a", 0, [5], attempt=2), replace(record("b", 0, [6], attempt=2), sequence=1)
    steps = {1: step(1, ["a", "b"], attempt=2)}
    clean = report()
    check_trajectories(clean, [b, a, record("old", 0, [7], attempt=1)], steps)
    assert clean.trajectories_not_stored == 0
    for defect in ([a], [a, b, b], [a, b, replace(b, call_id="late", sequence=2)]):
        found = report()  # a call lost, recorded twice, recorded after the close
        check_trajectories(found, defect, steps)
        assert found.trajectories_not_stored == 1, defect


def test_a_member_named_by_count_and_digest_is_checked_as_one_named_by_its_calls() -> None:
    """Train steps name a member's calls by count and digest: the checks read them from the
    store, and a store that holds other calls (or too few) fails every check that reads them."""
    a, b = record("a", 0, [5], attempt=2), replace(record("b", 0, [6], attempt=2), sequence=1)
    named = step(1, ["a", "b"], attempt=2)
    member = named.groups[0].members[0]
    counted = TrainMember(
        rollout_id=member.rollout_id,
        attempt=2,
        calls=2,
        digest=hashlib.sha256(b"a\nb").hexdigest(),
        reward=1.0,
    )
    steps = {1: named.model_copy(update={"groups": [TrainGroup(group_id="g", members=[counted])]})}
    clean = report()
    check_trajectories(clean, [a, b], name_trained_calls(steps, [a, b]))
    assert clean.trajectories_not_stored == 0
    for defect in ([a], [replace(b, sequence=0), replace(a, sequence=1)]):
        found = report()  # a call lost; the calls in another order than committed
        check_trajectories(found, defect, name_trained_calls(steps, defect))
        assert found.trajectories_not_stored == 1, defect
    late = [a, b, replace(b, call_id="late", sequence=2)]
    found = report()  # recorded after the close: the member trains the first two only
    check_trajectories(found, late, name_trained_calls(steps, late))
    assert found.trajectories_not_stored == 1


def turn(call_id: str, prompt: list[int], answer: list[int], **fields: object) -> CallRecord:
    """A call of a token-in, token-out agent: `prompt` then `answer`."""
    base = record(call_id, 0, answer, attempt=int(str(fields.pop("attempt", 1))))
    response = {"choices": [{"text": "", "token_ids": answer, "prompt_token_ids": prompt}]}
    return replace(base, prompt_token_ids=prompt, response=response, **fields)  # type: ignore[arg-type]


def replay_run() -> tuple[dict[str, CallRecord], list[CallRecord]]:
    """Attempt 1 made two calls and was lost; attempt 2 replayed them and made a third."""
    one = [turn("a", [1], [2]), turn("b", [1, 2, 9], [3])]
    two = [
        turn("a2", [1], [2], attempt=2, replayed_from="a"),
        turn("b2", [1, 2, 9], [3], attempt=2, replayed_from="b"),
        turn("c2", [1, 2, 9, 3, 9], [4], attempt=2),
    ]
    return {r.call_id: r for r in [*one, *two]}, two


def generated_log(*call_ids: str) -> list[dict]:
    return [{"call_id": c, "policy_version": 0, "token_ids": [[0]]} for c in call_ids]


def test_a_clean_replay_counts_nothing() -> None:
    records, two = replay_run()
    r = report()
    check_replays(
        r, records, {1: step(1, [c.call_id for c in two], attempt=2)}, generated_log("a", "b", "c2")
    )
    assert (r.replayed_calls, r.regenerated_calls, r.inconsistent_trajectories) == (2, 0, 0)


def test_a_call_generated_again_is_counted() -> None:
    records, _ = replay_run()
    # The third call went live with the prompt of a recorded one.
    records["b3"] = turn("b3", [1, 2, 9], [5], attempt=3)
    r = report()
    check_replays(r, records, {}, generated_log("a", "b", "c2", "a2"))
    assert r.regenerated_calls == 2  # a replayed call the policy was asked for, and b3


def test_a_trajectory_that_is_not_one_episode_is_counted() -> None:
    records, two = replay_run()
    unlike = replace(
        two[1], response={"choices": [{"token_ids": [7], "prompt_token_ids": [1, 2, 9]}]}
    )
    records[unlike.call_id] = unlike
    out_of_order = [two[0], two[2], two[1]]
    r = report()
    steps = {
        1: step(1, [c.call_id for c in two], attempt=2),
        2: step(2, [c.call_id for c in out_of_order], attempt=2),
    }
    check_replays(r, records, steps, generated_log("a", "b", "c2"))
    assert r.inconsistent_trajectories == 2


def test_a_replayed_call_is_held_to_the_answer_it_reproduces() -> None:
    records, _ = replay_run()
    r = report()
    check_versions(
        r,
        records,
        [
            {"call_id": c, "policy_version": 0, "token_ids": [records[c].completion_token_ids()]}
            for c in ("a", "b", "c2")
        ],
    )
    assert (r.unproven_calls, r.mislabelled_calls) == (0, 0)
