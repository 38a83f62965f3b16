"""Grading a Kubernetes agent (RewardSpec.grader): a second Job on the attempt's volume, after
the agent's Job has ended.

The agent's Job worked on a PersistentVolumeClaim of the attempt (`kubernetes_manifest`): its
first container put the image's repository there twice, `workspace/` (the agent's, mounted
at its workdir) and `base/` (as the image had it, mounted in no container of the agent's).
The grading Job (`kubernetes_grading_manifest`), in the agent's namespace and under its
security and RuntimeClass, has two containers:

- `darl-prepare`, DARL's image (`KubernetesSettings.grading_image`), an init container: the
  trusted steps (`sandbox.grading_job`) on the volume, with the hidden tests from a Secret
  the agent's Job never saw; it prints what it made ready (the canaries among it) to its
  log, and exits 3 when the workspace cannot be graded;
- `darl-tests`, the task's image: the listed tests under DARL's plugin, writing each outcome
  to the container's own output (which only DARL reads back, through the API), the end of
  pytest's log after them; its exit status is pytest's.

The runner reads the two logs and the exit status through the API and judges the run as the
local grader does (`sandbox.outcomes`). The grading Job belongs to the agent's Job, so both
and the volume go together.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Protocol

import kr8s
from kr8s.asyncio.objects import Job

from darl.activities.runners.kubernetes_grading_manifest import (
    LOG_MARK,
    NOT_READY_EXIT,
    PREPARE,
    TESTS,
    TIMED_OUT_EXIT,
    graded,
    grading_job_manifest,
    grading_job_name,
    wait_seconds,
)
from darl.activities.runners.kubernetes_manifest import MANAGED_BY
from darl.activities.runners.kubernetes_settings import KubernetesSettings
from darl.activities.sandbox.errors import GradingError, SandboxError
from darl.activities.sandbox.grading import hidden_test_patch, listed_tests
from darl.activities.sandbox.grading_job import (
    FAILED_MARK,
    PREPARED_MARK,
    UNGRADABLE_EXIT,
    UNGRADABLE_MARK,
    GradingTask,
)
from darl.activities.sandbox.outcomes import (
    FAILED_SHOWN,
    LOG_TAIL_BYTES,
    RESULTS_CAP_BYTES,
    Records,
    TestRun,
    commanded,
    ungradable,
)
from darl.activities.sandbox.preparation import Preparation
from darl.workflows.contracts import (
    AwaitRequest,
    GradeReport,
    RolloutSpec,
)
from darl.workflows.heartbeats import Heartbeat

# The kubelet's eviction messages for a Pod over its own storage limits
# (pkg/kubelet/eviction/helpers.go), as against the node's pressure.
OWN_STORAGE_EVICTION = re.compile(
    r"Usage of EmptyDir volume .* exceeds the limit"
    r"|Container \S+ exceeded its local ephemeral storage limit"
    r"|Pod ephemeral local storage usage exceeds the total limit of containers"
)


@dataclass(frozen=True)
class Ended:
    """How a grading Pod ended: `void` is why its tests count for nothing when the cluster
    ended them on their account (and `timed_out` when by the deadline)."""

    pod: Any
    timed_out: bool = False
    void: str | None = None


def own_storage_eviction(pod: Any) -> str | None:
    """The kubelet's message when it evicted the Pod for going over its own storage limits
    (an emptyDir's size, a container's or the Pod's ephemeral storage), not for the node's
    sake; None otherwise."""
    status = pod.raw.get("status", {})
    message = str(status.get("message") or "")
    if status.get("reason") == "Evicted" and OWN_STORAGE_EVICTION.search(message):
        return message.strip()
    return None


class JobRunner(Protocol):
    """What the grading uses of the Kubernetes runner (`kubernetes.KubernetesJobRunner`):
    its settings and its idempotent Job, Secret and Pod operations."""

    settings: KubernetesSettings

    async def api(self) -> Any: ...
    async def find(self, kind: type, name: str, api: Any, namespace: str) -> Any | None: ...
    async def create_or_find_job(self, manifest: dict, api: Any) -> Any: ...
    async def create_secret(self, metadata: dict, data: dict[str, str], api: Any) -> None: ...
    async def delete_job(self, name: str, api: Any, namespace: str) -> None: ...
    def infra_problem(self, pod: Any) -> str | None: ...
    async def watch_pods(
        self, name: str, namespace: str, api: Any, seconds: float, seen: dict[str, str]
    ) -> None: ...


class KubernetesGrading:
    """Grades the ended attempts of one runner's Jobs."""

    def __init__(self, runner: JobRunner) -> None:
        self._runner = runner
        self._settings = runner.settings

    async def grade(self, request: AwaitRequest, heartbeat: Heartbeat) -> GradeReport:
        spec, handle = request.spec, request.handle
        agent, grader = graded(spec)
        api = await self._runner.api()
        name, namespace = handle.data["job"], handle.data["namespace"]
        began = time.monotonic()
        agent_job = await self._runner.find(Job, name, api, namespace)
        if agent_job is None:
            raise GradingError(f"the attempt's Job {name} is gone, and its volume with it")
        tests = listed_tests(spec.task) if grader.kind == "swe_tests" else []
        task = GradingTask(
            tests=tests,
            test_patch=hidden_test_patch(spec.task) if tests else "",
            limits=agent.limits,
        )
        grading = grading_job_name(name)
        job = await self._runner.find(Job, grading, api, namespace)
        if job is None:
            manifest = self.grading_job(agent_job.raw, request)
            job = await self._runner.create_or_find_job(manifest, api)
        # Always, after the Job: a try that died between the two left a Job whose Pod waits
        # for its Secret (one already there is kept).
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": grading}
        owner["uid"] = job.metadata.uid
        metadata = {"name": grading, "namespace": namespace, "labels": dict(MANAGED_BY)}
        metadata["ownerReferences"] = [owner]
        await self._runner.create_secret(metadata, {"task.json": task.model_dump_json()}, api)
        ended = await self._ended_pod(grading, namespace, api, spec, heartbeat)
        if ended.void is not None:
            report = GradeReport(
                reward=0.0,
                tests=len(tests),
                failed_tests=tests[:FAILED_SHOWN],
                timed_out=ended.timed_out,
                reason=ended.void,
            )
        else:
            report = await self._report(ended.pod, tests, spec)
        return report.model_copy(update={"seconds": round(time.monotonic() - began, 3)})

    # --- the grading Job ---------------------------------------------------------------

    def grading_job(self, agent_job: dict, request: AwaitRequest) -> dict:
        """The grading Job of the attempt whose Job is `agent_job`."""
        return grading_job_manifest(agent_job, request, self._settings)

    async def _ended_pod(
        self, name: str, namespace: str, api: Any, spec: RolloutSpec, heartbeat: Heartbeat
    ) -> Ended:
        """The grading Pod once it has ended, or why the cluster ended its tests on their
        account: past the Job's deadline (the Job's controller takes the Pod), or over their
        storage (the kubelet evicts it). A Pod the infrastructure failed (an image that will
        not pull, a Pod that cannot be scheduled or was evicted for the node's sake, a
        deadline reached before the tests began) is no grade: the Job is deleted and the try
        fails, so the retry grades afresh."""
        runner = self._runner
        deadline = time.time() + wait_seconds(spec.timeouts.reward_seconds)
        tests_began = False
        while True:
            heartbeat({"grading": name})
            job = await runner.find(Job, name, api, namespace)
            if job is None:
                raise SandboxError(f"the grading Job {name} is gone")
            pods = [
                p
                async for p in api.get(
                    "pods", namespace=namespace, label_selector={"job-name": name}
                )
            ]
            pod = pods[-1] if pods else None
            if pod is not None:
                prepared = _terminated(pod, PREPARE, init=True)
                tests_began |= prepared is not None and prepared.get("exitCode") == 0
                over = own_storage_eviction(pod)
                if over is not None and tests_began:
                    return Ended(pod, void=f"the tests went over their storage ({over})")
            infra = runner.infra_problem(pod)
            if infra is not None:
                await runner.delete_job(name, api, namespace)
                raise SandboxError(f"the grading Job {name}: {infra}")
            conditions = job.raw.get("status", {}).get("conditions", [])
            if any(c.get("reason") == "DeadlineExceeded" for c in conditions):
                if tests_began:
                    seconds = spec.timeouts.reward_seconds
                    void = f"the tests did not finish within {seconds:g}s"
                    return Ended(pod, timed_out=True, void=void)
                await runner.delete_job(name, api, namespace)
                raise SandboxError(f"the grading Job {name} ran out of time before its tests")
            ended = {c.get("type") for c in conditions} & {"Complete", "Failed"}
            if pod is not None and ended:
                return Ended(pod)
            if time.time() > deadline:
                await runner.delete_job(name, api, namespace)
                raise SandboxError(f"the grading Job {name} did not end in time")
            seen = {p.name: p.metadata.get("resourceVersion") for p in pods}
            await runner.watch_pods(name, namespace, api, 5.0, seen)

    async def _report(self, pod: Any, tests: list[str], spec: RolloutSpec) -> GradeReport:
        _, grader = graded(spec)
        prepare = _terminated(pod, PREPARE, init=True)
        prepared_log = await _log(pod, PREPARE, RESULTS_CAP_BYTES)
        if prepare is None:
            raise SandboxError(f"the grading's trusted steps did not run: {prepared_log[-500:]}")
        if prepare.get("exitCode") == UNGRADABLE_EXIT:
            reason = _marked(prepared_log, UNGRADABLE_MARK) or "the workspace cannot be graded"
            return ungradable(tests, reason)
        plan = _marked(prepared_log, PREPARED_MARK)
        if prepare.get("exitCode") != 0 or plan is None:
            why = _marked(prepared_log, FAILED_MARK) or prepared_log[-500:]
            raise GradingError(f"the grading's trusted steps failed: {why}")
        preparation = Preparation.model_validate_json(plan)
        ended = _terminated(pod, TESTS)
        output = await _log(pod, TESTS, RESULTS_CAP_BYTES)
        records, _, tail = ("\n" + output).partition(f"\n{LOG_MARK}\n")
        exit_code = ended.get("exitCode") if ended is not None else None
        if exit_code == NOT_READY_EXIT:
            raise GradingError(
                f"the tests could not start in the task's image {_image(pod, TESTS)}: {tail[-500:]}"
            )
        timed_out = exit_code == TIMED_OUT_EXIT
        log_tail = tail[-LOG_TAIL_BYTES:]
        if grader.kind == "command":
            reward_seconds = spec.timeouts.reward_seconds
            return commanded(preparation.report, exit_code, timed_out, reward_seconds, log_tail)
        read = Records.read(records)
        run = TestRun(
            records=read,
            exit_code=None if timed_out else exit_code,
            timed_out=timed_out,
            # The image's Python ran pytest (checked): a run whose first record never reached
            # DARL wrote more than the container's log keeps.
            cut=len(output) >= RESULTS_CAP_BYTES or not read.started,
            log_tail=log_tail,
        )
        return preparation.graded(tests, run, spec.timeouts.reward_seconds, grader.partial_credit)


def _terminated(pod: Any, container: str, init: bool = False) -> dict | None:
    key = "initContainerStatuses" if init else "containerStatuses"
    for status in pod.raw.get("status", {}).get(key) or []:
        if status.get("name") == container:
            terminated: dict | None = status.get("state", {}).get("terminated")
            return terminated
    return None


async def _log(pod: Any, container: str, cap: int) -> str:
    """The container's log, to about `cap` bytes; SandboxError when the API cannot give it
    (a grade is never made of a log half read)."""
    lines: list[str] = []
    size = 0
    try:
        async for line in pod.logs(container=container):
            lines.append(line)
            size += len(line) + 1
            if size >= cap:
                break
    except (kr8s.ServerError, kr8s.NotFoundError, OSError) as err:
        raise SandboxError(f"the log of {pod.name}/{container} cannot be read: {err}") from err
    return "\n".join(lines)


def _image(pod: Any, container: str) -> str:
    for spec in pod.raw.get("spec", {}).get("containers") or []:
        if spec.get("name") == container:
            return str(spec.get("image"))
    return "(unknown)"


def _marked(log: str, mark: str) -> str | None:
    """The rest of the last line of `log` that starts with `mark`."""
    for line in reversed(log.splitlines()):
        if line.startswith(mark + " "):
            return line[len(mark) + 1 :]
    return None
