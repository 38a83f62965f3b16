"""Runs an agent file as its own process, then notes the CPU seconds that process used (its
start, imports and episode: what a process agent costs its machine) as a JSON line in
$AGENT_CPU_LOG. Imports nothing of DARL's: the rollout worker starts it as an agent command.

    {python} bench/timed_agent.py AGENT_FILE
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import sys


def main() -> None:
    agent = sys.argv[1]
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(agent, run_name="__main__")
    finally:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        line = {
            "rollout": os.environ.get("DARL_ROLLOUT_ID"),
            "cpu_seconds": usage.ru_utime + usage.ru_stime,
        }
        with open(os.environ["AGENT_CPU_LOG"], "a") as log:
            log.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
