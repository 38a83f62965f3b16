"""The workload half of the Kubernetes API emulator for tests (not Kubernetes): an emulated
kubelet that runs each Pod as the scenario its first image names, or its init containers and
containers as real local processes with their volumes mounted, and the Job controller for
one-Pod Jobs (restartPolicy Never)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import copy
import itertools
import logging
import os
import random
import shutil
import signal
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.k8s_emulator_volumes import Mount, VolumeError, VolumeNotReadyError, Volumes, mounted

if TYPE_CHECKING:
    from tests.k8s_emulator import ObjectStore, StoreEvent

log = logging.getLogger(__name__)

# Images `emulator/<scenario>` pick what a Pod does; every other image runs its command.
SCENARIOS = frozenset({"run", "image-pull-error", "unschedulable", "oom", "evicted", "sleep"})
# How long one emulated step (scheduling, a pull attempt, a brief run) takes.
MOMENT = 0.05
# The kubelet re-checks a container it could not configure (a missing Secret) this often.
RESYNC_SECONDS = 0.1
NODE = "emulator-node"
# Kubernetes' alphabet for generated name suffixes (no vowels, no look-alikes).
SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
TERMINAL = ("Succeeded", "Failed")


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def name_suffix() -> str:
    return "".join(random.choices(SUFFIX_ALPHABET, k=5))


def controller_uid(obj: dict) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == "Job":
            return ref.get("uid")
    return None


class TaskSet:
    """Background work with an owner: referenced until done, cancelled on close, and any
    failure kept so the emulator can raise it instead of hiding it in a log."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self.failures: list[BaseException] = []

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("emulator task failed", exc_info=task.exception())
            self.failures.append(task.exception())  # type: ignore[arg-type]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def scenario_of(image: str) -> str:
    name = image.split("@")[0]
    repository, _, tag = name.rpartition(":")
    if repository and "/" not in tag:
        name = repository
    scenario = name.removeprefix("emulator/")
    return scenario if name.startswith("emulator/") and scenario in SCENARIOS else "run"


class ContainerConfigError(Exception):
    """The container's environment cannot be built yet (as the kubelet says it)."""


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@dataclass
class PodRun:
    pod: dict
    # The running processes, by container name.
    processes: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)
    task: asyncio.Task | None = None
    started_at: str = field(default_factory=now)

    def running(self) -> list[asyncio.subprocess.Process]:
        return [p for p in self.processes.values() if p.returncode is None]


