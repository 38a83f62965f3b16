"""The Job of each attempt of a Kubernetes agent: the user's template (or image) rendered,
with DARL's name, labels, agent contract and security fields enforced over what it asks.

A Job runs non-root in the agents' namespace, unless its template asks for root (`runAsUser:
0`, as SWE-smith's task images need): then it runs only where the operator allows it, in the
sandbox namespace under the sandboxing RuntimeClass (gVisor) the worker was started with.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import jinja2
import yaml

from darl.activities.agent_contract import AgentContract
from darl.activities.errors import agent_spec_error
from darl.activities.runners.kubernetes_settings import KubernetesSettings
from darl.workflows.contracts import KubernetesAgentSpec, RolloutSpec

MANAGED_BY = {"app.kubernetes.io/managed-by": "darl"}
# A graded attempt's volume: the repository the agent works on (`workspace`), and the
# image's repository as it was before the agent (`base`), which only the grading mounts.
ATTEMPT_VOLUME = "darl-attempt"
WORKSPACE_SUBPATH = "workspace"
SEED_CONTAINER = "darl-seed"
# The seed: the image's workdir ($1) copied twice onto the volume ($2), before the agent.
SEED_SCRIPT = (
    'mkdir -p "$2/workspace" "$2/base"'
    ' && (cd "$1" && tar -cf - .) | (cd "$2/workspace" && tar -xf -)'
    ' && (cd "$1" && tar -cf - .) | (cd "$2/base" && tar -xf -)'
)
TOKEN_KEY = "token"
# The task reaches the agent as a file from the attempt's Secret (DARL_TASK only while it is
# small: `agent_contract.task_env`), at most TASK_SECRET_MAX_BYTES (a Secret holds 1 MiB).
TASK_KEY = "task.json"
TASK_VOLUME = "darl-task"
TASK_MOUNT = "/run/darl"
TASK_SECRET_MAX_BYTES = 768 * 1024
# Variables of the agent contract that carry the rollout token: from the Secret, not plain env.
TOKEN_VARS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AGL_KEY")
# What root keeps in a sandboxed Job (everything else is dropped): the file and identity
# capabilities of Docker's default root, under which SWE-bench and SWE-smith validated their
# tests (a test that writes a read-only file, a `pip install` that chowns, a tool that drops
# to another user behave as they did there). Not NET_RAW (raw sockets), MKNOD, SYS_CHROOT,
# SETPCAP, SETFCAP, KILL, AUDIT_WRITE or NET_BIND_SERVICE, which a coding task does not need.
# All six are in the `baseline` Pod Security Standard's list; under gVisor they are
# capabilities of its user-space kernel, not of the node's.
SANDBOXED_ROOT_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "SETGID", "SETUID")


def job_name(rollout_id: str, attempt: int) -> str:
    """A DNS-1123 label, deterministic in (rollout, attempt): `darl-<slug>-<hash>-a<n>`."""
    slug = re.sub(r"[^a-z0-9-]+", "-", rollout_id.lower()).strip("-")[:32].strip("-")
    digest = hashlib.sha256(rollout_id.encode()).hexdigest()[:8]
    return f"darl-{slug}-{digest}-a{attempt}"


def attempt_claim(job: str) -> str:
    """The name of the volume (PersistentVolumeClaim) of the attempt whose Job is `job`."""
    return f"{job}-attempt"


def yaml_escape(value: object) -> str:
    """Agent Lightning's template filter: the value as a double-quoted YAML (JSON) string."""
    return json.dumps(str(value), ensure_ascii=True)


