"""GSM8K on a GPU: verl's quickstart (Qwen2.5-0.5B-Instruct, GRPO) run through DARL."""
