"""The learning benchmark's figures from its runs' files: per run a curve (validation reward
against the policy tokens generated and the seconds elapsed), the point where it reaches a
reward threshold, its final reward and trainer time per step; per mode their mean ± sd over
seeds; a table and a PNG of the curves."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from darl.gateway.store.record import CallRecord
from darl.workflows.training_state import Counters


@dataclass(frozen=True)
class CurvePoint:
    step: int
    seconds: float
    """Since the run started."""
    policy_tokens: int
    """Tokens the policy server generated for the run's training rollouts until the step was
    recorded (calls answered from a record are not generated)."""
    reward: float
    """The step's validation reward (independent rollouts, one per validation task)."""


@dataclass(frozen=True)
class RunCurve:
    mode: str
    seed: int
    points: list[CurvePoint]
    train_seconds: float
    """Trainer time per step, the mean over the run's steps."""
    wall_seconds: float
    policy_tokens: int
    groups_branched: int
    steps: int = 0
    """Steps the run trained (fewer than asked when its dataset ran out first)."""
    rollouts_ended: int = 0
    """Training rollouts that ended, trained or not (a group whose rewards were all equal
    is dropped: its rollouts' tokens were spent for nothing)."""
    rollouts_trained: int = 0

    @property
    def ended_per_trained(self) -> float:
        """Rollouts ended per rollout trained: 1.0 when no group was dropped."""
        return self.rollouts_ended / self.rollouts_trained if self.rollouts_trained else math.nan

    def reached(self, threshold: float) -> CurvePoint | None:
        """The first validation point at or above `threshold`."""
        return next((p for p in self.points if p.reward >= threshold), None)

    @property
    def final_reward(self) -> float:
        return self.points[-1].reward if self.points else float("nan")


def live_tokens_by_time(run_id: str, records: Iterable[CallRecord]) -> list[tuple[float, int]]:
    """(created_at, completion tokens) of each call the policy generated for the run's train
    rollouts, oldest first. Validation rollouts are left out: they are the measurement, not
    the training's cost."""
    train = f"{run_id}.e"  # train groups are `<run>.e<epoch>.t<position>` (training_group_ids)
    return sorted(
        (r.created_at, len(r.completion_token_ids()))
        for r in records
        if r.replayed_from is None and r.rollout_id.startswith(train)
    )


def tokens_until(calls: Sequence[tuple[float, int]], when: float) -> int:
    return sum(tokens for at, tokens in calls if at <= when)


def curve(
    mode: str,
    seed: int,
    started: float,
    steps: Sequence[dict],
    calls: Sequence[tuple[float, int]],
    counters: Counters,
) -> RunCurve:
    """A run's curve from its `metrics.jsonl` lines, its generated calls and its summary's
    counters; `started` is the run's start in Unix seconds (the records' clock)."""
    points = [
        CurvePoint(
            step=s["step"],
            seconds=s["time"] - started,
            policy_tokens=tokens_until(calls, s["time"]),
            reward=s["val_reward_mean"],
        )
        for s in steps
        if s.get("val_reward_mean") is not None
    ]
    last = max((s["time"] for s in steps), default=started)
    return RunCurve(
        mode=mode,
        seed=seed,
        points=points,
        train_seconds=statistics.fmean(s["train_seconds"] for s in steps) if steps else 0.0,
        wall_seconds=last - started,
        policy_tokens=tokens_until(calls, last),
        groups_branched=counters.groups_branched,
        steps=len(steps),
        rollouts_ended=counters.ended() - counters.rollouts_validated,
        rollouts_trained=counters.rollouts_trained,
    )


def mean_sd(values: Sequence[float], digits: int = 2) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def report(curves: Sequence[RunCurve], threshold: float, console: Console) -> None:
    """One row per mode, mean ± sd over its seeds; tokens and seconds to the threshold over
    the seeds that reached it (the count says how many)."""
    table = Table(title=f"to validation reward {threshold}; mean ± sd over seeds")
    for column in (
        "groups",
        "seeds reached",
        "policy tokens to reward",
        "seconds to reward",
        "final reward",
        "trainer s / step",
        "policy tokens (run)",
        "groups branched",
        "steps",
        "rollouts ended / trained",
    ):
        table.add_column(column, justify="right")
    modes = list(dict.fromkeys(c.mode for c in curves))
    baseline: float | None = None
    for mode in modes:
        runs = [c for c in curves if c.mode == mode]
        hits = [(c, p) for c in runs if (p := c.reached(threshold)) is not None]
        tokens = [float(p.policy_tokens) for _, p in hits]
        # The first mode (ordinary groups) is the baseline, when every seed of it got there.
        if mode == modes[0] and tokens and len(hits) == len(runs):
            baseline = statistics.fmean(tokens)
        table.add_row(
            mode,
            f"{len(hits)}/{len(runs)}",
            mean_sd(tokens, 0),
            mean_sd([p.seconds for _, p in hits], 0),
            mean_sd([c.final_reward for c in runs]),
            mean_sd([c.train_seconds for c in runs], 3),
            mean_sd([float(c.policy_tokens) for c in runs], 0),
            mean_sd([float(c.groups_branched) for c in runs], 0),
            mean_sd([float(c.steps) for c in runs], 0),
            mean_sd([c.ended_per_trained for c in runs]),
        )
    console.print(table)
    if baseline is None:
        console.print(f"{modes[0]} did not reach {threshold} on every seed: no ratio")
    else:
        for mode in modes[1:]:
            points = [p for c in curves if c.mode == mode and (p := c.reached(threshold))]
            if points and len(points) == sum(1 for c in curves if c.mode == mode):
                ratio = baseline / statistics.fmean(p.policy_tokens for p in points)
                console.print(f"{mode}: {ratio:.2f}x fewer policy tokens to {threshold}")


def plot(curves: Sequence[RunCurve], threshold: float, path: Path) -> Path:
    """Validation reward against policy tokens and against seconds, one line per mode (the
    mean over seeds at each validation step) with a band of ± sd."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=90)
    for mode in dict.fromkeys(c.mode for c in curves):
        runs = [c for c in curves if c.mode == mode]
        length = min(len(c.points) for c in runs)
        if length == 0:
            continue
        rewards = [[c.points[i].reward for c in runs] for i in range(length)]
        mean = [statistics.fmean(r) for r in rewards]
        sd = [statistics.stdev(r) if len(r) > 1 else 0.0 for r in rewards]
        for ax, x_of in (
            (axes[0], lambda p: p.policy_tokens),
            (axes[1], lambda p: p.seconds),
        ):
            xs = [statistics.fmean(x_of(c.points[i]) for c in runs) for i in range(length)]
            (line,) = ax.plot(xs, mean, marker="o", markersize=3, label=mode)
            low = [m - s for m, s in zip(mean, sd, strict=True)]
            high = [m + s for m, s in zip(mean, sd, strict=True)]
            ax.fill_between(xs, low, high, alpha=0.15, color=line.get_color())
    for ax, label in zip(axes, ("policy tokens generated", "seconds"), strict=True):
        ax.axhline(threshold, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("validation reward")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    fig.suptitle("relay task: validation reward, mean ± sd over seeds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
