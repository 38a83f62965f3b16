"""DARL's policy servers: the reference server (a tiny Qwen2 built in code, vLLM's API and
response fields, on CPU) and the launcher that runs vLLM under DARL's weight versions. The
gateway forwards agents' calls to them; the trainer loads new weights into them."""
