"""Grading a Kubernetes agent (RewardSpec.grader): a second Job on the attempt's volume, after
the agent's Job has ended.

The agent's Job worked on a PersistentVolumeClaim of the attempt (`kubernetes_manifest`): its
first container put the image's repository there twice, `workspace/` (the agent's, mounted
at its workdir) and `base/` (as the image had it, mounted in no container of the agent's).
The grading Job, in the agent's namespace and under its security and RuntimeClass, has two
containers:

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

import copy
import time
from typing import TYPE_CHECKING, Any

import kr8s
from kr8s.asyncio.objects import Job

from darl.activities.runners.kubernetes_manifest import (
    ATTEMPT_VOLUME,
    MANAGED_BY,
    TOKEN_VARS,
    attempt_claim,
)
from darl.activities.sandbox.errors import GradingError, SandboxError
from darl.activities.sandbox.grading import hidden_test_patch, listed_tests
from darl.activities.sandbox.grading_job import (
    FAILED_MARK,
    GRADING_SUBPATH,
    PREPARED_MARK,
    UNGRADABLE_EXIT,
    UNGRADABLE_MARK,
    GradingTask,
)
from darl.activities.sandbox.outcomes import (
    FAILED_SHOWN,
    Records,
    TestRun,
)
from darl.activities.sandbox.preparation import Preparation
from darl.workflows.contracts import (
    AwaitRequest,
    GradeReport,
    KubernetesAgentSpec,
)
from darl.workflows.heartbeats import Heartbeat

if TYPE_CHECKING:
    from darl.activities.runners.kubernetes import KubernetesJobRunner

PREPARE, TESTS = "darl-prepare", "darl-tests"
# What the trusted steps may take on top of the tests' own timeout.
PREPARE_SECONDS = 600
# The tests container's output: the plugin's records, then this line, then pytest's log.
LOG_MARK = "DARL-TESTS-LOG"
RESULTS_CAP_BYTES = 16 * 1024 * 1024
LOG_TAIL_BYTES = 8 * 1024
# `timeout`'s own exit status when the command ran past it.
TIMED_OUT_EXIT = 124
# The tests container's command: pytest (or the grader's command) with the plugin's records
# on the container's output, under the tests' timeout where the image has `timeout`.
TESTS_SCRIPT = r"""
seconds="$1"; shift
exec 3>&1 >/tmp/darl-tests.log 2>&1
if command -v timeout >/dev/null; then
    timeout -k 10 "$seconds" "$@"
else
    "$@"
