"""`make chaos`: the full chaos matrix. An undisturbed run, then one run per kill (each
component, at each moment that matters), printed as a table with every check's count and
each run's wall time against the undisturbed one.

    .venv/bin/python -m tests.chaos.matrix [--steps 8]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from pathlib import Path

from tests.chaos.checks import ChaosReport, Kill
from tests.chaos.harness import ChaosRun
from tests.chaos.report import COLUMNS, rows, summary
from tests.chaos.scenarios import HTTP_KILLS, LOCAL_KILLS

KILL_AT_STEP = 2


async def matrix(steps: int, root: Path) -> list[tuple[ChaosReport, float]]:
    """(report, undisturbed wall time of a run with its agent) for the baseline and each kill."""
    done: list[tuple[ChaosReport, float]] = []
    for agent, kills in (("http", HTTP_KILLS), ("local", LOCAL_KILLS)):
        baseline = await ChaosRun(root / f"{agent}-undisturbed", [], steps, agent).run()
        done.append((baseline, baseline.wall_seconds))
        print(f"undisturbed ({agent} agent): {summary(baseline)}", flush=True)
        for i, (component, when) in enumerate(kills):
            kill = Kill(component, when, from_step=KILL_AT_STEP)
            report = await ChaosRun(root / f"{agent}-{i}", [kill], steps, agent).run()
            done.append((report, baseline.wall_seconds))
            print(f"{component} {when}: {summary(report)}", flush=True)
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="darl-chaos-"))
    results = asyncio.run(matrix(args.steps, root))
    print()
    print(f"{COLUMNS} {'wall s':>6} {'undisturbed s':>13}")
    for report, undisturbed in results:
        for line in rows(report):
            print(f"{line} {report.wall_seconds:>6.0f} {undisturbed:>13.0f}")
    clean = all(report.clean for report, _ in results)
    print(f"\n{'every run clean' if clean else 'NOT CLEAN'}; runs under {root}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
