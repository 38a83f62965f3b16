"""The chaos tier's table: one row per kill, with what the run it was in showed."""

from __future__ import annotations

from tests.chaos.harness import ChaosReport

COLUMNS = (
    f"{'component':<22} {'when':<20} {'step':>4} {'back s':>6} {'stall s':>7} "
    f"{'failed':>6} {'mislabelled':>11} {'twins':>5} {'unstored':>8} {'not in result':>13}"
)


def rows(report: ChaosReport) -> list[str]:
    """A line per kill; the run's counts on each (a run with several kills repeats them)."""
    twins = report.twin_executions + report.twin_agent_runs
    mislabelled = report.mislabelled_calls + report.unproven_calls
    lines = []
    for outcome in report.kills or [None]:
        component = outcome.kill.component if outcome else "(no kill)"
        when = outcome.kill.when if outcome else ""
        step = f"{outcome.at_step}" if outcome else ""
        back = f"{outcome.back_after:.1f}" if outcome else ""
        stall = "" if outcome is None or outcome.stall is None else f"{outcome.stall:.1f}"
        lines.append(
            f"{component:<22} {when:<20} {step:>4} {back:>6} {stall:>7} "
            f"{report.rollouts_failed:>6} {mislabelled:>11} {twins:>5} "
            f"{report.answers_not_stored:>8} {report.answers_not_in_result:>13}"
        )
    return lines


def summary(report: ChaosReport) -> str:
    return (
        f"{report.run_id} ({report.agent} agent): {report.wall_seconds:.0f}s, "
        f"{report.rollouts} rollouts ({report.extra_attempts} retried attempts), "
        f"{report.calls} calls, {report.stale_trained_calls} trained calls beyond "
        f"max_staleness; "
        + (
            f"{report.agents_killed} agents killed, {report.replayed_calls} calls replayed, "
            f"{report.regenerated_calls} generated twice, {report.inconsistent_trajectories} "
            "trained trajectories not one episode; "
            if report.agents_killed
            else ""
        )
        + ("clean" if report.clean else "NOT CLEAN: " + "; ".join(report.problems))
    )
