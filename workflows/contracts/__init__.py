"""Contracts of the rollout path: what a rollout is asked to do and what it reports.

JSON-friendly pydantic models (sent through Temporal with `temporalio.contrib.pydantic`), so
`temporal workflow start --type RolloutWorkflow --task-queue darl-rollouts --workflow-id
rollout/<rollout_id> --input-file rollout.json` works with plain JSON.
Every name is importable from here; each lives in the module of its kind:

- `base`: the `Contract` base model, rollout ids, `RolloutMode`
- `agent_specs`: how the agent is run (`AgentSpec`) and its sandbox
- `rollout_spec`: `RolloutSpec`, its task, reward, grader, timeouts, replay and prefix
- `revisions`: the rollout's command sequences (`RolloutSpec.revision`), in one table
- `results`: reports, call events, grades, `RolloutResult` and `RolloutOutcome`
- `activity_io`: the rollout activities' inputs and outputs
"""

from __future__ import annotations

from darl.workflows.contracts.activity_io import (
    CLOSE_LISTED,
    AgentExit,
    AgentHandle,
    AgentScore,
    AwaitRequest,
    LaunchRequest,
    RewardRequest,
)
from darl.workflows.contracts.agent_specs import (
    AgentSpec,
    HttpAgentSpec,
    KubernetesAgentSpec,
    LocalAgentSpec,
    SandboxLimits,
    SandboxSpec,
    WorkflowAgentSpec,
)
from darl.workflows.contracts.base import (
    ROLLOUT_ID_PATTERN,
    Contract,
    RolloutMode,
    rollout_workflow_id,
)
from darl.workflows.contracts.results import (
    MAX_CALLS_PER_ATTEMPT,
    OUTCOME_ERROR_CHARS,
    REPORT_MAX_BYTES,
    REPORTS_PER_ATTEMPT,
    AgentReport,
    GradeReport,
    ModelCallEvent,
    ReplayOutcome,
    RolloutOutcome,
    RolloutProgress,
    RolloutReport,
    RolloutResult,
    TrajectorySummary,
)
from darl.workflows.contracts.revisions import (
    CURRENT_REVISION,
    LOCAL_REPORT_REVISION,
    ONE_ACTIVITY_REVISION,
)
from darl.workflows.contracts.rollout_spec import (
    SPEC_MAX_BYTES,
    TASK_MAX_BYTES,
    GraderSpec,
    PrefixSpec,
    ReplaySpec,
    RewardSpec,
    RolloutSpec,
    RolloutTimeouts,
    Task,
    check_grader_agent,
    task_over_budget,
    task_size,
)
from darl.workflows.rollout_status import RolloutStatus

__all__ = [
    "CLOSE_LISTED",
    "CURRENT_REVISION",
    "LOCAL_REPORT_REVISION",
    "MAX_CALLS_PER_ATTEMPT",
    "ONE_ACTIVITY_REVISION",
    "OUTCOME_ERROR_CHARS",
    "REPORTS_PER_ATTEMPT",
    "REPORT_MAX_BYTES",
    "ROLLOUT_ID_PATTERN",
    "SPEC_MAX_BYTES",
    "TASK_MAX_BYTES",
    "AgentExit",
    "AgentHandle",
    "AgentReport",
    "AgentScore",
    "AgentSpec",
    "AwaitRequest",
    "Contract",
    "GradeReport",
    "GraderSpec",
    "HttpAgentSpec",
    "KubernetesAgentSpec",
    "LaunchRequest",
    "LocalAgentSpec",
    "ModelCallEvent",
    "PrefixSpec",
    "ReplayOutcome",
    "ReplaySpec",
    "RewardRequest",
    "RewardSpec",
    "RolloutMode",
    "RolloutOutcome",
    "RolloutProgress",
    "RolloutReport",
    "RolloutResult",
    "RolloutSpec",
    "RolloutStatus",
    "RolloutTimeouts",
    "SandboxLimits",
    "SandboxSpec",
    "Task",
    "TrajectorySummary",
    "WorkflowAgentSpec",
    "check_grader_agent",
    "rollout_workflow_id",
    "task_over_budget",
    "task_size",
]