class Kubelet:
    """Runs the emulator's Pods on one emulated node: the init containers one after another,
    then the containers together (no restarts); a process gets PATH, HOME and HOSTNAME plus
    the container's env, and its volumes mounted (`k8s_emulator_volumes`). The first
    container's image may name a scenario (`emulator/<scenario>`) the Pod acts out."""

    def __init__(self, store: ObjectStore, workdir: Path) -> None:
        self._store = store
        self._workdir = workdir
        self._logs = workdir / "pod-logs"
        self._logs.mkdir(parents=True, exist_ok=True)
        self._runs: dict[str, PodRun] = {}
        self._tasks = TaskSet()
        self._ips = itertools.count(2)
        self.failures = self._tasks.failures
        self.volumes = Volumes(workdir / "volumes", store.get)
        self._bwrap = shutil.which("bwrap") or "bwrap"

    def on_event(self, event: StoreEvent) -> None:
        meta = event.obj["metadata"]
        if event.plural == "pods" and event.type == "ADDED":
            run = self._runs[meta["uid"]] = PodRun(event.obj)
            run.task = self._tasks.spawn(self._run(run))
        elif event.plural == "pods" and event.type == "DELETED":
            self.volumes.pod_deleted(meta["uid"])
        elif event.plural == "persistentvolumeclaims" and event.type == "ADDED":
            self.volumes.claim_created(meta["namespace"], meta["name"])
        elif event.plural == "persistentvolumeclaims" and event.type == "DELETED":
            self.volumes.claim_deleted(meta["namespace"], meta["name"])

    def log_path(self, pod: dict, container: str | None = None) -> Path:
        """The log of one of the Pod's containers (its first container's by default)."""
        meta = pod["metadata"]
        name = container or pod["spec"]["containers"][0]["name"]
        return self._logs / f"{meta['namespace']}_{meta['name']}_{meta['uid']}_{name}.log"

    async def stop(self, pod: dict, grace_seconds: float) -> None:
        """Stop a deleted Pod's containers as Kubernetes does: SIGTERM to their process
        groups, SIGKILL once the grace period is over. A Pod with no process simply stops."""
        run = self._runs.pop(pod["metadata"]["uid"], None)
        if run is None or run.task is None:
            return
        running = run.running()
        if not running:
            run.task.cancel()
        else:
            for process in running:
                _signal_group(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(run.task), grace_seconds)
            except TimeoutError:
                for process in run.running():
                    _signal_group(process.pid, signal.SIGKILL)
                run.task.cancel()
        await asyncio.gather(run.task, return_exceptions=True)

    async def aclose(self) -> None:
        processes = [p for run in self._runs.values() for p in run.running()]
        for process in processes:
            _signal_group(process.pid, signal.SIGKILL)
        for process in processes:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), 5)
        await self._tasks.aclose()

    # --- one Pod's life ---------------------------------------------------------------

    async def _run(self, run: PodRun) -> None:
        containers = run.pod["spec"]["containers"]
        first = containers[0]
        scenario = scenario_of(first.get("image", ""))
        if scenario == "unschedulable":
            self._update(run, conditions=[_condition("PodScheduled", False, "Unschedulable")])
            return
        self._schedule(run)
        await asyncio.sleep(MOMENT)
        if scenario == "image-pull-error":
            image = first["image"]
            pulled = f'failed to pull image "{image}": not found (emulator)'
            backoff = f'Back-off pulling image "{image}"'
            for reason, message in (("ErrImagePull", pulled), ("ImagePullBackOff", backoff)):
                self._update(run, state={"waiting": {"reason": reason, "message": message}})
                await asyncio.sleep(MOMENT)
            return
        if scenario in ("oom", "evicted"):
            self.log_path(run.pod).touch()
            self._update(run, phase="Running", state={"running": {"startedAt": now()}})
            await asyncio.sleep(MOMENT)
            self._end_briefly_running(run, scenario)
            return
        try:
            for init in run.pod["spec"].get("initContainers") or []:
                if await self._run_container(run, init, init=True) != 0:
                    self._update(run, phase="Failed", conditions=_ended())
                    return
            codes = await asyncio.gather(*(self._run_container(run, c) for c in containers))
        finally:
            for process in run.running():
                _signal_group(process.pid, signal.SIGKILL)
        failed = any(code != 0 for code in codes)
        self._update(run, phase="Failed" if failed else "Succeeded", conditions=_ended())

    def _schedule(self, run: PodRun) -> None:
        ip = f"10.244.0.{next(self._ips) % 250 + 2}"
        self._update(
            run,
            spec={"nodeName": NODE},
            state={"waiting": {"reason": "ContainerCreating"}},
            conditions=[_condition("PodScheduled", True)],
            extra={"hostIP": "127.0.0.1", "podIP": ip, "podIPs": [{"ip": ip}], "startTime": now()},
        )

    async def _run_container(self, run: PodRun, container: dict, init: bool = False) -> int:
        """Run one container to its end (its exit code; 128 when it could not start)."""
        scenario = scenario_of(container.get("image", ""))
        if scenario == "sleep":
            container = {**container, "command": ["sleep", "86400"], "args": []}
        env = await self._until_ready(run, container, init, self._resolve_env)
        if env is None:
            return 128
        mounts = await self._until_ready(
            run, container, init, lambda pod, c: self.volumes.mounts(pod, c)
        )
        if mounts is None:
            return 128
        return await self._run_process(run, container, env, mounts, init)

    async def _until_ready(
        self,
        run: PodRun,
        container: dict,
        init: bool,
        make: Callable[[dict, dict], Any],
    ) -> Any:
        """What `make` builds for the container (its env, its mounts); while something it
        needs is missing (a Secret, a claim) the container waits with the kubelet's reason
        and the kubelet keeps retrying. None when it can never be made (the container
        failed to create)."""
        shown = None
        while True:
            try:
                return make(run.pod, container)
            except (ContainerConfigError, VolumeNotReadyError) as err:
                if str(err) != shown:
                    shown = str(err)
                    reason = (
                        "CreateContainerConfigError"
                        if isinstance(err, ContainerConfigError)
                        else "ContainerCreating"
                    )
                    waiting = {"reason": reason, "message": shown}
                    self._update(run, container=container, init=init, state={"waiting": waiting})
            except VolumeError as err:
                terminated = {
                    "exitCode": 128,
                    "reason": "CreateContainerError",
                    "message": str(err),
                }
                terminated |= {"startedAt": now(), "finishedAt": now()}
                self._update(run, container=container, init=init, state={"terminated": terminated})
                return None
            await asyncio.sleep(RESYNC_SECONDS)

    def _resolve_env(self, pod: dict, container: dict) -> dict[str, str]:
        meta = pod["metadata"]
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/"),
            "HOSTNAME": meta["name"],
        }
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"]}
        fields["metadata.uid"] = meta["uid"]
        defined: dict[str, str] = {}
        for var in container.get("env") or []:
            source = var.get("valueFrom")
            if source is None:
                # A value may refer to the container's variables defined before it.
                value = expand(str(var.get("value", "")), defined)
                env[var["name"]] = defined[var["name"]] = value
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = self._secret(meta["namespace"], ref)
                if secret is None:
                    continue
                if ref.get("key") not in secret.get("data", {}):
                    if ref.get("optional"):
                        continue
                    where = f"{meta['namespace']}/{ref.get('name')}"
                    raise ContainerConfigError(
                        f"couldn't find key {ref.get('key')} in Secret {where}"
                    )
                env[var["name"]] = defined[var["name"]] = _decoded(secret["data"][ref["key"]])
            elif source.get("fieldRef", {}).get("fieldPath") in fields:
                value = fields[source["fieldRef"]["fieldPath"]]
                env[var["name"]] = defined[var["name"]] = value
            else:
                raise ContainerConfigError(f"the emulator cannot resolve env {var['name']}")
        return env

    def _secret(self, namespace: str, ref: dict) -> dict | None:
        secret = self._store.get("secrets", namespace, ref.get("name", ""))
        if secret is None and not ref.get("optional"):
            raise ContainerConfigError(f'secret "{ref.get("name")}" not found')
        return secret

    async def _run_process(
        self,
        run: PodRun,
        container: dict,
        env: dict[str, str],
        mounts: list[Mount],
        init: bool,
    ) -> int:
        names = {var["name"] for var in container.get("env") or []}
        defined = {name: value for name, value in env.items() if name in names}
        words = [*(container.get("command") or []), *(container.get("args") or [])]
        argv = [expand(word, defined) for word in words]
        cwd = container.get("workingDir")
        started = now()
        try:
            if not argv:
                raise FileNotFoundError("the emulator needs a command: images have no entrypoint")
            with self.log_path(run.pod, container["name"]).open("wb") as log_file:
                process = await asyncio.create_subprocess_exec(
                    *mounted(argv, mounts, cwd, self._bwrap),
                    env=env,
                    # bwrap enters the working directory itself, once the mounts are made.
                    cwd=self._workdir if mounts or not cwd else cwd,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as err:
            terminated = {"exitCode": 128, "reason": "StartError", "message": str(err)}
            self._update(
                run,
                container=container,
                init=init,
                phase=None if init else "Failed",
                state={"terminated": {**terminated, "startedAt": started, "finishedAt": now()}},
            )
            return 128
        run.processes[container["name"]] = process
        container_id = f"emulator://{process.pid}"
        ready = [_condition(kind, True) for kind in ("Initialized", "Ready", "ContainersReady")]
        self._update(
            run,
            container=container,
            init=init,
            phase=None if init else "Running",
            state={"running": {"startedAt": started}},
            ready=not init,
            conditions=None if init else ready,
            container_id=container_id,
        )
        code = await process.wait()
        # A container's end takes everything it started with it.
        _signal_group(process.pid, signal.SIGKILL)
        exit_code = code if code >= 0 else 128 - code
        terminated = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": started,
            "finishedAt": now(),
            "containerID": container_id,
        }
        self._update(
            run,
            container=container,
            init=init,
            state={"terminated": terminated},
            container_id=container_id,
        )
        return exit_code

    def _end_briefly_running(self, run: PodRun, scenario: str) -> None:
        ended = {"startedAt": run.started_at, "finishedAt": now()}
        if scenario == "oom":
            terminated = {"exitCode": 137, "reason": "OOMKilled", **ended}
            self._update(run, phase="Failed", state={"terminated": terminated}, conditions=_ended())
            return
        message = "The node was low on resource: memory."
        target = _condition("DisruptionTarget", True, "TerminationByKubelet", message)
        self._update(
            run,
            phase="Failed",
            state={"terminated": {"exitCode": 137, "reason": "Error", **ended}},
            conditions=[*_ended(), target],
            extra={"reason": "Evicted", "message": message},
        )

    def _update(
        self,
        run: PodRun,
        *,
        container: dict | None = None,
        init: bool = False,
        phase: str | None = None,
        state: dict | None = None,
        ready: bool = False,
        conditions: list[dict] | None = None,
        container_id: str | None = None,
        spec: dict | None = None,
        extra: dict | None = None,
    ) -> None:
        """Write the Pod's status as the kubelet reports it (a no-op once the Pod is gone):
        `state` is a container's (the first container's unless `container` says which, an
        init container's with `init`)."""
        meta = run.pod["metadata"]
        pod = self._store.get("pods", meta["namespace"], meta["name"])
        if pod is None or pod["metadata"]["uid"] != meta["uid"]:
            return
        status = pod.setdefault("status", {})
        status["phase"] = phase or status.get("phase", "Pending")
        pod["spec"].update(spec or {})
        status.update(extra or {})
        by_type = {c["type"]: c for c in status.get("conditions", [])}
        by_type.update({c["type"]: c for c in conditions or []})
        status["conditions"] = list(by_type.values())
        if state is not None:
            container = container or pod["spec"]["containers"][0]
            key = "initContainerStatuses" if init else "containerStatuses"
            entry = {
                "name": container["name"],
                "image": container.get("image", ""),
                "imageID": "",
                "ready": ready,
                "started": "running" in state,
                "restartCount": 0,
                "state": state,
                "lastState": {},
            }
            if container_id:
                entry["containerID"] = container_id
            entries = [e for e in status.get(key) or [] if e["name"] != container["name"]]
            status[key] = [*entries, entry]
        run.pod = self._store.write("pods", pod, "MODIFIED")