def label_value(value: str) -> str:
    """A valid label value (<= 63 chars, alphanumeric ends); the full value is an annotation."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", value)[:63]
    return cleaned.strip("-_.") or "x"


class JobManifests:
    """The Jobs a runner with these settings creates."""

    def __init__(self, settings: KubernetesSettings) -> None:
        self.settings = settings
        self._templates = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
        self._templates.filters["yaml_escape"] = yaml_escape

    def job(self, spec: RolloutSpec, attempt: int, contract: AgentContract) -> dict:
        """The user's Job (template or image) with DARL's fields enforced on top, in the
        namespace it runs in: the sandbox namespace for a Job that asks for root."""
        agent = spec.agent
        if not isinstance(agent, KubernetesAgentSpec):
            raise agent_spec_error(f"the kubernetes runner cannot run a {agent.kind!r} agent")
        job = self._user_job(agent, spec, attempt)
        root = _asks_for_root(job)
        if root and self.settings.sandbox_namespace is None:
            raise agent_spec_error(
                f"job template {agent.job_template} asks for root (runAsUser: 0), which this "
                "worker runs only in a sandbox namespace under a sandboxing RuntimeClass: "
                "start it with --k8s-sandbox-namespace and --k8s-sandbox-runtime-class "
                "(docs/coding-agents.md, Kubernetes)"
            )
        namespace = self.settings.sandbox_namespace if root else self.settings.namespace
        name = job_name(spec.rollout_id, attempt)
        labels = {
            **MANAGED_BY,
            "darl.dev/run": label_value(spec.run_id),
            "darl.dev/rollout": label_value(spec.rollout_id),
            "darl.dev/attempt": str(attempt),
        }
        annotations = {"darl.dev/rollout-id": spec.rollout_id, "darl.dev/run-id": spec.run_id}
        metadata = job.setdefault("metadata", {})
        metadata.update(name=name, namespace=namespace)
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
        if spec.reward.grader is not None:
            self._on_the_attempts_volume(pod, agent, name)
        if root:
            self._enforce_sandboxed_root(pod)
        else:
            self._enforce_security(pod)
        containers = pod.get("containers") or []
        if not containers:
            raise agent_spec_error("the Job template has no containers")
        task_file = {"DARL_TASK_FILE": f"{TASK_MOUNT}/{TASK_KEY}"}
        env = self._contract_env(name, contract, {**agent.env, **contract.env, **task_file})
        pod["volumes"] = [
            *(pod.get("volumes") or []),
            {
                "name": TASK_VOLUME,
                "secret": {"secretName": name, "items": [{"key": TASK_KEY, "path": TASK_KEY}]},
            },
        ]
        for container in containers:
            given = [e for e in container.get("env") or [] if e.get("name") not in env]
            container["env"] = [*given, *env.values()]
            container["volumeMounts"] = [
                *(container.get("volumeMounts") or []),
                {"name": TASK_VOLUME, "mountPath": TASK_MOUNT, "readOnly": True},
            ]
        return job

    def claim(self, job: Any) -> dict:
        """The volume of a graded attempt, beside its Job and owned by it (it goes with the
        Job, which outlives the grading)."""
        meta = job.metadata
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": meta.name, "uid": meta.uid}
        spec: dict[str, Any] = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": self.settings.grading_volume_size}},
        }
        if self.settings.grading_storage_class is not None:
            spec["storageClassName"] = self.settings.grading_storage_class
        return {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {
                "name": attempt_claim(meta.name),
                "namespace": meta.namespace,
                "labels": {**MANAGED_BY, **dict(meta.labels or {})},
                "ownerReferences": [owner],
            },
            "spec": spec,
        }

    def _on_the_attempts_volume(self, pod: dict, agent: KubernetesAgentSpec, name: str) -> None:
        """Put the agent's workdir on the attempt's volume (graded agents): a first init
        container, of the agent's image, copies the image's workdir there twice (the
        agent's workspace, and the base the grader restores from, which the agent never
        mounts); the agent's container mounts the workspace at its workdir."""
        containers = pod.get("containers") or []
        if not containers:
            return  # refused below, with the Job's other faults
        agent_container = containers[0]
        mount = f"{self.settings.grading_mount_root}/attempt"
        pod["volumes"] = [
            *(pod.get("volumes") or []),
            {"name": ATTEMPT_VOLUME, "persistentVolumeClaim": {"claimName": attempt_claim(name)}},
        ]
        seed = {
            "name": SEED_CONTAINER,
            "image": agent_container.get("image"),
            "command": ["/bin/sh", "-c", SEED_SCRIPT, SEED_CONTAINER, agent.workdir, mount],
            "volumeMounts": [{"name": ATTEMPT_VOLUME, "mountPath": mount}],
        }
        pod["initContainers"] = [seed, *(pod.get("initContainers") or [])]
        agent_container["volumeMounts"] = [
            *(agent_container.get("volumeMounts") or []),
            {"name": ATTEMPT_VOLUME, "mountPath": agent.workdir, "subPath": WORKSPACE_SUBPATH},
        ]
        agent_container.setdefault("workingDir", agent.workdir)

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
            # The task as the agent may see it: a grader's hidden fields left out.
            task = spec.agent_task()
            rendered = self._templates.from_string(source).render(
                task=task,
                input=task,
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
        # A Job that says runAsUser 0 anywhere never gets here (_enforce_sandboxed_root).
        context["runAsNonRoot"] = True
        context.setdefault("runAsUser", self.settings.run_as_user)
        context.setdefault("seccompProfile", {"type": "RuntimeDefault"})
        for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            box = container.setdefault("securityContext", {})
            box["allowPrivilegeEscalation"] = False
            box["privileged"] = False
            if box.get("runAsNonRoot") is False:
                box["runAsNonRoot"] = True
            capabilities = box.setdefault("capabilities", {})
            capabilities.pop("add", None)
            capabilities["drop"] = ["ALL"]

    def _enforce_sandboxed_root(self, pod: dict) -> None:
        """Root as the template asks, under the operator's RuntimeClass (the container's
        kernel is gVisor's, not the node's), and otherwise as contained as any agent: no
        privilege or escalation, the default seccomp profile, every capability dropped but
        SANDBOXED_ROOT_CAPABILITIES (the template may keep fewer)."""
        pod["runtimeClassName"] = self.settings.sandbox_runtime_class
        context = pod.setdefault("securityContext", {})
        context.setdefault("seccompProfile", {"type": "RuntimeDefault"})
        for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            box = container.setdefault("securityContext", {})
            box["allowPrivilegeEscalation"] = False
            box["privileged"] = False
            capabilities = box.setdefault("capabilities", {})
            asked = capabilities.pop("add", None)
            kept = [c for c in SANDBOXED_ROOT_CAPABILITIES if asked is None or c in asked]
            capabilities["drop"] = ["ALL"]
            if kept:
                capabilities["add"] = kept

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


def _asks_for_root(job: dict) -> bool:
    """Whether the Job's Pod, or any of its containers, says `runAsUser: 0`."""
    pod = ((job.get("spec") or {}).get("template") or {}).get("spec") or {}
    contexts = [pod.get("securityContext") or {}]
    for container in [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]:
        contexts.append((container or {}).get("securityContext") or {})
    return any(context.get("runAsUser") == 0 for context in contexts)
