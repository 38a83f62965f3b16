"""Named failures of the sandboxes and their grading:

ActivitiesError
├── SandboxError              a workspace, sandbox or grading step failed: infrastructure,
│   │                         retried
│   ├── SandboxSpecError      the spec or task cannot work here (no bwrap, no repository or
│   │                         commit, test lists the grader cannot read): bad input, not
│   │                         retried
│   └── GradingError          grading could not run (DARL's git, the sandbox, its Python, a
│                             test patch that does not apply to the restored tree)
└── UngradableWorkspaceError  what the agent left cannot be graded as it is (over a limit, a
                              path too long): the agent's outcome, graded 0 with the reason,
                              never infrastructure
"""

from __future__ import annotations

from darl.activities.errors import ActivitiesError


class SandboxError(ActivitiesError):
    """A workspace, sandbox or grading step failed for a reason a retry may not meet again."""


class SandboxSpecError(SandboxError, ValueError):
    """The sandbox or grader cannot work with this spec and task on this machine."""


class GradingError(SandboxError):
    """DARL could not grade the attempt (not the agent's doing): the attempt is not scored."""


class UngradableWorkspaceError(ActivitiesError):
    """The workspace the agent left cannot be graded as it is: the agent's doing, so its
    grade is 0 with this message as the reason."""