def expand(text: str, variables: dict[str, str]) -> str:
    """Kubernetes' `$(NAME)` expansion of an env value, a command or an argument, as the
    kubelet does it (third_party/forked/golang/expansion): `$(NAME)` becomes the variable's
    value when the container defines it (before this value, for env) and stays as written
    otherwise, `$$` becomes `$`, and any other `$` is kept."""
    out: list[str] = []
    checkpoint = cursor = 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            following = text[cursor + 1]
            closer = text.find(")", cursor + 2) if following == "(" else -1
            if following == "$":
                out.append("$")
                advance = 1
            elif closer != -1:
                name = text[cursor + 2 : closer]
                out.append(variables.get(name, f"$({name})"))
                advance = closer - cursor
            else:
                out.append("$" + following)
                advance = 1
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    return "".join(out) + text[checkpoint:]


def _decoded(value: str) -> str:
    try:
        return base64.b64decode(value).decode()
    except (binascii.Error, UnicodeDecodeError) as err:
        raise ContainerConfigError(f"the emulator cannot decode a Secret value: {err}") from err


def _condition(
    kind: str, true: bool, reason: str | None = None, message: str | None = None
) -> dict:
    condition = {"type": kind, "status": "True" if true else "False", "lastProbeTime": None}
    condition["lastTransitionTime"] = now()
    if reason:
        condition["reason"] = reason
    if message or reason == "Unschedulable":
        condition["message"] = message or "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    return condition


