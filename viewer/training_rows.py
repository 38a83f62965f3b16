"""What the trainer would make of a rollout: its training rows (trainer/aggregation.py, called,
not copied) under the run's aggregation settings, and a group's advantages (verl's estimator,
called as the reference backend calls it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from darl.gateway.store.record import CallRecord
from darl.trainer.aggregation import (
    AggregationCounters,
    AggregationError,
    AggregationSettings,
    RolloutSample,
    TrainingRow,
    rollout_rows,
    to_data_proto,
)
from darl.trainer.reference_backend import ReferenceTrainerSettings, compute_advantages
from darl.workflows.contracts import RolloutResult, RolloutSpec
from darl.workflows.training_config import AggregationSpec, GroupsSpec, TrainingConfig


@dataclass(frozen=True)
class AggregatedRows:
    """The rows the trainer makes of a rollout's calls, and under which settings."""

    settings: AggregationSettings
    from_run: bool
    rows: list[TrainingRow] = field(default_factory=list)
    counters: AggregationCounters = field(default_factory=AggregationCounters)
    error: str | None = None


def aggregation_settings(config: TrainingConfig | None) -> tuple[AggregationSettings, bool]:
    """The run's aggregation settings, or the defaults (False: not the run's own)."""
    spec = config.aggregation if config is not None else AggregationSpec()
    return AggregationSettings(**spec.model_dump()), config is not None


def trainer_rows(
    rollout_id: str,
    group_id: str,
    reward: float | None,
    calls: list[CallRecord],
    config: TrainingConfig | None,
    masked_calls: int = 0,
) -> AggregatedRows:
    """The rows of a rollout whose first `masked_calls` calls are context only (`masked_calls`
    below)."""
    settings, from_run = aggregation_settings(config)
    counters = AggregationCounters()
    sample = RolloutSample(rollout_id, group_id, reward or 0.0, calls, masked_calls)
    try:
        rows = rollout_rows(sample, settings, counters)
    except AggregationError as err:
        return AggregatedRows(settings, from_run, counters=counters, error=str(err))
    return AggregatedRows(settings, from_run, rows, counters)


def masked_calls(
    spec: RolloutSpec | None,
    result: RolloutResult | None,
    branch_point: int | None,
    config: TrainingConfig | None,
) -> int:
    """A member's first calls the trainer keeps out of its rows, as the TrainingWorkflow counts
    them (`GroupBook._masked_calls`): a branch's the prefix calls it reproduced; the seed's its
    group's branch point `branch_point` unless the run trains the seed's prefix; else none."""
    if spec is not None and spec.prefix is not None:
        return result.prefix_calls if result is not None else 0
    if branch_point is None or (config is not None and config.groups.train_seed_prefix):
        return 0
    return branch_point


def dropped_branch(result: RolloutResult | None, config: TrainingConfig | None) -> bool:
    """A branch that left its prefix early, which `groups.broken_branches: drop` keeps out of
    its group (`GroupBook._dropped_broken`): no rows of it are trained."""
    groups = config.groups if config is not None else GroupsSpec()
    return (
        result is not None
        and result.prefix_diverged_at is not None
        and groups.broken_branches == "drop"
    )


def group_advantages(rows: list[TrainingRow], config: TrainingConfig | None) -> dict[str, float]:
    """Each rollout's advantage as the reference backend computes it: the rows made into
    verl's batch (`to_data_proto`) and verl's estimator named by the run's settings (GRPO:
    (r - mean) / (std + eps) over the group's rows). A rollout's rows share one value."""
    if not rows:
        return {}
    settings = ReferenceTrainerSettings(
        **(config.backend.settings if config and config.backend.name == "reference" else {})
    )
    aggregation, _ = aggregation_settings(config)
    data = to_data_proto(rows, aggregation)
    advantages = compute_advantages(settings, data)
    found: dict[str, float] = {}
    for i, row in enumerate(rows):
        mask = data.batch["response_mask"][i].bool()
        found.setdefault(row.rollout_id, float(advantages[i][mask][0]))
    return found
