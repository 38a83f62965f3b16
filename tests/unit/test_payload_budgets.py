"""Every payload DARL hands Temporal, at its worst case, within its budget.

Temporal refuses a payload over 2 MB (and a workflow task, or a signal, carrying one fails or is
retried without end). Each case below builds the largest value the code lets through (every
field at the bound its contract sets, ids and paths at their longest, counts at their caps) and
serialises it through DARL's own data converter. `bench/payload_budgets.py` prints the same
cases as the table in docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from darl.activities.rollout_activities import RETURNED_EVENTS_CAP
from darl.activities.runners.base import LOG_TAIL_BYTES
from darl.activities.sandbox.changes import DIFF_CAP_BYTES
from darl.activities.sandbox.outcomes import FAILED_SHOWN
from darl.activities.sandbox.preparation import PATHS_SHOWN
from darl.activities.trainer_reports import MAX_BATCH_BYTES, MAX_BATCH_RESULTS
from darl.deploy.temporal_connection import DATA_CONVERTER
from darl.gateway.calls.delivery import SIGNAL_BATCH
from darl.workflows.contracts import (
    CLOSE_LISTED,
    MAX_CALLS_PER_ATTEMPT,
    OUTCOME_ERROR_CHARS,
    REPORT_MAX_BYTES,
    SPEC_MAX_BYTES,
    TASK_MAX_BYTES,
    AgentExit,
    AgentReport,
    AgentScore,
    GradeReport,
    HttpAgentSpec,
    LaunchRequest,
    ModelCallEvent,
    PrefixSpec,
    ReplayOutcome,
    RewardRequest,
    RolloutMode,
    RolloutOutcome,
    RolloutResult,
    RolloutSpec,
    TrajectorySummary,
)
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.training_activity_options import BATCH
from darl.workflows.training_config import (
    CONFIG_MAX_BYTES,
    PATH_MAX_CHARS,
    RUN_ID_MAX_CHARS,
    BackendSpec,
    DatasetSpec,
    GroupsSpec,
    RolloutSettings,
    TrainingConfig,
    TrainingMode,
    ValidationSpec,
    WeightSyncSettings,
)
from darl.workflows.training_messages import (
    RolloutLookup,
    RolloutStart,
    StartRolloutsRequest,
    TaskBatch,
    TrainGroup,
    TrainMember,
    TrainStepRequest,
)
from darl.workflows.training_run import RECENT_STEPS
from darl.workflows.training_state import (
    MAX_HELD,
    MAX_VALIDATION_TASKS,
    Counters,
    GroupState,
    Member,
    StepRecord,
    TaskRow,
    TrainingState,
    ValTally,
)

# Temporal's default limit on one payload (the server's `limit.blobSize.error`).
PAYLOAD_LIMIT = 2 * 1024 * 1024

RUN_ID = "r" * RUN_ID_MAX_CHARS
PATH = "/" + "d" * (PATH_MAX_CHARS - 1)
DIGEST = "f" * 64
BIG = 10**9
# verl reports about 60 metrics a step; the reference trainer fewer.
TRAINER_METRICS = 128


@dataclass(frozen=True)
class Case:
    name: str
    budget: int
    build: Callable[[], Any]


def payload_bytes(value: Any) -> int:
    """Its size as Temporal carries it: the converter's payload, metadata included."""
    [payload] = DATA_CONVERTER.payload_converter.to_payloads([value])
    return payload.ByteSize()


def group_id(position: int) -> str:
    return f"{RUN_ID}.e{BIG}.t{BIG + position}"


def outcome(rollout_id: str, error: bool = True) -> RolloutOutcome:
    return RolloutOutcome(
        run_id=RUN_ID,
        rollout_id=rollout_id,
        group_id=rollout_id.rsplit(".", 1)[0],
        mode=RolloutMode.TRAIN,
        status=RolloutStatus.FAILED_INFRA,
        reward=-1.0 / 3,
        attempts=20,
        calls=BIG,
        prompt_tokens=BIG,
        completion_tokens=BIG,
        events_digest=DIGEST,
        error="e" * (10 * OUTCOME_ERROR_CHARS) if error else None,
        duration_seconds=1e9 / 3,
        failed_calls=BIG,
        replayed_calls=BIG,
        replay_diverged_at=BIG,
        prefix_calls=BIG,
        prefix_diverged_at=BIG,
    )


