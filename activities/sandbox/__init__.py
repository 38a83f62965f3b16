"""One sandbox per attempt: the task's repository checked out fresh for the attempt
(`workspace`), the agent run in it under bubblewrap with the gateway as its only way out
(`bubblewrap`, `bridge`, `supervise`, `agent`), and DARL's grading of what the agent left
(`grading`, `tampering`, `changes`, `pytest_results`). Its errors are `errors`' tree."""

from darl.activities.sandbox.errors import GradingError, SandboxError, SandboxSpecError

__all__ = ["GradingError", "SandboxError", "SandboxSpecError"]
