"""Kubernetes Job runner: each attempt's agent is a Job (kr8s, async API), named from the
rollout and attempt, so a retried launch finds the Job already there and a new worker
re-attaches to it by name (rule 3).

Failures are classified from Pod and container status fields, never from message text: an
image that cannot be pulled, a Pod that cannot be scheduled, an eviction or a lost node is an
infra failure (the attempt is retried); a non-zero exit or the deadline is the agent's result;
OOMKilled is reported as such. Completion is learned from a watch on the attempt's Pods, with
a re-list whenever the watch breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import logging
import re
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import kr8s
import yaml
from kr8s.asyncio.objects import Job, Secret

from darl.activities.agent_contract import AgentContract
from darl.activities.errors import agent_lost_error, agent_spec_error, agent_stopped_error
from darl.activities.runners.base import AgentRunner, agent_deadline, agent_heartbeat_interval
from darl.workflows.contracts import (
    AgentExit,
    AgentHandle,
    AwaitRequest,
    KubernetesAgentSpec,
    LaunchRequest,
    RolloutSpec,
)
from darl.workflows.heartbeats import Heartbeat

log = logging.getLogger(__name__)

MANAGED_BY = {"app.kubernetes.io/managed-by": "darl"}
TOKEN_KEY = "token"
# Variables of the agent contract that carry the rollout token: from the Secret, not plain env.
TOKEN_VARS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AGL_KEY")
# Container waiting reasons that mean the image will not run here.
IMAGE_FAILURES = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
)
LOG_TAIL_LINES = 50


@dataclass(frozen=True)
class KubernetesSettings:
    namespace: str = "darl-agents"
    # None: kr8s finds the cluster (kubeconfig, or the in-cluster service account).
    api_url: str | None = None
    jobs_per_minute: float = 120.0
    ttl_seconds_after_finished: int = 3600
    # A Pod the scheduler cannot place for this long is an infra failure.
    unschedulable_seconds: float = 120.0
    run_as_user: int = 10001


def job_name(rollout_id: str, attempt: int) -> str:
    """A DNS-1123 label, deterministic in (rollout, attempt): `darl-<slug>-<hash>-a<n>`."""
    slug = re.sub(r"[^a-z0-9-]+", "-", rollout_id.lower()).strip("-")[:32].strip("-")
    digest = hashlib.sha256(rollout_id.encode()).hexdigest()[:8]
    return f"darl-{slug}-{digest}-a{attempt}"


def yaml_escape(value: object) -> str:
    """Agent Lightning's template filter: the value as a double-quoted YAML (JSON) string."""
    return json.dumps(str(value), ensure_ascii=True)


