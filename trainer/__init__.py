"""Training side of DARL: the CPU reference policy (a tiny Qwen2 built in code) and its
OpenAI-compatible policy server; trajectory aggregation and trainer backends come next."""
