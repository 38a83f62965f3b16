"""The side effects of a rollout: agent runners (local process, HTTP service), rewards, and the
rollout worker that serves RolloutWorkflow and its activities."""
