"""Loaded by every Python process of a stack whose PYTHONPATH starts with this folder, which
`python -m bench.training_bench --worker-tasks` sets: in the rollout worker alone, it counts
CPU by asyncio task (`bench.task_cpu`). Any other process imports nothing from here."""

import os
import sys

if "worker" in sys.argv and "--gateway-url" in sys.argv and os.environ.get("DARL_BENCH_TASK_CPU"):
    # The repository, for `bench`, in this process alone and last: elsewhere its folders must
    # not be top-level modules (pyproject.toml says why).
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from bench.task_cpu import install

    install(os.environ["DARL_BENCH_TASK_CPU"])
