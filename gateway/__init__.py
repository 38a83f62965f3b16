"""The DARL gateway: an OpenAI-compatible proxy between agents and policy servers that forces
token ids and logprobs, stores every model call and signals it into the rollout's workflow."""