def row(position: int) -> TaskRow:
    return TaskRow(epoch=BIG, position=BIG + position, index=BIG, digest="f" * 16)


def config(group_size: int, **overrides: Any) -> TrainingConfig:
    """A config at its budget: the largest ids and paths, and backend settings that fill it."""
    values: dict[str, Any] = {
        "run_id": RUN_ID,
        "dataset": DatasetSpec(path=PATH),
        "rollout": RolloutSettings(agent=HttpAgentSpec(url="http://127.0.0.1:9/agent")),
        "backend": BackendSpec(model_dir=PATH),
        "weight_sync": WeightSyncSettings(
            gateway_admin_url="http://127.0.0.1:9", policy_servers=["http://127.0.0.1:9"]
        ),
        "validation": ValidationSpec(every_steps=1, path=PATH, tasks=MAX_VALIDATION_TASKS),
        "group_size": group_size,
        "batch_size": MAX_HELD // group_size - 1,
        "mode": TrainingMode.SYNC,
        **overrides,
    }
    room = CONFIG_MAX_BYTES - len(TrainingConfig(**values).model_dump_json().encode())
    values["backend"] = BackendSpec(model_dir=PATH, settings={"pad": "p" * (room - 16)})
    filled = TrainingConfig(**values)
    assert CONFIG_MAX_BYTES - 64 < len(filled.model_dump_json().encode()) <= CONFIG_MAX_BYTES
    return filled


def step_record(step: int) -> StepRecord:
    return StepRecord(
        step=BIG + step,
        policy_version=BIG,
        time=1e9 / 3,
        rollouts=BIG,
        groups=BIG,
        reward_mean=1 / 3,
        reward_std=1 / 3,
        success_rate=1 / 3,
        response_tokens_mean=1e9 / 3,
        staleness_mean=1 / 3,
        paused_seconds=1e9 / 3,
        rollouts_per_minute=1e9 / 3,
        rollouts_ended=BIG,
        train_seconds=1e9 / 3,
        trainer={f"actor/metric_with_a_long_name_{i:03d}": 1 / 3 for i in range(TRAINER_METRICS)},
        val_reward_mean=1 / 3,
        val_success_rate=1 / 3,
    )


