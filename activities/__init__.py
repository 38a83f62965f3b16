"""DARL's side effects, run by Temporal workers: the agent runners (local process, Kubernetes
Job, agent HTTP service), rewards, the rollout activities and the trainer's activities, and
the two workers (rollout and trainer) that serve the workflows."""
