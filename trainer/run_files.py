"""A training run's files under its run directory: `metrics.jsonl` (one line per step, a
step written again replaces its line) and the reward curve `reward.png`."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from darl.files import write_atomically

METRICS_FILE = "metrics.jsonl"
REWARD_PLOT = "reward.png"


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_step(run_dir: Path, record: dict[str, Any]) -> None:
    """Idempotent by step: the file is rewritten whole (atomically) with this step's line.
    A record without the trainer's figures (a step's validation result, on a record the run's
    state keeps without them) keeps the ones the line has."""
    run_dir.mkdir(parents=True, exist_ok=True)
    by_step = {r["step"]: r for r in read_metrics(run_dir)}
    written = by_step.get(record["step"], {})
    if not record.get("trainer") and written.get("trainer"):
        record = {**record, "trainer": written["trainer"]}
    by_step[record["step"]] = record
    lines = "".join(json.dumps(by_step[s]) + "\n" for s in sorted(by_step))
    write_atomically(run_dir / METRICS_FILE, lines)


def plot_rewards(run_dir: Path, title: str | None = None) -> Path | None:
    """Draw reward mean (± std), success rate and validation reward per step; None when
    there is no step yet."""
    records = read_metrics(run_dir)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = [r["step"] for r in records]
    mean = [r["reward_mean"] for r in records]
    std = [r["reward_std"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, mean, label="reward mean", color="tab:blue")
    ax.fill_between(
        steps,
        [m - s for m, s in zip(mean, std, strict=True)],
        [m + s for m, s in zip(mean, std, strict=True)],
        alpha=0.2,
        color="tab:blue",
    )
    ax.plot(steps, [r["success_rate"] for r in records], label="success rate", color="tab:green")
    val = [
        (r["step"], r["val_reward_mean"]) for r in records if r.get("val_reward_mean") is not None
    ]
    if val:
        ax.plot(*zip(*val, strict=True), "o--", label="validation reward", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title or run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    path = run_dir / REWARD_PLOT
    write_atomically(path, png.getvalue())
    return path
