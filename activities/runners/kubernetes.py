"""Kubernetes Job runner: each attempt's agent is a Job (kr8s, async API), named from the
rollout and attempt, so a retried launch finds the Job already there and a new worker
re-attaches to it by name (rule 3).

Failures are classified from Pod and container status fields (`kubernetes_pods`), never
from message text: an image that cannot be pulled, a Pod that cannot be scheduled, an eviction
or a lost node is an infra failure (the attempt is retried); a non-zero exit or the deadline is
the agent's result; OOMKilled is reported as such. Completion is learned from a watch on the
attempt's Pods, with a re-list whenever the watch breaks.

The Job itself, and the security fields enforced over its template (non-root, or root only in
a sandbox namespace under gVisor), are `kubernetes_manifest`'s; the runner's settings are
`kubernetes_settings`'s; grading an ended attempt is `kubernetes_grading`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from typing import Any

import kr8s
from kr8s.asyncio.objects import Job, PersistentVolumeClaim, Secret

from darl.activities.agent_contract import AgentContract
from darl.activities.errors import agent_lost_error, agent_spec_error, agent_stopped_error
from darl.activities.runners.base import AgentRunner, agent_deadline, agent_heartbeat_interval
from darl.activities.runners.kubernetes_grading import KubernetesGrading
from darl.activities.runners.kubernetes_manifest import (
    MANAGED_BY,
    TASK_KEY,
    TASK_SECRET_MAX_BYTES,
    TOKEN_KEY,
    JobManifests,
    job_name,
)
from darl.activities.runners.kubernetes_pods import (
    deleted_under_the_agent,
    first_terminated,
    pod_infra_problem,
)
from darl.activities.runners.kubernetes_settings import KubernetesSettings, quantity_bytes
from darl.workflows.contracts import (
    AgentExit,
    AgentHandle,
    AwaitRequest,
    GradeReport,
    KubernetesAgentSpec,
    LaunchRequest,
    RolloutSpec,
)
from darl.workflows.heartbeats import Heartbeat

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 50


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
        self._manifests = JobManifests(settings)
        self._grading = KubernetesGrading(self)

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
        if spec.reward.grader is not None:
            self._check_gradable(spec)
        task = json.dumps(spec.agent_task())
        if len(task.encode()) > TASK_SECRET_MAX_BYTES:
            raise agent_spec_error(
                f"the task is {len(task.encode()):,} bytes as JSON; a Kubernetes agent's task "
                f"travels in its attempt's Secret, at most {TASK_SECRET_MAX_BYTES:,}"
            )
        manifest = self.job_manifest(spec, request.attempt, contract)
        namespace = manifest["metadata"]["namespace"]
        job = await self.create_or_find_job(manifest, api)
        await self._ensure_secret(job, contract, task, api)
        if spec.reward.grader is not None:
            await self._create(PersistentVolumeClaim, self._manifests.claim(job), api)
        return AgentHandle(
            kind=self.kind,
            rollout_id=spec.rollout_id,
            attempt=request.attempt,
            started_at=time.time(),
            data={"namespace": namespace, "job": name, "uid": job.metadata.uid},
        )

    def job_manifest(self, spec: RolloutSpec, attempt: int, contract: AgentContract) -> dict:
        """The attempt's Job as this runner creates it (see `kubernetes_manifest`)."""
        return self._manifests.job(spec, attempt, contract)

    async def create_or_find_job(self, manifest: dict, api: Any) -> Any:
        name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
        existing = await self.find(Job, name, api, namespace)
        if existing is not None:
            return existing
        await self._limiter.acquire()
        job = await Job(manifest, api=api)
        try:
            await job.create()
        except kr8s.ServerError as err:
            if _status_code(err) != 409:
                raise
            found = await self.find(Job, name, api, namespace)
            if found is None:
                raise
            return found
        return job

    async def _ensure_secret(self, job: Any, contract: AgentContract, task: str, api: Any) -> None:
        """The Secret of the attempt's token and task, beside its Job (an owner must be in the
        same namespace)."""
        name = job.metadata.name
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job.metadata.uid}
        await self.create_secret(
            {
                "name": name,
                "namespace": job.metadata.namespace,
                "labels": dict(MANAGED_BY),
                "ownerReferences": [owner],
            },
            {TOKEN_KEY: contract.token, TASK_KEY: task},
            api,
        )

    async def create_secret(self, metadata: dict, data: dict[str, str], api: Any) -> None:
        """Create a Secret (in the agents' namespace unless `metadata` names another); one
        already there is kept."""
        manifest = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"namespace": self.settings.namespace, **metadata},
            "stringData": data,
        }
        await self._create(Secret, manifest, api)

    @staticmethod
    async def _create(kind: type, manifest: dict, api: Any) -> None:
        """Create the object; one already there (a retried try made it) is kept."""
        obj = await kind(manifest, api=api)
        try:
            await obj.create()
        except kr8s.ServerError as err:
            if _status_code(err) != 409:
                raise

    def _check_gradable(self, spec: RolloutSpec) -> None:
        """Refuse a graded attempt that could not be graded: no DARL image for the grading
        Job, or a volume too small for a workspace within its limits three times over (the
        agent's, the grader's copy, and the copy's files in git), so that the agent could
        fill it and fail its grading as DARL's."""
        if self.settings.grading_image is None:
            raise agent_spec_error(
                "a reward 'grader' for a Kubernetes agent needs DARL's image for the grading "
                "Job: start the worker with --k8s-grading-image"
            )
        agent = spec.agent
        if not isinstance(agent, KubernetesAgentSpec):
            raise agent_spec_error(f"the kubernetes runner cannot run a {agent.kind!r} agent")
        size = self.settings.grading_volume_size
        needed = 3 * agent.limits.workspace_mb * 1024 * 1024
        if needed > quantity_bytes(size):
            raise agent_spec_error(
                f"an attempt's volume ({size}, --k8s-grading-volume-size) must hold "
                f"limits.workspace_mb ({agent.limits.workspace_mb} MiB) three times over (the "
                "agent's workspace, the grader's copy, the copy in git) besides the image's "
                "repository: lower limits.workspace_mb or give the worker a larger volume"
            )

    # --- wait ------------------------------------------------------------------------------

    async def wait(
        self, request: AwaitRequest, contract: AgentContract, heartbeat: Heartbeat
    ) -> AgentExit:
        spec, handle = request.spec, request.handle
        name, namespace = handle.data["job"], handle.data["namespace"]
        api = await self.api()
        interval = agent_heartbeat_interval(spec.timeouts.heartbeat_seconds)
        deadline = agent_deadline(request)
        while True:
            heartbeat({"job": name})
            outcome, seen = await self._outcome(name, namespace, api)
            if outcome is not None:
                return outcome
            if time.time() > deadline:
                if spec.reward.grader is not None:
                    # Its Pods, not the Job: the attempt's volume goes with the Job, and
                    # what the agent left there is graded all the same.
                    await self._end_pods(name, namespace, api)
                else:
                    await self.kill(handle)
                return AgentExit(exit_code=None, timed_out=True)
            await self.watch_pods(name, namespace, api, interval, seen)

    async def watch_pods(
        self, name: str, namespace: str, api: Any, seconds: float, seen: dict[str, str]
    ) -> None:
        """Return on the first change of the attempt's Pods since the list that gave `seen`
        (name -> resourceVersion), or after `seconds`, or when the watch breaks (the caller
        re-lists either way)."""

        async def first_change() -> None:
            async for _, pod in api.watch(
                "pods", namespace=namespace, label_selector={"job-name": name}
            ):
                # A watch opens with an ADDED for every Pod there is: not news.
                if seen.get(pod.name) != pod.metadata.get("resourceVersion"):
                    return

        with contextlib.suppress(TimeoutError, kr8s.ServerError, OSError):
            await asyncio.wait_for(first_change(), timeout=seconds)

    async def _outcome(
        self, name: str, namespace: str, api: Any
    ) -> tuple[AgentExit | None, dict[str, str]]:
        """How the attempt ended (None while it runs) and the Pods' resourceVersions seen;
        raises agent_lost_error for an infra failure."""
        job = await self.find(Job, name, api, namespace)
        if job is None:
            raise agent_lost_error(f"Job {name} is gone")
        pods = [
            pod
            async for pod in api.get("pods", namespace=namespace, label_selector={"job-name": name})
        ]
        pod = pods[-1] if pods else None
        seen = {p.name: p.metadata.get("resourceVersion") for p in pods}
        infra = self.infra_problem(pod)
        if infra is not None:
            await self.delete_job(name, api, namespace)
            raise agent_lost_error(f"Job {name}: {infra}")
        conditions = {c.get("type"): c for c in job.raw.get("status", {}).get("conditions", [])}
        failed = conditions.get("Failed") or conditions.get("FailureTarget")
        done = conditions.get("Complete") or conditions.get("SuccessCriteriaMet")
        if failed and failed.get("status") == "True":
            tail = await self._log_tail(pod)
            if failed.get("reason") == "DeadlineExceeded":
                return AgentExit(exit_code=None, timed_out=True, log_tail=tail), seen
            deleted = deleted_under_the_agent(pod)
            if deleted is not None:
                # Not the agent's doing: its next attempt resumes by replay (rule 10).
                await self.delete_job(name, api, namespace)
                raise agent_lost_error(f"Job {name}: {deleted}; log tail: {tail[-500:]}")
            terminated = first_terminated(pod)
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
        await self.delete_job(handle.data["job"], await self.api(), handle.data["namespace"])

    async def grade(self, request: AwaitRequest, heartbeat: Heartbeat) -> GradeReport:
        """Grade the ended attempt in a second Job on its volume (`kubernetes_grading`)."""
        return await self._grading.grade(request, heartbeat)

    def infra_problem(self, pod: Any) -> str | None:
        """What makes the Pod's run an infra failure (read from status fields), if anything."""
        return pod_infra_problem(pod, self.settings.unschedulable_seconds)

    async def _end_pods(self, name: str, namespace: str, api: Any) -> None:
        """Delete the Job's Pods (the Job, which fails for it, stays)."""
        async for pod in api.get("pods", namespace=namespace, label_selector={"job-name": name}):
            with contextlib.suppress(kr8s.NotFoundError):
                await pod.delete()

    async def stop(self, request: LaunchRequest) -> None:
        """Mark the attempt stopped (a later launch refuses), then delete its Job, in
        whichever namespace it went to. The marker always lives in the agents' namespace:
        stopping never needs to render the template to know where the Job is."""
        name = job_name(request.spec.rollout_id, request.attempt)
        api = await self.api()
        marker = {"name": f"{name}-stopped", "labels": {**MANAGED_BY, "darl.dev/stopped": "true"}}
        await self.create_secret(marker, {}, api)
        for namespace in self._namespaces():
            await self.delete_job(name, api, namespace)

    def _namespaces(self) -> list[str]:
        sandbox = self.settings.sandbox_namespace
        return [self.settings.namespace, *([sandbox] if sandbox else [])]

    async def _stopped(self, name: str) -> bool:
        api = await self.api()
        return await self.find(Secret, f"{name}-stopped", api, self.settings.namespace) is not None

    async def delete_job(self, name: str, api: Any, namespace: str) -> None:
        """Delete the Job with its Pods (and the Secret it owns); idempotent."""
        job = await self.find(Job, name, api, namespace)
        if job is None:
            return
        try:
            await job.delete(propagation_policy="Foreground")
        except kr8s.NotFoundError:
            return

    async def find(self, kind: type, name: str, api: Any, namespace: str) -> Any | None:
        """The object, or None at once on a 404 (kr8s's `get` keeps re-listing for seconds)."""
        obj = kind({"metadata": {"name": name, "namespace": namespace}}, api=api)
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
