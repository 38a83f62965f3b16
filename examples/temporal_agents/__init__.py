"""Agents written as Temporal workflows, trained by DARL unchanged: an OpenAI Agents SDK agent
and a LangGraph agent on the arithmetic tasks, and the worker that runs them (in
`.venv-temporal-agents`; docs/agents-on-temporal.md)."""
