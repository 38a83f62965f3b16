"""The trainer's activities (task queue `darl-trainer`), all on one object: the checks at a
run's start (`run_checks`), its tasks and rollouts (`trainer_rollouts`), its policy's steps
(`policy_steps`). Each is idempotent, so Temporal may retry any of them after a crash: starts
by workflow id, steps by checkpoint, syncs by version."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from darl.activities.policy_steps import PolicyStepActivities
from darl.activities.run_checks import RunCheckActivities
from darl.activities.trainer_rollouts import TrainerRolloutActivities


class TrainerActivities(RunCheckActivities, TrainerRolloutActivities, PolicyStepActivities):
    """Every activity of the trainer worker, sharing one set of `TrainerResources`."""

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.check_run,
            self.initialize_policy,
            self.read_tasks,
            self.read_val_tasks,
            self.start_rollouts,
            self.cancel_rollouts,
            self.check_rollouts,
            self.train_step,
            self.sync_weights,
            self.restore_weights,
            self.record_step,
            self.choose_branch_point,
        ]
