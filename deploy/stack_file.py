"""What a running embedded stack serves, as `<home>/stack.json`: written by `darl dev` and
the demo when their stack is up, removed when it stops, and read by every client command
(`darl rollout`, `train`, `status`, `trajectory`, `viewer`, ...) for its Temporal address,
its places and the endpoints of a config written for the default stack.

A command finds the stack as users expect (`find_stack`): under `--home` (or `DARL_HOME`)
when given; else in `.darl` of the current directory or the nearest parent that has a running
one; else the last `darl dev` started, which registers its home for the user
(`$XDG_STATE_HOME/darl/current-stack.json`, ~/.local/state by default)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ValidationError

from darl.files import write_atomically
from darl.workflows.contracts import HttpAgentSpec
from darl.workflows.training_config import PolicyServerSpec, TrainingConfig

STACK_FILE = "stack.json"
# The home a stack keeps when `darl dev` runs with its default --home, under the directory it
# was started in.
HOME_DIR = ".darl"
# The endpoints `darl dev` serves with its default ports, as examples/digits/train.yaml (and
# the configs in docs/training.md) write them: a config naming these means "the dev stack",
# wherever its flags moved it.
DEFAULT_GATEWAY_URL = "http://127.0.0.1:8100"
DEFAULT_POLICY_URL = "http://127.0.0.1:8200"
DEFAULT_AGENT_SERVICE_URL = "http://127.0.0.1:8300"


class StackEndpoints(BaseModel):
    """Where a stack's components listen; None for what it does not run."""

    temporal_address: str
    namespace: str = "default"
    ui_url: str | None = None
    gateway_url: str
    policy_url: str
    agent_service_url: str | None = None
    viewer_url: str | None = None
    runs_dir: str | None = None
    # The model directory its policy server serves (and a training run on it must start from).
    model_dir: str | None = None
    # The process that started the stack: a file left by one that was killed is ignored.
    pid: int = 0


def stack_file(home: Path) -> Path:
    return home / STACK_FILE


def write_stack_file(home: Path, endpoints: StackEndpoints) -> Path:
    """Atomically (a reader never sees half a file)."""
    path = stack_file(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, endpoints.model_dump_json(indent=2))
    return path


def remove_stack_file(home: Path, pid: int) -> None:
    """Removes the file if the stack of process `pid` wrote it (not another's, still up)."""
    path = stack_file(home)
    try:
        written_by = StackEndpoints.model_validate_json(path.read_text()).pid
    except (OSError, ValidationError):
        written_by = pid
    if written_by == pid:
        path.unlink(missing_ok=True)


def read_stack_file(home: Path) -> StackEndpoints | None:
    """The running stack's endpoints; None when no stack under `home` is up (no file, an
    unreadable one, or one whose `darl dev` is gone)."""
    try:
        endpoints = StackEndpoints.model_validate(json.loads(stack_file(home).read_text()))
    except (OSError, ValueError, ValidationError):
        return None
    if endpoints.pid and not _alive(endpoints.pid):
        return None
    return endpoints


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def user_registry() -> Path:
    """Where `darl dev` registers its home for the user's commands run from anywhere."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "darl" / "current-stack.json"


def register_stack(home: Path, pid: int) -> None:
    """Make this stack the one commands run from anywhere find (the last started wins)."""
    path = user_registry()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"home": str(home.resolve()), "pid": pid}))


def unregister_stack(pid: int) -> None:
    """Forget the registration, if this stack's process made it."""
    path = user_registry()
    try:
        registered = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if isinstance(registered, dict) and registered.get("pid") == pid:
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class FoundStack:
    """The home a command uses, the running stack there (None: none runs there), and how it
    was found, for the line that says so."""

    home: Path
    endpoints: StackEndpoints | None
    found_by: str

    def describe(self) -> str:
        if self.endpoints is None:
            return f"no running `darl dev` under {self.home} ({self.found_by})"
        return (
            f"the dev stack under {self.home} ({self.found_by}): Temporal "
            f"{self.endpoints.temporal_address}"
        )


