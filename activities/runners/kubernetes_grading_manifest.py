"""The grading Job of a Kubernetes attempt (`kubernetes_grading`), made from the agent's Job:
its two containers (`darl-prepare`, DARL's trusted steps; `darl-tests`, the task's image
running the tests under TESTS_SCRIPT), its volumes, labels, owner and deadline."""

from __future__ import annotations

import copy

from darl.activities.agent_contract import env_map_values
from darl.activities.runners.kubernetes_manifest import (
    ATTEMPT_VOLUME,
    MANAGED_BY,
    TOKEN_VARS,
    attempt_claim,
)
from darl.activities.runners.kubernetes_settings import KubernetesSettings
from darl.activities.sandbox.errors import GradingError
from darl.activities.sandbox.grading_job import GRADING_SUBPATH
from darl.activities.sandbox.outcomes import LOG_TAIL_BYTES
from darl.workflows.contracts import (
    AwaitRequest,
    GraderSpec,
    KubernetesAgentSpec,
    RolloutSpec,
)

PREPARE, TESTS = "darl-prepare", "darl-tests"
# What the trusted steps may take on top of the tests' own timeout.
PREPARE_SECONDS = 600
# The grading Job's deadline past the two (the tests end at theirs, by `timeout`).
DEADLINE_GRACE_SECONDS = 60
# The tests container's output: the plugin's records, then this line, then pytest's log.
LOG_MARK = "DARL-TESTS-LOG"
# `timeout`'s own exit status when the command ran past it.
TIMED_OUT_EXIT = 124
# The tests container's exit status when the tests could not start (its /tmp, or a Python
# that cannot run pytest); a command that exits so itself exits 96 instead.
NOT_READY_EXIT = 97
# The tests container's command. The records of DARL's plugin go to the container's output
# (fd 3); pytest's own output to a log in /tmp, read back through a descriptor opened before
# the tests ran (they may put a FIFO or a link in its place). Before the tests, the image's
# Python is checked from `/` (nothing of the workspace on its path): only then is a run
# whose records never reached DARL the tests' doing. Whether the tests ran is told by the
# exit status, which only this shell (the container's first process) sets.
TESTS_SCRIPT = rf"""
seconds="$1"; python="$2"; plugin="$3"; shift 3
log="${{TMPDIR:-/tmp}}/darl-tests.log"
: >"$log" && exec 5<"$log" || exit {NOT_READY_EXIT}
if [ "$python" != - ] && ! (cd / && "$python" -I "$plugin" --check) >"$log" 2>&1; then
    echo {LOG_MARK}
    tail -c {LOG_TAIL_BYTES} <&5
    exit {NOT_READY_EXIT}
fi
if command -v timeout >/dev/null; then
    timeout -k 10 "$seconds" "$@" 3>&1 >>"$log" 2>&1 5<&-
else
    "$@" 3>&1 >>"$log" 2>&1 5<&-
fi
code=$?
[ "$code" -eq {NOT_READY_EXIT} ] && code=96
echo
echo {LOG_MARK}
tail -c {LOG_TAIL_BYTES} <&5
exit "$code"
"""
# The contract's variables a grading never gets (the tests never hold the rollout token).
CONTRACT_PREFIXES = ("DARL_", "OPENAI_", "ANTHROPIC_", "AGL_", "TRACEPARENT")


def grading_job_name(job: str) -> str:
    """The name of the grading Job of the attempt whose Job is `job`."""
    return f"{job}-grade"


def job_deadline_seconds(reward_seconds: float) -> int:
    """The grading Job's activeDeadlineSeconds: the trusted steps' time, the tests' own, and
    a grace past the two."""
    return PREPARE_SECONDS + int(reward_seconds) + DEADLINE_GRACE_SECONDS


def wait_seconds(reward_seconds: float) -> float:
    """How long the runner waits for a grading Pod to end: past the Job's deadline, another
    grace for the Job's controller to end it."""
    return PREPARE_SECONDS + reward_seconds + DEADLINE_GRACE_SECONDS * 2


def graded(spec: RolloutSpec) -> tuple[KubernetesAgentSpec, GraderSpec]:
    """The Kubernetes agent and the grader of a graded rollout; GradingError otherwise."""
    agent, grader = spec.agent, spec.reward.grader
    if not isinstance(agent, KubernetesAgentSpec) or grader is None:
        raise GradingError("a Kubernetes grading needs a Kubernetes agent and a grader")
    return agent, grader


def grading_job_manifest(
    agent_job: dict, request: AwaitRequest, settings: KubernetesSettings
) -> dict:
    """The grading Job of the attempt whose Job is `agent_job`: its Pod made from the
    agent's (namespace, security, RuntimeClass, the agent container's image and
    environment less the agent contract), owned by the agent's Job."""
    spec = request.spec
    agent, grader = graded(spec)
    meta = agent_job["metadata"]
    name = grading_job_name(meta["name"])
    pod = copy.deepcopy(agent_job["spec"]["template"]["spec"])
    agent_container = pod["containers"][0]
    root = settings.grading_mount_root
    attempt, run, task = f"{root}/attempt", f"{root}/run", f"{root}/task"
    security = copy.deepcopy(agent_container.get("securityContext") or {})
    prepare = {
        "name": PREPARE,
        "image": settings.grading_image,
        "command": [
            settings.grading_python,
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
    plugin = f"{run}/pytest_results.py"
    if grader.kind == "swe_tests":
        check = [agent.test_python, plugin]
        command = [
            agent.test_python,
            *("-I", "-B", plugin, "--results-fd", "3"),
            *("--root", agent.workdir, "--args-file", f"{run}/args.json"),
        ]
    else:
        check, command = ["-", "-"], list(grader.command or [])
    # The agent container's environment less the agent contract, the task's values the
    # grader maps, and no pytest plugin but DARL's, as the local grader runs the tests.
    env = [
        var
        for var in agent_container.get("env") or []
        if not var.get("name", "").startswith(CONTRACT_PREFIXES)
        and var.get("name") not in TOKEN_VARS
    ]
    scratch = f"{root}/tmp"
    mapped = env_map_values(spec.task, grader.env_map)
    mapped |= {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "TMPDIR": scratch}
    env = [var for var in env if var.get("name") not in mapped]
    env += [{"name": key, "value": value} for key, value in mapped.items()]
    tests = {
        "name": TESTS,
        "image": agent_container["image"],
        "command": ["/bin/sh", "-c", TESTS_SCRIPT, TESTS],
        "args": [str(int(spec.timeouts.reward_seconds)), *check, *command],
        "workingDir": agent.workdir,
        "env": env,
        "securityContext": copy.deepcopy(security),
        # The container's writable layer and log too: past it, the kubelet evicts the
        # Pod, the tests' own outcome (`own_storage_eviction`).
        "resources": {
            "limits": {
                "memory": f"{limits.memory_mb}Mi",
                "ephemeral-storage": f"{limits.tmp_mb}Mi",
            }
        },
        "volumeMounts": [
            {
                "name": ATTEMPT_VOLUME,
                "mountPath": agent.workdir,
                "subPath": f"{GRADING_SUBPATH}/testbed",
            },
            {"name": "darl-run", "mountPath": run, "readOnly": True},
            {"name": "darl-tmp", "mountPath": scratch},
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
            "activeDeadlineSeconds": job_deadline_seconds(spec.timeouts.reward_seconds),
            "ttlSecondsAfterFinished": settings.ttl_seconds_after_finished,
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
