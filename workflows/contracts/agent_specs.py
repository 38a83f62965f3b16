"""How a rollout's agent is run: as a local process (optionally in a sandboxed workspace), as an
HTTP service, as a Kubernetes Job, or as a Temporal workflow on the user's own worker, and what
its sandbox may use (`AgentSpec`, the `RolloutSpec.agent` field)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from darl.workflows.contracts.base import Contract


class SandboxLimits(Contract):
    """What one attempt's sandbox may use, the agent's and its grading's alike. Each process
    gets `memory_mb` of address space, `cpu_seconds` of CPU and writes files of at most
    `file_size_mb`; the sandbox runs at most `processes` processes and threads at once, its
    private /tmp holds `tmp_mb`; the grader copies a workspace of at most `workspace_mb`
    (each file once however many links it has, by its full size even where it is sparse) and
    `workspace_files` entries. Hitting one is the agent's outcome, never DARL's failure: the
    process that hit it is refused or killed, and a workspace over its limit grades 0."""

    memory_mb: int = Field(default=8192, ge=64)
    """MiB of address space each process may use (8192 by default, 64 at least)."""
    processes: int = Field(default=512, ge=16)
    """Processes and threads the sandbox runs at once, at most (512 by default)."""
    cpu_seconds: int = Field(default=3600, ge=1)
    """Seconds of CPU time each process may use (3600 by default)."""
    file_size_mb: int = Field(default=1024, ge=1)
    """MiB: the largest file a process may write (1024 by default)."""
    tmp_mb: int = Field(default=1024, ge=1)
    """MiB the sandbox's private /tmp holds (1024 by default)."""
    workspace_mb: int = Field(default=2048, ge=1)
    """MiB: the largest workspace the grader copies (2048 by default); a larger one grades
    0."""
    workspace_files: int = Field(default=200_000, ge=100)
    """Entries (files, directories, links) of the largest workspace the grader copies
    (200,000 by default); more grade 0."""


class SandboxSpec(Contract):
    """A fresh workspace per attempt, isolated, for agents that change files (coding agents).

    The workspace is the task's repository at its commit: `repo` and `commit` name task
    fields (`input.<path>`, as `env_map` does; SWE-bench's `repo` and `base_commit` by
    default), and `<repos_dir>/<repo with "/" as "__">` is a git repository holding that
    commit (SWE-smith's mirror naming). Each attempt gets its own copy, the agent's working
    directory, seen by the agent at `workdir`; its git directory stays outside, so the agent
    cannot rewrite what it started from. `isolation` `bubblewrap` runs the agent (and a
    grader's tests) in Debian's `bwrap`: nothing writable but the workspace and a private
    `/tmp`, nothing readable but the system directories and `read_only`, no network but the
    gateway. `none` runs it in the workspace without isolation (for machines without
    bubblewrap; the agent can then reach anything the worker can). A relative `repos_dir` or
    `read_only` path is the worker's working directory's; `{prefix}` (the worker's Python
    environment) and `{cwd}` work in them as in `command` and `env`.
    """

    repos_dir: str
    """The directory on the worker holding a git repository per task repository, named
    `<repo with "/" as "__">` (relative: to the worker's working directory)."""
    repo: str = "input.repo"
    """The task field naming the repository, as `input.<path>` (`input.repo` by default)."""
    commit: str = "input.base_commit"
    """The task field naming the commit to check out, as `input.<path>`
    (`input.base_commit` by default)."""
    workdir: str = "/testbed"
    """Where the agent sees its workspace (its working directory); `/testbed` by default."""
    isolation: Literal["bubblewrap", "none"] = "bubblewrap"
    """`bubblewrap` (the default) runs the agent in `bwrap`: only the workspace and a
    private /tmp writable, no network but the gateway. `none`: no isolation."""
    read_only: list[str] = Field(default_factory=list)
    """Paths the agent sees read-only, at the same place, besides the system directories
    (/usr, the /etc files programs need): its harness's virtual environment, its own code.
    Empty by default."""
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    """What the sandbox may use (memory, processes, CPU time, file sizes, /tmp)."""

    @field_validator("repo", "commit")
    @classmethod
    def _task_path(cls, value: str) -> str:
        if not value.startswith("input."):
            raise ValueError(f"{value!r} must name a task field as 'input.<path>'")
        return value