def find_stack(home: Path | None, cwd: Path | None = None) -> FoundStack:
    """The stack a client command uses: under `home` when given (--home, DARL_HOME); else
    the running one in `.darl` of the current directory or its nearest parent; else the last
    `darl dev` the user started (if it still runs); else none, with `.darl` here as home."""
    if home is not None:
        return FoundStack(home, read_stack_file(home), "--home or DARL_HOME")
    here = (cwd or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        candidate = directory / HOME_DIR
        endpoints = read_stack_file(candidate)
        if endpoints is not None:
            found_by = "the current directory" if directory == here else "a parent directory"
            return FoundStack(candidate, endpoints, found_by)
    try:
        registered = json.loads(user_registry().read_text())
        last = Path(registered["home"])
    except (OSError, ValueError, KeyError, TypeError):
        return FoundStack(Path(HOME_DIR), None, "none found from here")
    endpoints = read_stack_file(last)
    if endpoints is None:
        return FoundStack(Path(HOME_DIR), None, "none found from here")
    return FoundStack(last, endpoints, f"the last `darl dev` started, {user_registry()}")


def on_stack(
    config: TrainingConfig, stack: StackEndpoints, only_defaults: bool = True
) -> TrainingConfig:
    """The config with its gateway, policy server and agent service on `stack`.

    With `only_defaults` (what `darl train` does) only endpoints that are the default dev
    stack's (DEFAULT_GATEWAY_URL, a sole policy server at DEFAULT_POLICY_URL, an HTTP agent
    under DEFAULT_AGENT_SERVICE_URL) are moved; any other endpoint is the user's choice and
    kept. Without it (the demo) all of them are the stack's."""
    sync = config.weight_sync
    sync_update: dict = {}
    if not only_defaults or sync.admin_urls == [DEFAULT_GATEWAY_URL.rstrip("/")]:
        sync_update |= {"gateway_admin_url": stack.gateway_url, "gateway_admin_urls": []}
    servers = [s.url.rstrip("/") for s in sync.policy_servers]
    if not only_defaults or (servers == [DEFAULT_POLICY_URL] and not _vllm(sync.policy_servers)):
        sync_update["policy_servers"] = [PolicyServerSpec(url=stack.policy_url)]
    updates: dict = {"weight_sync": sync.model_copy(update=sync_update)}
    agent = config.rollout.agent
    if isinstance(agent, HttpAgentSpec) and stack.agent_service_url is not None:
        url = _moved(agent.url, stack.agent_service_url, only_defaults)
        if url != agent.url:
            updates["rollout"] = config.rollout.model_copy(
                update={"agent": agent.model_copy(update={"url": url})}
            )
    return config.model_copy(update=updates)


def _vllm(servers: list[PolicyServerSpec]) -> bool:
    return any(s.kind != "reference" for s in servers)


def _moved(url: str, base: str, only_defaults: bool) -> str:
    if url.startswith(DEFAULT_AGENT_SERVICE_URL + "/") or url == DEFAULT_AGENT_SERVICE_URL:
        return base + url[len(DEFAULT_AGENT_SERVICE_URL) :]
    if only_defaults:
        return url
    return f"{base}/rollouts"


def model_mismatch(config: TrainingConfig, stack: StackEndpoints) -> str | None:
    """Why a run whose policy servers are the stack's cannot train there: it would start
    from another model than the one the stack's policy server serves."""
    if stack.model_dir is None:
        return None
    servers = [s.url.rstrip("/") for s in config.weight_sync.policy_servers]
    if servers != [stack.policy_url.rstrip("/")]:
        return None
    if Path(config.backend.model_dir).resolve() == Path(stack.model_dir).resolve():
        return None
    return (
        f"backend.model_dir {config.backend.model_dir} is not the model the dev stack's policy "
        f"server serves ({stack.model_dir}): write .darl/models/{Path(stack.model_dir).name} "
        "for the stack's own, or start `darl dev --model` with the run's"
    )


def endpoint_changes(before: TrainingConfig, after: TrainingConfig) -> list[str]:
    """What `on_stack` moved, one `what: from -> to` each, for `darl train` to say."""
    changes = []
    old, new = before.weight_sync, after.weight_sync
    if old.admin_urls != new.admin_urls:
        changes.append(f"gateway {', '.join(old.admin_urls)} -> {', '.join(new.admin_urls)}")
    if old.policy_servers != new.policy_servers:
        changes.append(f"policy server {old.policy_servers[0].url} -> {new.policy_servers[0].url}")
    old_agent, new_agent = before.rollout.agent, after.rollout.agent
    if (
        isinstance(old_agent, HttpAgentSpec)
        and isinstance(new_agent, HttpAgentSpec)
        and old_agent.url != new_agent.url
    ):
        changes.append(f"agent {old_agent.url} -> {new_agent.url}")
    return changes