def label_value(value: str) -> str:
    """A valid label value (<= 63 chars, alphanumeric ends); the full value is an annotation."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", value)[:63]
    return cleaned.strip("-_.") or "x"


class JobRateLimiter:
    """At most `per_minute` Job creations in any sliding minute (per worker process)."""

    def __init__(self, per_minute: float) -> None:
        self.per_minute = per_minute
        self._created: deque[float] = deque()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            while True:
                now = time.monotonic()
                while self._created and now - self._created[0] >= 60:
                    self._created.popleft()
                if len(self._created) < self.per_minute:
                    self._created.append(now)
                    return
                await asyncio.sleep(60 - (now - self._created[0]))


class KubernetesJobRunner(AgentRunner):
    kind = "kubernetes"

    def __init__(self, settings: KubernetesSettings) -> None:
        self.settings = settings
        self._api: Any = None
        self._limiter = JobRateLimiter(settings.jobs_per_minute)
        self._templates = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
        self._templates.filters["yaml_escape"] = yaml_escape

    async def api(self) -> Any:
        if self._api is None:
            self._api = await kr8s.asyncio.api(url=self.settings.api_url)
        return self._api

    # --- launch ----------------------------------------------------------------------------

    async def launch(self, request: LaunchRequest, contract: AgentContract) -> AgentHandle:
        """Create the attempt's Job (or find it, created by an earlier try) and the Secret
        with its token, owned by the Job so it goes when the Job goes."""
        spec = request.spec
        name = job_name(spec.rollout_id, request.attempt)
        api = await self.api()
        if await self._stopped(name):
            raise agent_stopped_error(f"attempt {request.attempt} of {spec.rollout_id} was stopped")
        manifest = self.job_manifest(spec, request.attempt, contract)
        job = await self._create_or_find_job(manifest, api)
        await self._ensure_secret(job, contract, api)
        return AgentHandle(
            kind=self.kind,
            rollout_id=spec.rollout_id,
            attempt=request.attempt,
            started_at=time.time(),
            data={"namespace": self.settings.namespace, "job": name, "uid": job.metadata.uid},
        )

    def job_manifest(self, spec: RolloutSpec, attempt: int, contract: AgentContract) -> dict:
        """The user's Job (template or image) with DARL's fields enforced on top."""
        agent = spec.agent
        if not isinstance(agent, KubernetesAgentSpec):
            raise agent_spec_error(f"the kubernetes runner cannot run a {agent.kind!r} agent")
        job = self._user_job(agent, spec, attempt)
        name = job_name(spec.rollout_id, attempt)
        labels = {
            **MANAGED_BY,
            "darl.dev/run": label_value(spec.run_id),
            "darl.dev/rollout": label_value(spec.rollout_id),
            "darl.dev/attempt": str(attempt),
        }
        annotations = {"darl.dev/rollout-id": spec.rollout_id, "darl.dev/run-id": spec.run_id}
        metadata = job.setdefault("metadata", {})
        metadata.update(name=name, namespace=self.settings.namespace)
        metadata["labels"] = {**(metadata.get("labels") or {}), **labels}
        metadata["annotations"] = {**(metadata.get("annotations") or {}), **annotations}
        job_spec = job.setdefault("spec", {})
        job_spec.update(
            backoffLimit=0,
            activeDeadlineSeconds=max(1, int(spec.timeouts.agent_seconds)),
            ttlSecondsAfterFinished=self.settings.ttl_seconds_after_finished,
        )
        template = job_spec.setdefault("template", {})
        pod_meta = template.setdefault("metadata", {})
        pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **labels}
        pod = template.setdefault("spec", {})
        pod["restartPolicy"] = "Never"
        pod["automountServiceAccountToken"] = False
        self._enforce_security(pod)
        containers = pod.get("containers") or []
        if not containers:
            raise agent_spec_error("the Job template has no containers")
        env = self._contract_env(name, contract, {**agent.env, **contract.env})
        for container in containers:
            given = [e for e in container.get("env") or [] if e.get("name") not in env]
            container["env"] = [*given, *env.values()]
        return job

    def _user_job(self, agent: KubernetesAgentSpec, spec: RolloutSpec, attempt: int) -> dict:
        if agent.image is not None:
            container: dict[str, Any] = {"name": "agent", "image": agent.image}
            if agent.command:
                container["command"] = list(agent.command)
            return {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "spec": {"template": {"spec": {"containers": [container]}}},
            }
        path = Path(agent.job_template or "")
        try:
            source = path.read_text()
            # DARL's variables, and Agent Lightning's (`input`, `job_name`), so a template
            # written for its controller renders unchanged.
            rendered = self._templates.from_string(source).render(
                task=spec.task,
                input=spec.task,
                job_name=job_name(spec.rollout_id, attempt),
                rollout_id=spec.rollout_id,
                attempt=attempt,
                run_id=spec.run_id,
                mode=spec.mode.value,
            )
            docs = [doc for doc in yaml.safe_load_all(rendered) if doc is not None]
        except OSError as err:
            raise agent_spec_error(f"job template {path}: {err}") from err
        except (jinja2.TemplateError, yaml.YAMLError) as err:
            raise agent_spec_error(f"job template {path} does not render: {err}") from err
        if len(docs) != 1 or not isinstance(docs[0], dict) or docs[0].get("kind") != "Job":
            raise agent_spec_error(f"job template {path} does not render one Job manifest")
        return copy.deepcopy(docs[0])

    def _enforce_security(self, pod: dict) -> None:
        """Non-root defaults the template may tighten but not loosen."""
        context = pod.setdefault("securityContext", {})
        context["runAsNonRoot"] = True
        if context.get("runAsUser") in (None, 0):
            context["runAsUser"] = self.settings.run_as_user
        context.setdefault("seccompProfile", {"type": "RuntimeDefault"})
        for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            box = container.setdefault("securityContext", {})
            box["allowPrivilegeEscalation"] = False
            box["privileged"] = False
            if box.get("runAsUser") == 0:
                box["runAsUser"] = self.settings.run_as_user
            if box.get("runAsNonRoot") is False:
                box["runAsNonRoot"] = True
            capabilities = box.setdefault("capabilities", {})
            capabilities.pop("add", None)
            capabilities["drop"] = ["ALL"]

    @staticmethod
    def _contract_env(name: str, contract: AgentContract, values: dict) -> dict[str, dict]:
        env: dict[str, dict] = {}
        for key, value in values.items():
            if key in TOKEN_VARS:
                env[key] = {
                    "name": key,
                    "valueFrom": {"secretKeyRef": {"name": name, "key": TOKEN_KEY}},
                }
            else:
                env[key] = {"name": key, "value": str(value)}
        return env

    async def _create_or_find_job(self, manifest: dict, api: Any) -> Any:
        name = manifest["metadata"]["name"]
        existing = await self._get(Job, name, api)
        if existing is not None:
            return existing
        await self._limiter.acquire()
        job = await Job(manifest, api=api)
        try:
            await job.create()
        except kr8s.ServerError as err:
            if _status_code(err) != 409:
                raise
            found = await self._get(Job, name, api)
            if found is None:
                raise
            return found
        return job

    async def _ensure_secret(self, job: Any, contract: AgentContract, api: Any) -> None:
        name = job.metadata.name
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job.metadata.uid}
        await self._create_secret(
            {"name": name, "labels": dict(MANAGED_BY), "ownerReferences": [owner]},
            {TOKEN_KEY: contract.token},
            api,
        )

    async def _create_secret(self, metadata: dict, data: dict[str, str], api: Any) -> None:
        """Create a Secret in the agents' namespace; one already there is kept."""
        secret = await Secret(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {**metadata, "namespace": self.settings.namespace},
                "stringData": data,
            },
            api=api,
        )
        try:
            await secret.create()
        except kr8s.ServerError as err:
            if _status_code(err) != 409:
                raise

    # --- wait ------------------------------------------------------------------------------

    async def wait(
        self, request: AwaitRequest, contract: AgentContract, heartbeat: Heartbeat
    ) -> AgentExit:
        spec, handle = request.spec, request.handle
        name = handle.data["job"]
        api = await self.api()
        interval = agent_heartbeat_interval(spec.timeouts.heartbeat_seconds)
        deadline = agent_deadline(request)
        while True:
            heartbeat({"job": name})
            outcome, seen = await self._outcome(name, api)
            if outcome is not None:
                return outcome
            if time.time() > deadline:
                await self.kill(handle)
                return AgentExit(exit_code=None, timed_out=True)
            await self._watch_pods(name, api, interval, seen)

    async def _watch_pods(self, name: str, api: Any, seconds: float, seen: dict[str, str]) -> None:
        """Return on the first change of the attempt's Pods since the list that gave `seen`
        (name -> resourceVersion), or after `seconds`, or when the watch breaks (the caller
        re-lists either way)."""

        async def first_change() -> None:
            async for _, pod in api.watch(
                "pods", namespace=self.settings.namespace, label_selector={"job-name": name}
            ):
                # A watch opens with an ADDED for every Pod there is: not news.
                if seen.get(pod.name) != pod.metadata.get("resourceVersion"):
                    return

        with contextlib.suppress(TimeoutError, kr8s.ServerError, OSError):
            await asyncio.wait_for(first_change(), timeout=seconds)

    async def _outcome(self, name: str, api: Any) -> tuple[AgentExit | None, dict[str, str]]:
        """How the attempt ended (None while it runs) and the Pods' resourceVersions seen;
        raises agent_lost_error for an infra failure."""
        job = await self._get(Job, name, api)
        if job is None:
            raise agent_lost_error(f"Job {name} is gone")
        pods = [
            pod
            async for pod in api.get(
                "pods", namespace=self.settings.namespace, label_selector={"job-name": name}
            )
        ]
        pod = pods[-1] if pods else None
        seen = {p.name: p.metadata.get("resourceVersion") for p in pods}
        infra = _infra_problem(pod, self.settings.unschedulable_seconds)
        if infra is not None:
            await self._delete(name, api)
            raise agent_lost_error(f"Job {name}: {infra}")
        conditions = {c.get("type"): c for c in job.raw.get("status", {}).get("conditions", [])}
        failed = conditions.get("Failed") or conditions.get("FailureTarget")
        done = conditions.get("Complete") or conditions.get("SuccessCriteriaMet")
        if failed and failed.get("status") == "True":
            tail = await self._log_tail(pod)
            if failed.get("reason") == "DeadlineExceeded":
                return AgentExit(exit_code=None, timed_out=True, log_tail=tail), seen
            deleted = _deleted_under_the_agent(pod)
            if deleted is not None:
                # Not the agent's doing: its next attempt resumes by replay (rule 10).
                await self._delete(name, api)
                raise agent_lost_error(f"Job {name}: {deleted}; log tail: {tail[-500:]}")
            terminated = _terminated(pod)
            return AgentExit(
                exit_code=terminated.get("exitCode", 1) if terminated else 1,
                oom_killed=bool(terminated and terminated.get("reason") == "OOMKilled"),
                log_tail=tail,
            ), seen
        if done and done.get("status") == "True":
            return AgentExit(exit_code=0, log_tail=await self._log_tail(pod)), seen
        return None, seen

    async def _log_tail(self, pod: Any) -> str:
        if pod is None:
            return ""
        try:
            lines = [line async for line in pod.logs(tail_lines=LOG_TAIL_LINES)]
        except (kr8s.ServerError, kr8s.NotFoundError, OSError) as err:
            return f"(no log: {err})"
        return "\n".join(lines)

    # --- kill and stop --------------------------------------------------------------------

    async def kill(self, handle: AgentHandle) -> None:
        await self._delete(handle.data["job"], await self.api())

    async def stop(self, request: LaunchRequest) -> None:
        """Mark the attempt stopped (a later launch refuses), then delete its Job."""
        name = job_name(request.spec.rollout_id, request.attempt)
        api = await self.api()
        marker = {"name": f"{name}-stopped", "labels": {**MANAGED_BY, "darl.dev/stopped": "true"}}
        await self._create_secret(marker, {}, api)
        await self._delete(name, api)

    async def _stopped(self, name: str) -> bool:
        return await self._get(Secret, f"{name}-stopped", await self.api()) is not None

    async def _delete(self, name: str, api: Any) -> None:
        """Delete the Job with its Pods (and the Secret it owns); idempotent."""
        job = await self._get(Job, name, api)
        if job is None:
            return
        try:
            await job.delete(propagation_policy="Foreground")
        except kr8s.NotFoundError:
            return

    async def _get(self, kind: type, name: str, api: Any) -> Any | None:
        """The object, or None at once on a 404 (kr8s's `get` keeps re-listing for seconds)."""
        obj = kind({"metadata": {"name": name, "namespace": self.settings.namespace}}, api=api)
        try:
            await obj.refresh()
        except kr8s.NotFoundError:
            return None
        return obj

    async def aclose(self) -> None:
        self._api = None