class LocalAgentSpec(Contract):
    """An agent run as a local process in its own process group.

    `command` is an argv list; in it and in `env` values, `{python}` is the worker's Python,
    `{prefix}` its environment (`sys.prefix`) and `{cwd}` the directory the worker runs in.
    `entrypoint` (`module:Class` or `module.Class`) runs an Agent Lightning style agent:
    `Class().run()`, awaited if it is a coroutine. Exactly one of the two is given.
    `env_map` sets variables as Agent Lightning does: `"input"` is the task (as JSON unless it
    is a string), `"input.<path>"` a value in it (`input.question`, `input.items.0`; a path
    the task lacks is an error), any other value is itself (`{"MODEL": "Qwen/Qwen2.5-1.5B"}`).
    """

    kind: Literal["local"] = "local"
    """`local`: the agent is a process on the rollout worker."""
    command: list[str] | None = None
    """The agent's argv (`["{python}", "-m", "my_agent"]`); None when `entrypoint` is given."""
    entrypoint: str | None = None
    """An Agent Lightning style agent, `module:Class` or `module.Class`; None when `command`
    is given."""
    env: dict[str, str] = Field(default_factory=dict)
    """More environment variables of the agent (`{python}`, `{prefix}`, `{cwd}` expand).
    Empty by default."""
    env_map: dict[str, str] = Field(default_factory=dict)
    """Environment variables from the task: `"input"` the task, `"input.<path>"` a value in
    it, anything else itself. Empty by default."""
    cwd: str | None = None
    """The agent's working directory; None (the default): the worker's."""
    sandbox: SandboxSpec | None = None
    """A fresh, isolated workspace per attempt, the agent's working directory (`cwd` then
    unset). None (the default): no sandbox."""

    @model_validator(mode="after")
    def _one_way_to_start(self) -> LocalAgentSpec:
        if (self.command is None) == (self.entrypoint is None):
            raise ValueError("give exactly one of 'command' and 'entrypoint'")
        if self.command is not None and not self.command:
            raise ValueError("'command' must not be empty")
        if self.sandbox is not None and self.cwd is not None:
            raise ValueError("a sandboxed agent runs in its workspace: leave 'cwd' unset")
        return self


class HttpAgentSpec(Contract):
    """An agent that already runs as an HTTP service: DARL POSTs the rollout to `url` and the
    response body is the agent's report. The request carries `Idempotency-Key:
    <rollout>/<attempt>`; a service that honours it never runs an attempt twice."""

    kind: Literal["http"] = "http"
    """`http`: the agent is a service DARL POSTs each attempt to."""
    url: str
    """The URL DARL POSTs the rollout to."""
    headers: dict[str, str] = Field(default_factory=dict)
    """More HTTP headers of the request (an API key, say). Empty by default."""
    env_map: dict[str, str] = Field(default_factory=dict)
    """Values from the task sent in the request body's `env`, mapped as
    `LocalAgentSpec.env_map` maps environment variables. Empty by default."""


