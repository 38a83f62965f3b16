"""The GSM8K reward: verl's own `verl.utils.reward_score.gsm8k.compute_score` (strict format: the
reply must say "#### <number>"; 1 for the right number, 0 otherwise), so DARL's rewards are the
numbers verl's quickstart reports.

    rollout: {reward: {function: darl.examples.gsm8k.reward:gsm8k_reward}}

verl's scoring file needs only `re`, but importing it through the `verl` package first imports
verl's `__init__` (torch, ray: seconds on the rollout worker's event loop). So the file is loaded
on its own from the installed verl: the same code, without the package around it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from darl.activities.rewards import RewardFunctionError

SCORE_FILE = Path("utils", "reward_score", "gsm8k.py")


@cache
def verl_gsm8k() -> ModuleType:
    """verl's `verl/utils/reward_score/gsm8k.py`, loaded without importing `verl`."""
    verl = importlib.util.find_spec("verl")
    if verl is None or not verl.submodule_search_locations:
        raise RewardFunctionError("the GSM8K reward needs verl installed (pip install verl)")
    path = Path(next(iter(verl.submodule_search_locations))) / SCORE_FILE
    spec = importlib.util.spec_from_file_location("darl_verl_gsm8k_score", path)
    if not path.is_file() or spec is None or spec.loader is None:
        raise RewardFunctionError(f"verl's GSM8K scoring file is not at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gsm8k_reward(task: Mapping[str, Any], answer: str | None, summary: object = None) -> float:
    """verl's strict GSM8K score of the agent's whole reply against `task["ground_truth"]`
    (written by `prepare_data.py`). No reply scores 0; `summary` is not used."""
    if "ground_truth" not in task:
        # Not retryable: the rollout fails at once instead of retrying a task that cannot score.
        raise RewardFunctionError(
            f"task {task.get('id')!r} has no 'ground_truth' (write the tasks with "
            "examples/gsm8k/prepare_data.py)"
        )
    if answer is None:
        return 0.0
    return float(verl_gsm8k().compute_score(answer, str(task["ground_truth"])))