fi
code=$?
exec >&3 2>&1
echo DARL-TESTS-LOG
tail -c 8192 /tmp/darl-tests.log
exit $code
"""
# The contract's variables a grading never gets (the tests never hold the rollout token).
CONTRACT_PREFIXES = ("DARL_", "OPENAI_", "ANTHROPIC_", "AGL_", "TRACEPARENT")


def grading_job_name(job: str) -> str:
    return f"{job}-grade"


class KubernetesGrading:
    """Grades the ended attempts of one runner's Jobs."""

    def __init__(self, runner: KubernetesJobRunner) -> None:
        self._runner = runner
        self._settings = runner.settings

    async def grade(self, request: AwaitRequest, heartbeat: Heartbeat) -> GradeReport:
        spec, handle = request.spec, request.handle
        agent, grader = spec.agent, spec.reward.grader
        if not isinstance(agent, KubernetesAgentSpec) or grader is None:
            raise GradingError("a Kubernetes grading needs a Kubernetes agent and a grader")
        api = await self._runner.api()
        name, namespace = handle.data["job"], handle.data["namespace"]
        began = time.monotonic()
        agent_job = await self._runner._get(Job, name, api, namespace)
        if agent_job is None:
            raise GradingError(f"the attempt's Job {name} is gone, and its volume with it")
        tests = listed_tests(spec.task) if grader.kind == "swe_tests" else []
        task = GradingTask(
            kind=grader.kind,
            tests=tests,
            test_patch=hidden_test_patch(spec.task) if tests else "",
            limits=agent.limits,
        )
        grading = grading_job_name(name)
        job = await self._runner._get(Job, grading, api, namespace)
        if job is None:
            manifest = self.grading_job(agent_job.raw, request)
            job = await self._runner._create_or_find_job(manifest, api)
            owner = {"apiVersion": "batch/v1", "kind": "Job", "name": grading}
            owner["uid"] = job.metadata.uid
            metadata = {"name": grading, "namespace": namespace, "labels": dict(MANAGED_BY)}
            metadata["ownerReferences"] = [owner]
            await self._runner._create_secret(metadata, {"task.json": task.model_dump_json()}, api)
        pod = await self._ended_pod(grading, namespace, api, request, heartbeat)
        report = await self._report(pod, tests, grader.partial_credit, request)
        return report.model_copy(update={"seconds": round(time.monotonic() - began, 3)})

    # --- the grading Job ---------------------------------------------------------------

    def grading_job(self, agent_job: dict, request: AwaitRequest) -> dict:
        """The grading Job of the attempt whose Job is `agent_job`: its Pod made from the
        agent's (namespace, security, RuntimeClass, the agent container's image and
        environment less the agent contract), owned by the agent's Job."""
        spec = request.spec
        agent = spec.agent
        if not isinstance(agent, KubernetesAgentSpec) or spec.reward.grader is None:
            raise GradingError("a Kubernetes grading needs a Kubernetes agent and a grader")
        grader = spec.reward.grader
        meta = agent_job["metadata"]
        name = grading_job_name(meta["name"])
        pod = copy.deepcopy(agent_job["spec"]["template"]["spec"])
        agent_container = pod["containers"][0]
        root = self._settings.grading_mount_root
        attempt, run, task = f"{root}/attempt", f"{root}/run", f"{root}/task"
        security = copy.deepcopy(agent_container.get("securityContext") or {})
        prepare = {
            "name": PREPARE,
            "image": self._settings.grading_image,
            "command": [
                self._settings.grading_python,
                *("-m", "darl.activities.sandbox.grading_job"),
                *("--attempt", attempt, "--task", f"{task}/task.json", "--run", run),
                *("--workdir", agent.workdir),
            ],
            "env": [{"name": "HOME", "value": "/tmp"}],
            "securityContext": security,
            "volumeMounts": [
                {"name": ATTEMPT_VOLUME, "mountPath": attempt},
                {"name": "darl-task", "mountPath": task, "readOnly": True},
                {"name": "darl-run", "mountPath": run},
            ],
        }
        limits = agent.limits
        if grader.kind == "swe_tests":
            command = [
                agent.test_python,
                *("-I", "-B", f"{run}/pytest_results.py", "--results-fd", "3"),
                *("--root", agent.workdir, "--args-file", f"{run}/args.json"),
            ]
        else:
            command = list(grader.command or [])
        env = [
            var
            for var in agent_container.get("env") or []
            if not var.get("name", "").startswith(CONTRACT_PREFIXES)
            and var.get("name") not in TOKEN_VARS
        ]
        tests = {
            "name": TESTS,
            "image": agent_container["image"],
            "command": ["/bin/sh", "-c", TESTS_SCRIPT, TESTS],
            "args": [str(int(spec.timeouts.reward_seconds)), *command],
            "workingDir": agent.workdir,
            "env": env,
            "securityContext": copy.deepcopy(security),
            "resources": {"limits": {"memory": f"{limits.memory_mb}Mi"}},
            "volumeMounts": [
                {
                    "name": ATTEMPT_VOLUME,
                    "mountPath": agent.workdir,
                    "subPath": f"{GRADING_SUBPATH}/testbed",
                },
                {"name": "darl-run", "mountPath": run, "readOnly": True},
                {"name": "darl-tmp", "mountPath": "/tmp"},
            ],
        }
        pod.update(
            initContainers=[prepare],
            containers=[tests],
            restartPolicy="Never",
            automountServiceAccountToken=False,
            volumes=[
                {
                    "name": ATTEMPT_VOLUME,
                    "persistentVolumeClaim": {"claimName": attempt_claim(meta["name"])},
                },
                {"name": "darl-task", "secret": {"secretName": name}},
                {"name": "darl-run", "emptyDir": {}},
                {"name": "darl-tmp", "emptyDir": {"sizeLimit": f"{limits.tmp_mb}Mi"}},
            ],
        )
        # The Pod has no `app.kubernetes.io/managed-by` label: the agents' NetworkPolicy,
        # which lets DARL's Pods reach the gateway, selects by it; a grading Pod gets only the
        # namespace's default-deny, no traffic at all.
        labels = {
            **{k: v for k, v in (meta.get("labels") or {}).items() if k.startswith("darl.dev/")},
            "darl.dev/role": "grading",
        }
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"]}
        owner |= {"uid": meta["uid"], "controller": False, "blockOwnerDeletion": True}
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": name,
                "namespace": meta["namespace"],
                "labels": {**labels, **MANAGED_BY},
                "annotations": dict(meta.get("annotations") or {}),
                "ownerReferences": [owner],
            },
            "spec": {
                "backoffLimit": 0,
                "activeDeadlineSeconds": PREPARE_SECONDS + int(spec.timeouts.reward_seconds) + 60,
                "ttlSecondsAfterFinished": self._settings.ttl_seconds_after_finished,
                "template": {"metadata": {"labels": labels}, "spec": pod},
            },
        }

    async def _ended_pod(
        self,
        name: str,
        namespace: str,
        api: Any,
        request: AwaitRequest,
        heartbeat: Heartbeat,
    ) -> Any:
        """The grading Pod once it has ended. A Pod the infrastructure failed (an image that
        will not pull, a Pod that cannot be scheduled or was evicted) is no grade: the Job is
        deleted and the try fails, so the retry grades afresh."""
        runner = self._runner
        deadline = time.time() + PREPARE_SECONDS + request.spec.timeouts.reward_seconds + 120
        while True:
            heartbeat({"grading": name})
            job = await runner._get(Job, name, api, namespace)
            if job is None:
                raise SandboxError(f"the grading Job {name} is gone")
            pods = [
                p
                async for p in api.get(
                    "pods", namespace=namespace, label_selector={"job-name": name}
                )
            ]
            pod = pods[-1] if pods else None
            infra = runner.infra_problem(pod)
            if infra is not None:
                await runner._delete(name, api, namespace)
                raise SandboxError(f"the grading Job {name}: {infra}")
            conditions = {c.get("type") for c in job.raw.get("status", {}).get("conditions", [])}
            if pod is not None and conditions & {"Complete", "Failed"}:
                return pod
            if time.time() > deadline:
                await runner._delete(name, api, namespace)
                raise SandboxError(f"the grading Job {name} did not end in time")
            seen = {p.name: p.metadata.get("resourceVersion") for p in pods}
            await runner._watch_pods(name, namespace, api, 5.0, seen)

    async def _report(
        self, pod: Any, tests: list[str], partial_credit: float, request: AwaitRequest
    ) -> GradeReport:
        prepare = _terminated(pod, PREPARE, init=True)
        prepared_log = await _log(pod, PREPARE, RESULTS_CAP_BYTES)
        if prepare is None:
            raise SandboxError(f"the grading's trusted steps did not run: {prepared_log[-500:]}")
        if prepare.get("exitCode") == UNGRADABLE_EXIT:
            reason = _marked(prepared_log, UNGRADABLE_MARK) or "the workspace cannot be graded"
            return GradeReport(
                reward=0.0,
                tests=len(tests),
                failed_tests=tests[:FAILED_SHOWN],
                reason=f"not graded: {reason}",
            )
        plan = _marked(prepared_log, PREPARED_MARK)
        if prepare.get("exitCode") != 0 or plan is None:
            why = _marked(prepared_log, FAILED_MARK) or prepared_log[-500:]
            raise GradingError(f"the grading's trusted steps failed: {why}")
        preparation = Preparation.model_validate_json(plan)
        ended = _terminated(pod, TESTS)
        output = await _log(pod, TESTS, RESULTS_CAP_BYTES)
        records, _, tail = ("\n" + output).partition(f"\n{LOG_MARK}\n")
        exit_code = ended.get("exitCode") if ended is not None else None
        timed_out = (
            exit_code == TIMED_OUT_EXIT
            or pod.raw.get("status", {}).get("reason") == "DeadlineExceeded"
        )
        if request.spec.reward.grader is not None and request.spec.reward.grader.kind == "command":
            ok = exit_code == 0 and not timed_out
            return preparation.report.model_copy(
                update={
                    "reward": 1.0 if ok else 0.0,
                    "exit_code": exit_code,
                    "timed_out": timed_out,
                    "log_tail": tail[-LOG_TAIL_BYTES:],
                    "reason": f"the command exited {exit_code}",
                }
            )
        run = TestRun(
            records=Records.read(records),
            exit_code=None if timed_out else exit_code,
            timed_out=timed_out,
            cut=len(output) >= RESULTS_CAP_BYTES,
            log_tail=tail[-LOG_TAIL_BYTES:],
        )
        if not run.records.started and not timed_out:
            raise GradingError(
                f"pytest did not start in the task's image ({request.spec.agent}): {output[-500:]}"
            )
        return preparation.graded(tests, run, request.spec.timeouts.reward_seconds, partial_credit)


def _terminated(pod: Any, container: str, init: bool = False) -> dict | None:
    key = "initContainerStatuses" if init else "containerStatuses"
    for status in pod.raw.get("status", {}).get(key) or []:
        if status.get("name") == container:
            terminated: dict | None = status.get("state", {}).get("terminated")
            return terminated
    return None


async def _log(pod: Any, container: str, cap: int) -> str:
    lines: list[str] = []
    size = 0
    try:
        async for line in pod.logs(container=container):
            lines.append(line)
            size += len(line) + 1
            if size >= cap:
                break
    except (kr8s.ServerError, kr8s.NotFoundError, OSError) as err:
        lines.append(f"(no log: {err})")
    return "\n".join(lines)


def _marked(log: str, mark: str) -> str | None:
    """The rest of the last line of `log` that starts with `mark`."""
    for line in reversed(log.splitlines()):
        if line.startswith(mark + " "):
            return line[len(mark) + 1 :]
    return None