class KubernetesAgentSpec(Contract):
    """An agent run as a Kubernetes Job, one per attempt.

    `job_template` is a Job manifest (YAML, Jinja placeholders over `task`, `rollout_id`,
    `attempt`, `run_id`, `mode`, and Agent Lightning's `input` (the task), `job_name` and
    `yaml_escape` filter) on the worker's disk; without one, `image` and `command`
    make a one-container Job. DARL fills in the name, labels, the agent contract in the
    environment (the token from a Secret owned by the Job) and enforces what makes an attempt
    durable and contained: `backoffLimit: 0`, `restartPolicy: Never`, the rollout timeout as
    `activeDeadlineSeconds`, no service account token, non-root (a template that asks for
    root, `runAsUser: 0`, runs only in the worker's sandbox namespace under its RuntimeClass,
    and is refused without one).

    With a reward `grader`, the repository the agent works on is the image's `workdir`, put
    on a volume of the attempt before the agent starts (with a copy of it as the image had
    it, which the agent never sees); after the agent, DARL grades it in a second Job on that
    volume, in the same image, with `test_python` (the image's Python that has pytest)
    running the tests, within `limits` (memory, /tmp, what the grader copies).
    """

    kind: Literal["kubernetes"] = "kubernetes"
    """`kubernetes`: the agent is a Kubernetes Job, one per attempt."""
    job_template: str | None = None
    """A Job manifest template (YAML with Jinja placeholders) on the worker's disk; None
    when `image` is given."""
    image: str | None = None
    """The container image of a one-container Job; None when `job_template` is given."""
    command: list[str] | None = None
    """The container's command (argv) with `image`; None: the image's own entrypoint."""
    env: dict[str, str] = Field(default_factory=dict)
    """More environment variables of the agent's container. Empty by default."""
    env_map: dict[str, str] = Field(default_factory=dict)
    """Environment variables from the task, as `LocalAgentSpec.env_map`. Empty by default."""
    workdir: str = "/testbed"
    """With a reward `grader`: the image's directory holding the repository the agent works
    on, put on the attempt's volume (`/testbed` by default)."""
    test_python: str = "python"
    """With a reward `grader`: the image's Python that has pytest (`python` by default)."""
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    """With a reward `grader`: what grading may use (memory, /tmp, what the grader copies)."""

    @model_validator(mode="after")
    def _one_way_to_start(self) -> KubernetesAgentSpec:
        if (self.job_template is None) == (self.image is None):
            raise ValueError("give exactly one of 'job_template' and 'image'")
        return self


# A dotted path into a JSON value (`answer`, `items.0.text`): names, or list indexes.
_DOTTED_PATH = r"^[^.\s]+(\.[^.\s]+)*$"


class WorkflowAgentSpec(Contract):
    """An agent that is itself a Temporal workflow (written with the SDK's OpenAI Agents or
    LangGraph integration, or by hand), run by the user's worker on `task_queue`.

    Each attempt starts it as the rollout's child workflow, id
    `rollout/<rollout_id>/agent/<attempt>`, with the rollout timeout as its execution timeout
    and the attempt in its memo (the gateway's base URL and the attempt's token), which DARL's
    plugin on the user's worker (`darl.temporal_agents.DarlPlugin`) hands to the workflow's
    model activities; the agent's code is unchanged. Its one argument is the task, or the task's
    value at `input_field`; its result is the agent's report: the answer at `answer_field` and,
    with `reward_field`, a reward the agent reports (the reward kinds are as for any agent).
    A workflow that fails is the agent's failure; one past the rollout timeout timed out.
    """

    kind: Literal["workflow"] = "workflow"
    """`workflow`: the agent is a Temporal workflow on the user's worker."""
    workflow: str = Field(min_length=1, max_length=200)
    """The agent workflow's type name (`@workflow.defn(name=...)`, else its class name)."""
    task_queue: str = Field(min_length=1, max_length=200)
    """The task queue the user's worker (with DARL's plugin) polls for the agent workflow."""
    input_field: str | None = Field(default=None, pattern=_DOTTED_PATH)
    """The task's value passed as the workflow's one argument, as a dotted path (`question`,
    `items.0`); None (the default): the whole task (without the grader's hidden fields)."""
    answer_field: str | None = Field(default=None, pattern=_DOTTED_PATH)
    """Where the answer is in the workflow's result, as a dotted path (`answer`,
    `final.text`); None (the default): the result itself, which is then a string."""
    reward_field: str | None = Field(default=None, pattern=_DOTTED_PATH)
    """Where a reward the agent reports is in the workflow's result (a number), as a dotted
    path; None (the default): the agent reports none (a reward `function` computes it, or
    `missing_reward` is used)."""


AgentSpec = Annotated[
    LocalAgentSpec | HttpAgentSpec | KubernetesAgentSpec | WorkflowAgentSpec,
    Field(discriminator="kind"),
]
"""How the agent runs, chosen by its `kind`: `local` (`LocalAgentSpec`), `http`
(`HttpAgentSpec`), `kubernetes` (`KubernetesAgentSpec`) or `workflow`
(`WorkflowAgentSpec`)."""