def _ended() -> list[dict]:
    return [_condition(kind, False, "PodCompleted") for kind in ("Ready", "ContainersReady")]


JOB_MESSAGES = {
    "BackoffLimitExceeded": "Job has reached the specified backoff limit",
    "DeadlineExceeded": "Job was active longer than specified deadline",
    "CompletionsReached": "Reached expected number of succeeded pods",
}


class JobController:
    """The Job controller for one-Pod Jobs (completions 1, parallelism 1, restartPolicy
    Never): creates the Pod, mirrors it into the Job's status (FailureTarget or
    SuccessCriteriaMet first, Failed or Complete once no Pod runs), replaces a failed Pod up
    to backoffLimit (with no backoff delay), enforces activeDeadlineSeconds, and deletes a
    finished Job after ttlSecondsAfterFinished as the TTL controller does."""

    def __init__(
        self,
        store: ObjectStore,
        create_pod: Callable[[str, dict], dict],
        delete: Callable[[str, str, str, str | None], Awaitable[None]],
    ) -> None:
        self._store = store
        self._create_pod = create_pod
        self._delete = delete
        # Job uid -> uids of its Pods already counted as succeeded or failed.
        self._counted: dict[str, set[str]] = {}
        self._timers: dict[str, list[asyncio.Task]] = {}
        self._tasks = TaskSet()
        self.failures = self._tasks.failures

    def on_event(self, event: StoreEvent) -> None:
        if event.plural == "jobs" and event.type == "ADDED":
            self._start(event.obj)
        elif event.plural == "jobs" and event.type == "DELETED":
            self._forget(event.obj["metadata"]["uid"])
        elif event.plural == "pods" and event.type != "ADDED" and controller_uid(event.obj):
            gone = event.obj if event.type == "DELETED" else None
            self._sync(controller_uid(event.obj) or "", gone=gone)

    async def aclose(self) -> None:
        await self._tasks.aclose()

    def _start(self, job: dict) -> None:
        uid = job["metadata"]["uid"]
        self._counted[uid] = set()
        self._new_pod(job)
        job = copy.deepcopy(job)
        job["status"] = {"startTime": now(), "active": 1, "ready": 0, "terminating": 0}
        job["status"]["uncountedTerminatedPods"] = {}
        self._store.write("jobs", job, "MODIFIED")
        if (deadline := job["spec"].get("activeDeadlineSeconds")) is not None:
            self._after(uid, deadline, lambda: self._deadline_exceeded(uid))

    def _sync(self, uid: str, gone: dict | None = None) -> None:
        """Bring the Job's status in line with its Pods (a Pod deleted before it ended
        counts as failed, as with podReplacementPolicy TerminatingOrFailed)."""
        job = self._job(uid)
        if job is None or job["metadata"].get("deletionTimestamp") or _finished(job):
            return
        status = job.setdefault("status", {})
        before = copy.deepcopy(status)
        pods = self._pods(job)
        ended = [(pod, _phase(pod)) for pod in pods if _phase(pod) in TERMINAL]
        if gone is not None:
            ended.append((gone, "Succeeded" if _phase(gone) == "Succeeded" else "Failed"))
        counted = self._counted.setdefault(uid, set())
        for pod, phase in ended:
            if pod["metadata"]["uid"] not in counted:
                counted.add(pod["metadata"]["uid"])
                key = "succeeded" if phase == "Succeeded" else "failed"
                status[key] = status.get(key, 0) + 1
        live = [pod for pod in pods if _phase(pod) not in TERMINAL]
        if _target(status) is None:
            if status.get("succeeded"):
                _add_condition(status, "SuccessCriteriaMet", "CompletionsReached")
            elif status.get("failed", 0) > job["spec"].get("backoffLimit", 6):
                _add_condition(status, "FailureTarget", "BackoffLimitExceeded")
            elif not live:
                live.append(self._new_pod(job))
        terminating = sum(1 for pod in live if pod["metadata"].get("deletionTimestamp"))
        status["active"] = len(live) - terminating
        status["terminating"] = terminating
        status["ready"] = sum(1 for pod in live if _ready(pod))
        if not status["active"]:
            status.pop("active")
        target = _target(status)
        if target is not None and not live:
            self._finish(job, target)
        if status != before:
            self._store.write("jobs", job, "MODIFIED")

    def _finish(self, job: dict, target: dict) -> None:
        final = "Complete" if target["type"] == "SuccessCriteriaMet" else "Failed"
        _add_condition(job["status"], final, target["reason"])
        if final == "Complete":
            job["status"]["completionTime"] = now()
        ttl = job["spec"].get("ttlSecondsAfterFinished")
        if ttl is not None:
            meta = job["metadata"]
            ns, name = meta["namespace"], meta["name"]
            self._after(meta["uid"], ttl, lambda: self._delete("jobs", ns, name, "Foreground"))

    async def _deadline_exceeded(self, uid: str) -> None:
        job = self._job(uid)
        if job is None or _finished(job) or _target(job.get("status", {})) is not None:
            return
        _add_condition(job["status"], "FailureTarget", "DeadlineExceeded")
        self._store.write("jobs", job, "MODIFIED")
        for pod in self._pods(job):
            if _phase(pod) not in TERMINAL:
                await self._delete(
                    "pods", pod["metadata"]["namespace"], pod["metadata"]["name"], None
                )
        self._sync(uid)

    def _after(self, uid: str, seconds: float, work: Callable[[], Awaitable[None]]) -> None:
        async def later() -> None:
            await asyncio.sleep(seconds)
            await work()

        self._timers.setdefault(uid, []).append(self._tasks.spawn(later()))

    def _forget(self, uid: str) -> None:
        self._counted.pop(uid, None)
        for task in self._timers.pop(uid, []):
            if task is not asyncio.current_task():
                task.cancel()

    def _new_pod(self, job: dict) -> dict:
        meta, template = job["metadata"], job["spec"]["template"]
        base = f"{meta['name']}-"[:58]
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"]}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": base + name_suffix(),
                "generateName": base,
                "labels": dict(template["metadata"].get("labels") or {}),
                "annotations": dict(template["metadata"].get("annotations") or {}),
                "ownerReferences": [{**owner, "controller": True, "blockOwnerDeletion": True}],
            },
            "spec": copy.deepcopy(template["spec"]),
        }
        return self._create_pod(meta["namespace"], pod)

    def _job(self, uid: str) -> dict | None:
        jobs = self._store.list("jobs", None, lambda job: job["metadata"]["uid"] == uid)
        return jobs[0] if jobs else None

    def _pods(self, job: dict) -> list[dict]:
        uid = job["metadata"]["uid"]
        return self._store.list(
            "pods", job["metadata"]["namespace"], lambda pod: controller_uid(pod) == uid
        )


def _phase(pod: dict) -> str:
    return (pod.get("status") or {}).get("phase", "Pending")


def _ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _target(status: dict) -> dict | None:
    for condition in status.get("conditions") or []:
        if condition["type"] in ("FailureTarget", "SuccessCriteriaMet"):
            return condition
    return None


def _finished(job: dict) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c["type"] in ("Complete", "Failed") for c in conditions)


def _add_condition(status: dict, kind: str, reason: str) -> None:
    at = now()
    status.setdefault("conditions", []).append(
        {
            "type": kind,
            "status": "True",
            "reason": reason,
            "message": JOB_MESSAGES[reason],
            "lastProbeTime": at,
            "lastTransitionTime": at,
        }
    )
