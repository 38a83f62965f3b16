"""The chaos tier: training runs whose components are killed and restarted (see harness.py)."""

# Where the chaos agents note their runs and the answers they received.
RUNS_LOG = "agent-runs.jsonl"
# How many calls each chaos agent run makes (1 unless set: the replicas' run makes 2).
CALLS_ENV = "CHAOS_AGENT_CALLS"