def _status_code(err: Exception) -> int | None:
    response = getattr(err, "response", None)
    return getattr(response, "status_code", None)


def _terminated(pod: Any) -> dict | None:
    if pod is None:
        return None
    for status in pod.raw.get("status", {}).get("containerStatuses", []) or []:
        terminated = status.get("state", {}).get("terminated")
        if terminated:
            return terminated
    return None


def _deleted_under_the_agent(pod: Any) -> str | None:
    """Why the Pod of a Job that failed (not at its deadline) was taken from its agent, if it
    was: deleted (gone, or terminating: DARL deletes only the Job, and never before the
    agent ended), or disrupted (preempted, evicted, a tainted node: DisruptionTarget)."""
    if pod is None:
        return "its Pod was deleted"
    if pod.raw.get("metadata", {}).get("deletionTimestamp"):
        return "its Pod was deleted while the agent ran"
    for condition in pod.raw.get("status", {}).get("conditions", []) or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            return f"its Pod was disrupted ({condition.get('reason', 'unknown reason')})"
    return None


def _infra_problem(pod: Any, unschedulable_seconds: float) -> str | None:
    """What makes an attempt an infra failure, read from status fields."""
    if pod is None:
        return None
    status = pod.raw.get("status", {})
    if status.get("reason") in {"Evicted", "NodeLost", "Preempting"}:
        return f"the Pod was {status['reason'].lower()}"
    if status.get("phase") == "Unknown":
        return "the Pod's node was lost"
    for container in status.get("containerStatuses", []) or []:
        waiting = container.get("state", {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_FAILURES:
            return f"image {container.get('image')} cannot be pulled ({waiting['reason']})"
    for condition in status.get("conditions", []) or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            created = pod.raw.get("metadata", {}).get("creationTimestamp")
            age = _age_seconds(created)
            if age is None or age >= unschedulable_seconds:
                return f"the Pod cannot be scheduled: {condition.get('message', '')}".strip()
    return None


def _age_seconds(timestamp: str | None) -> float | None:
    if not timestamp:
        return None
    try:
        created = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return time.time() - created.timestamp()
