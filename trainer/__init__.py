"""DARL's trainer side: trajectory aggregation into training rows, the trainer backends
(`reference` on CPU, `verl`) and their checkpoints, weight sync, and the policy servers the
gateway forwards to (DARL's reference server with its tiny Qwen2 built in code, and the vLLM
launcher)."""