def carried(group_size: int) -> TrainingConfig:
    """The continue-as-new input at its worst: MAX_HELD train rollouts held, every one back
    (a member is larger than a pending id), branching groups with their rows, a validation
    with all its rollouts out, the step records kept, and the longest failure said."""
    branching = group_size > 1
    c = config(group_size, groups=GroupsSpec(mode="branch" if branching else "independent"))
    groups = {}
    for position in range(MAX_HELD // group_size):
        gid = group_id(position)
        members = [
            Member.model_validate(outcome(f"{gid}.{k}").model_dump()) for k in range(group_size)
        ]
        groups[gid] = GroupState(
            group_id=gid,
            step=BIG,
            policy_version=BIG,
            pending=[],
            results=members,
            started_at=1e9 / 3,
            seed=f"{gid}.0" if branching else None,
            row=row(position) if branching else None,
            branch_point=BIG if branching else None,
        )
    validation_id = f"{RUN_ID}.v{BIG}"
    groups[validation_id] = GroupState(
        group_id=validation_id,
        mode=RolloutMode.VAL,
        step=BIG,
        policy_version=BIG,
        pending=[f"{validation_id}.t{BIG + i}.0" for i in range(MAX_VALIDATION_TASKS)],
        started_at=1e9 / 3,
        tally=ValTally(results=BIG, rewarded=BIG, reward_sum=1e9 / 3, successes=BIG),
    )
    state = TrainingState(
        step=BIG,
        policy_version=BIG,
        policy_path=PATH,
        initialized=True,
        epoch=BIG,
        cursor=BIG,
        groups=groups,
        ready=[g for g in groups if g != validation_id],
        counters=Counters(**dict.fromkeys(Counters.model_fields, BIG)),
        recent_steps=[
            *(step_record(i).model_copy(update={"trainer": {}}) for i in range(RECENT_STEPS - 1)),
            step_record(RECENT_STEPS),
        ],
        unwritten_records=[step_record(i) for i in range(2)],
        failed_in_a_row=BIG,
        last_failure=f"{group_id(0)}.0 failed_infra: " + "e" * (OUTCOME_ERROR_CHARS + 6),
        started_at=1e9 / 3,
    )
    return c.model_copy(update={"carried_state": state})


def reports() -> list[RolloutOutcome]:
    """A `rollouts_finished` signal: as many outcomes as TrainerReports batches (it also
    stops at MAX_BATCH_BYTES, which the budget below is)."""
    return [outcome(f"{group_id(i)}.0") for i in range(MAX_BATCH_RESULTS)]


def start_rollouts() -> StartRolloutsRequest:
    c = config(8)
    return StartRolloutsRequest(
        task_queue="q" * 200,
        run_id=RUN_ID,
        settings=c.rollout,
        dataset=PATH,
        val_dataset=PATH,
        policy_version=BIG,
        report_to=f"train/{RUN_ID}",
        rollouts=[
            RolloutStart(
                rollout_id=f"{group_id(i)}.1",
                group_id=group_id(i),
                mode=RolloutMode.TRAIN,
                row=row(i),
                prefix=PrefixSpec(rollout_id=f"{group_id(i)}.0", attempt=20, calls=100_000),
            )
            for i in range(BATCH)
        ],
    )


def read_tasks() -> TaskBatch:
    return TaskBatch(rows=[row(i) for i in range(BATCH)], epoch=BIG, cursor=BIG, exhausted=False)


def train_step() -> TrainStepRequest:
    c = config(8)
    return TrainStepRequest(
        run_id=RUN_ID,
        run_dir=PATH,
        step=BIG,
        backend=c.backend,
        aggregation=c.aggregation,
        groups=[
            TrainGroup(
                group_id=group_id(g),
                members=[
                    TrainMember(
                        rollout_id=f"{group_id(g)}.{k}",
                        attempt=20,
                        calls=BIG,
                        digest=DIGEST,
                        reward=-1.0 / 3,
                        masked_calls=BIG,
                    )
                    for k in range(c.group_size)
                ],
            )
            for g in range(c.batch_size)
        ],
        learning_rate=1 / 3,
    )


def lookups() -> list[RolloutLookup]:
    return [
        RolloutLookup(rollout_id=f"{group_id(i)}.0", result=outcome(f"{group_id(i)}.0"))
        for i in range(BATCH)
    ]


def rollout_spec() -> RolloutSpec:
    """A rollout's input at its worst: the largest task, the run's config at its budget."""
    c = config(8)
    rollout_id = f"{group_id(0)}.0"
    spec = RolloutSpec(
        run_id=RUN_ID,
        rollout_id=rollout_id,
        group_id=group_id(0),
        task={"blob": ""},
        agent=c.rollout.agent,
        reward=c.rollout.reward,
        policy_version=BIG,
        report_to=f"train/{RUN_ID}",
        prefix=PrefixSpec(rollout_id=f"{group_id(1)}.0", attempt=20, calls=100_000),
    )
    room = TASK_MAX_BYTES - len('{"blob":""}')
    return spec.model_copy(update={"task": {"blob": "t" * room}})


# --- a rollout's own payloads -----------------------------------------------------------------

ROLLOUT_ID = "r" * 200  # ROLLOUT_ID_PATTERN's longest
REPORT_HALF = REPORT_MAX_BYTES // 2 - 64


def call_event(sequence: int) -> ModelCallEvent:
    """A call event with its strings long: the rollout id at its longest, an upstream URL and
    a store directory of 512 characters each."""
    return ModelCallEvent(
        call_id="f" * 32,
        rollout_id=ROLLOUT_ID,
        attempt=20,
        sequence=sequence,
        endpoint="chat.completions",
        upstream="http://" + "u" * 505,
        policy_version=BIG,
        prompt_tokens=BIG,
        completion_tokens=BIG,
        finish_reason="content_filter",
        latency_ms=1e9 / 3,
        http_status=200,
        retry_count=BIG,
        streamed=True,
        record_ref="/" + "d" * 511 + f"/{ROLLOUT_ID}/attempt-20.jsonl#{sequence}",
        replayed_from="f" * 32,
    )


def report() -> AgentReport:
    """A report at its budget (REPORT_MAX_BYTES), half answer and half metadata."""
    return AgentReport(
        attempt=20, reward=1 / 3, answer="a" * REPORT_HALF, metadata={"m": "m" * REPORT_HALF}
    )


def grade() -> GradeReport:
    """A grader's verdict at its bounds: the diff at its cap, the log's tail, the paths shown
    at the longest a path can be, the failed tests shown with ids of 1 KB."""
    paths = [PATH] * PATHS_SHOWN + ["... and 1000000 more"]
    return GradeReport(
        reward=1 / 3,
        reason="r" * 4096,
        tests=BIG,
        passed=BIG,
        failed_tests=["t" * 1024] * FAILED_SHOWN,
        restored=paths,
        removed=paths,
        exit_code=BIG,
        timed_out=True,
        seconds=1e9 / 3,
        diff="d" * DIFF_CAP_BYTES,
        diff_truncated=True,
        log_tail="l" * LOG_TAIL_BYTES,
    )


def call_ids() -> list[str]:
    return ["f" * 32] * MAX_CALLS_PER_ATTEMPT


def rollout_result() -> RolloutResult:
    """A rollout's result at its bounds (answer and metadata and the agent's claim at once,
    which no rollout has: one or the other)."""
    claim = report()
    return RolloutResult(
        run_id=ROLLOUT_ID,
        rollout_id=ROLLOUT_ID,
        group_id=ROLLOUT_ID,
        mode=RolloutMode.TRAIN,
        status=RolloutStatus.FAILED_INFRA,
        reward=1 / 3,
        answer=claim.answer,
        attempts=20,
        calls=MAX_CALLS_PER_ATTEMPT,
        prompt_tokens=BIG,
        completion_tokens=BIG,
        policy_versions=list(range(BIG, BIG + MAX_CALLS_PER_ATTEMPT)),
        call_ids=call_ids(),
        events_digest=DIGEST,
        exit_code=BIG,
        error="agent exited with 1; log tail:\n" + "l" * LOG_TAIL_BYTES,
        duration_seconds=1e9 / 3,
        duplicate_signals=BIG,
        stale_signals=BIG,
        metadata=claim.metadata,
        failed_calls=BIG,
        failed_call_errors=["400 (responses): " + "e" * 300] * 5,
        replayed_calls=BIG,
        replay_diverged_at=BIG,
        prefix_calls=BIG,
        prefix_diverged_at=BIG,
        grade=grade(),
        agent_claim=claim,
    )


def agent_exit() -> AgentExit:
    """await_agent's result at its bounds: a report, the close's events (RETURNED_EVENTS_CAP),
    its listed failures and incidents, the score's summary and a grade."""
    summary = TrajectorySummary(
        rollout_id=ROLLOUT_ID,
        attempt=20,
        calls=MAX_CALLS_PER_ATTEMPT,
        prompt_tokens=BIG,
        completion_tokens=BIG,
        call_ids=call_ids(),
        exit_code=BIG,
        reported_reward=1 / 3,
        metadata=report().metadata,
    )
    return AgentExit(
        exit_code=BIG,
        timed_out=True,
        oom_killed=True,
        report=report(),
        log_tail="l" * LOG_TAIL_BYTES,
        infra_incidents=["i" * 4096] * CLOSE_LISTED,
        failed_calls=["400 (responses): " + "e" * 300] * CLOSE_LISTED,
        failed_call_count=BIG,
        calls=[call_event(i) for i in range(RETURNED_EVENTS_CAP)],
        score=AgentScore(answer=report().answer, summary=summary, reward=1 / 3, error="e" * 4096),
        replay=ReplayOutcome(
            sources=list(range(20)), recorded=BIG, replayed=BIG, normalized=BIG, diverged_at=BIG
        ),
        grade=grade(),
        grade_error="g" * 4096,
    )


def worst_cases() -> Iterator[Case]:
    for size in (1, 2, 8, 64):
        yield Case(
            f"TrainingWorkflow continue-as-new input (groups of {size})",
            PAYLOAD_LIMIT,
            lambda size=size: carried(size),
        )
    yield Case("rollouts_finished signal (outcomes)", MAX_BATCH_BYTES + 16 * 1024, reports)
    yield Case("start_rollouts input", PAYLOAD_LIMIT // 2, start_rollouts)
    yield Case("read_tasks result", PAYLOAD_LIMIT // 2, read_tasks)
    yield Case("train_step input", PAYLOAD_LIMIT // 2, train_step)
    yield Case("check_rollouts result", PAYLOAD_LIMIT // 2, lookups)
    yield Case(
        "cancel_rollouts input",
        PAYLOAD_LIMIT // 4,
        lambda: [f"{group_id(i)}.0" for i in range(MAX_HELD)],
    )
    yield Case("RolloutWorkflow input (its spec)", SPEC_MAX_BYTES + 4 * 1024, rollout_spec)
    yield Case("RolloutWorkflow result", PAYLOAD_LIMIT, rollout_result)
    yield Case("await_agent result", PAYLOAD_LIMIT, agent_exit)
    yield Case(
        "model_calls signal (SIGNAL_BATCH events)",
        PAYLOAD_LIMIT,
        lambda: [call_event(i) for i in range(SIGNAL_BATCH)],
    )
    yield Case("agent_result signal (a report)", REPORT_MAX_BYTES + 1024, report)
    yield Case(
        "compute_reward input",
        SPEC_MAX_BYTES + 256 * 1024,
        lambda: RewardRequest(
            spec=rollout_spec(),
            answer=report().answer,
            summary=agent_exit().score.summary,  # type: ignore[union-attr]
        ),
    )
    yield Case(
        "metrics query (the step records kept)",
        PAYLOAD_LIMIT // 4,
        lambda: carried(8).carried_state.recent_steps,  # type: ignore[union-attr]
    )
    yield Case(
        "launch_agent input",
        SPEC_MAX_BYTES + 8 * 1024,
        lambda: LaunchRequest(
            spec=rollout_spec(), attempt=20, traceparent="0" * 55, replay_from=list(range(20))
        ),
    )


CASES = list(worst_cases())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_worst_case_is_within_its_budget(case: Case):
    size = payload_bytes(case.build())
    assert size <= case.budget, f"{case.name}: {size:,} bytes, budget {case.budget:,}"
    assert case.budget <= PAYLOAD_LIMIT


def test_an_outcome_is_a_few_hundred_bytes_whatever_the_result_held():
    """The result's heavy parts (answer, metadata, grade, claim, call ids) never reach the
    trainer; its error is cut."""
    told = outcome(f"{group_id(0)}.0")
    assert told.error is not None and len(told.error) <= OUTCOME_ERROR_CHARS + 6
    assert payload_bytes(told) < 2 * 1024
    member = Member.model_validate(told.model_dump())
    assert payload_bytes(member) < 512


def test_a_task_over_its_budget_is_refused_naming_its_largest_field():
    spec = rollout_spec()
    with pytest.raises(ValueError, match=r"the largest field, 'patch', is 786,4\d\d"):
        RolloutSpec.model_validate(
            {**spec.model_dump(), "task": {"patch": "p" * TASK_MAX_BYTES, "id": "x"}}
        )


def test_the_carried_state_comes_back_whole_through_the_converter():
    sent = carried(2)
    converter = DATA_CONVERTER.payload_converter
    [back] = converter.from_payloads(converter.to_payloads([sent]), [TrainingConfig])
    assert back == sent


def test_state_carried_by_a_release_before_outcomes_reads_as_members():
    """A run continued as new by an earlier release carried whole results and a branching
    group's task itself: the next run reads them as members and a row."""
    result = RolloutResult(
        run_id="r",
        rollout_id="r.e0.t0.0",
        group_id="r.e0.t0",
        mode=RolloutMode.TRAIN,
        status=RolloutStatus.SUCCEEDED,
        reward=1.0,
        attempts=1,
        calls=2,
        answer="a" * 1000,
        call_ids=["c0", "c1"],
        metadata={"k": "v"},
    )
    earlier = {
        "group_id": "r.e0.t0",
        "policy_version": 0,
        "pending": ["r.e0.t0.1"],
        "results": [result.model_dump(mode="json")],
        "started_at": 0.0,
        "seed": "r.e0.t0.0",
        "unopened": [],
        "task": {"q": 1},
        "branch_point": 1,
        "surprisal": [0.5, 0.25],
    }
    group = GroupState.model_validate(earlier)
    assert group.results == [Member.model_validate(result.model_dump())]
    assert group.results[0].calls == 2 and group.task == {"q": 1} and group.row is None
