"""The chaos tier: training runs whose components are killed and restarted (see harness.py)."""

# Where the chaos agents note their runs and the answers they received.
RUNS_LOG = "agent-runs.jsonl"
