"""The Kubernetes API emulator driven by the real kr8s async client over real HTTP: a Job's
Pod, exit code and log; a Secret the Pod waits for; watches, resumed and broken; Status
errors as kr8s raises them; deletion with each propagation policy; and the failure
scenarios a Job runner must tell apart."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kr8s
import pytest
from kr8s.asyncio.objects import Job, Pod, Secret

from tests.k8s_emulator import KubernetesEmulator

NS = "agents"
pytestmark = pytest.mark.timeout(10)


@pytest.fixture
async def api(emulator: KubernetesEmulator) -> AsyncIterator[Any]:
    client = await kr8s.asyncio.api(url=emulator.url, namespace=NS)
    yield client
    # kr8s has no close(): without this its pooled sockets outlive the test.
    await client._session.aclose()


def job_manifest(name: str, image: str = "emulator/run", command: list[str] | None = None) -> dict:
    container: dict[str, Any] = {"name": "agent", "image": image}
    if command:
        container["command"] = command
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
        },
    }


async def create_job(api: Any, manifest: dict) -> Job:
    job = await Job(manifest, api=api)
    await job.create()
    return job


async def eventually(
    probe: Callable[[], Any], accept: Callable[[Any], bool] = bool, seconds: float = 5
) -> Any:
    """Poll `probe` (sync or async) until `accept` takes what it returns; return that."""
    async with asyncio.timeout(seconds):
        while True:
            result = probe()
            if asyncio.iscoroutine(result):
                result = await result
            if accept(result):
                return result
            await asyncio.sleep(0.02)


async def conditions(job: Job) -> dict[str, dict]:
    await job.refresh()
    return {c["type"]: c for c in job.raw.get("status", {}).get("conditions", [])}


async def finished(job: Job) -> dict[str, dict]:
    async def done() -> dict[str, dict] | None:
        found = await conditions(job)
        return found if {"Complete", "Failed"} & found.keys() else None

    return await eventually(done)


async def job_pod(api: Any, name: str) -> Pod:
    async def found() -> Pod | None:
        pods = [
            pod async for pod in api.get("pods", namespace=NS, label_selector={"job-name": name})
        ]
        return pods[0] if pods else None

    return await eventually(found)


def container_status(pod: Pod) -> dict:
    return pod.raw["status"]["containerStatuses"][0]


async def waiting_reason(pod: Pod) -> str | None:
    """Why the Pod's container is not running: an unscheduled Pod's reason, or the
    container's waiting reason."""
    await pod.refresh()
    status = pod.raw["status"]
    for condition in status.get("conditions", []):
        if condition["type"] == "PodScheduled" and condition["status"] == "False":
            return condition["reason"]
    statuses = status.get("containerStatuses") or [{}]
    return statuses[0].get("state", {}).get("waiting", {}).get("reason")


async def running_pid(pod: Pod) -> int | None:
    """The container's process id, from the emulator's containerID (emulator://<pid>)."""
    await pod.refresh()
    statuses = pod.raw["status"].get("containerStatuses") or [{}]
    if "running" not in statuses[0].get("state", {}):
        return None
    return int(statuses[0]["containerID"].removeprefix("emulator://"))


async def test_a_failing_job_has_its_pod_exit_code_and_log(
    api: Any, emulator: KubernetesEmulator
) -> None:
    job = await create_job(api, job_manifest("fails", command=["sh", "-c", "echo hi; exit 3"]))
    pod = await job_pod(api, "fails")
    labels = pod.labels
    assert labels["job-name"] == labels["batch.kubernetes.io/job-name"] == "fails"
    assert labels["controller-uid"] == job.metadata.uid
    assert pod.name.startswith("fails-") and len(pod.name) == len("fails-") + 5
    [owner] = pod.metadata.ownerReferences
    assert (owner.kind, owner.uid, owner.controller) == ("Job", job.metadata.uid, True)

    found = await finished(job)
    assert found["Failed"]["reason"] == found["FailureTarget"]["reason"] == "BackoffLimitExceeded"
    assert job.status.failed == 1 and "active" not in job.status
    await pod.refresh()
    terminated = container_status(pod)["state"]["terminated"]
    assert pod.status.phase == "Failed"
    assert (terminated["exitCode"], terminated["reason"]) == (3, "Error")
    assert [line async for line in pod.logs(tail_lines=10)] == ["hi"]
    assert emulator.jobs_created("fails", NS) == 1


async def test_a_pod_waits_for_its_secret_then_completes(api: Any) -> None:
    manifest = job_manifest("reads-secret", command=["sh", "-c", 'echo "token=$TOKEN"'])
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    ref = {"name": "reads-secret", "key": "token"}
    container["env"] = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": ref}}]
    job = await create_job(api, manifest)
    pod = await job_pod(api, "reads-secret")
    reason = "CreateContainerConfigError"
    await eventually(lambda: waiting_reason(pod), lambda found: found == reason)
    assert pod.status.phase == "Pending"
    secret = await Secret(
        {"metadata": {"name": "reads-secret", "namespace": NS}, "stringData": {"token": "s3cret"}},
        api=api,
    )
    await secret.create()
    assert secret.raw["data"] == {"token": "czNjcmV0"}  # stringData is stored as base64 data

    found = await finished(job)
    assert found["Complete"]["status"] == "True" and "SuccessCriteriaMet" in found
    assert job.status.succeeded == 1 and job.status.completionTime
    await pod.refresh()
    assert container_status(pod)["state"]["terminated"]["reason"] == "Completed"
    assert [line async for line in pod.logs()] == ["token=s3cret"]


async def test_a_finished_job_goes_after_its_ttl(api: Any, emulator: KubernetesEmulator) -> None:
    manifest = job_manifest("brief", command=["true"])
    manifest["spec"]["ttlSecondsAfterFinished"] = 0
    await create_job(api, manifest)
    await eventually(lambda: emulator.jobs_created("brief", NS) and not emulator.objects("jobs"))
    await eventually(lambda: not emulator.objects("pods"))


async def test_watch_streams_events_resumes_and_ends_when_broken(
    api: Any, emulator: KubernetesEmulator
) -> None:
    events: list[tuple[str, str]] = []

    async def watch() -> None:
        async for kind, pod in api.watch("pods", namespace=NS, label_selector={"job-name": "w"}):
            events.append((kind, pod.status.get("phase", "")))

    watcher = asyncio.create_task(watch())
    await eventually(lambda: any("watch=true" in r.query for r in emulator.requests))
    job = await create_job(api, job_manifest("w", command=["true"]))
    await finished(job)
    await eventually(lambda: ("MODIFIED", "Succeeded") in events)
    assert events[0][0] == "ADDED" and ("MODIFIED", "Running") in events
    emulator.break_watches()
    await asyncio.wait_for(watcher, 2)  # the stream ended: a client must re-list

    # A watch from a resourceVersion gets every change after it, and only those.
    await job.refresh()
    since = job.metadata.resourceVersion
    await job.patch({"metadata": {"labels": {"seen": "yes"}}})
    async with contextlib.aclosing(api.watch("jobs", namespace=NS, since=since)) as changes:
        async for kind, changed in changes:
            assert (kind, changed.labels.get("seen")) == ("MODIFIED", "yes")
            break


async def test_errors_are_kubernetes_status_objects(api: Any, emulator: KubernetesEmulator) -> None:
    await create_job(api, job_manifest("once", command=["true"]))
    with pytest.raises(kr8s.ServerError) as conflict:
        await create_job(api, job_manifest("once", command=["true"]))
    assert conflict.value.response is not None and conflict.value.response.status_code == 409
    assert conflict.value.status["reason"] == "AlreadyExists"
    assert str(conflict.value) == 'jobs.batch "once" already exists'
    assert emulator.jobs_created("once", NS) == 1

    # A name too long for the job-name label, and a Pod template that would restart.
    too_long = job_manifest("x" * 64)
    restarting = job_manifest("restarts")
    restarting["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    for manifest in (too_long, restarting):
        with pytest.raises(kr8s.ServerError) as rejected:
            await create_job(api, manifest)
        assert (rejected.value.status["code"], rejected.value.status["reason"]) == (422, "Invalid")

    with pytest.raises(kr8s.NotFoundError):
        await (await Job({"metadata": {"name": "missing", "namespace": NS}}, api=api)).refresh()
    assert emulator.objects("jobs", NS)[0]["metadata"]["name"] == "once"


async def test_labels_patch_and_selectors(api: Any) -> None:
    job = await create_job(api, job_manifest("labelled", command=["true"]))
    await job.patch({"metadata": {"labels": {"team": "a"}}})
    assert job.labels["team"] == "a" and job.metadata.generation == 1
    await create_job(api, job_manifest("other", command=["true"]))

    async def names(**selectors: str) -> list[str]:
        return [job.name async for job in api.get("jobs", namespace=NS, **selectors)]

    assert await names(label_selector="team=a,tier!=b") == ["labelled"]
    assert await names(label_selector="team!=a") == ["other"]
    assert await names(field_selector="metadata.name=other") == ["other"]
    with pytest.raises(kr8s.ServerError) as bad:
        await names(field_selector="spec.parallelism=1")
    assert bad.value.response is not None and bad.value.response.status_code == 400


async def test_foreground_deletion_takes_pod_secret_and_process(
    api: Any, emulator: KubernetesEmulator
) -> None:
    job = await create_job(api, job_manifest("sleeper", image="emulator/sleep"))
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "sleeper", "uid": job.metadata.uid}
    secret = await Secret(
        {"metadata": {"name": "sleeper", "namespace": NS, "ownerReferences": [owner]}}, api=api
    )
    await secret.create()
    pod = await job_pod(api, "sleeper")
    process = await eventually(lambda: running_pid(pod))
    os.kill(process, 0)  # alive

    async def pod_events() -> list[str]:
        return [kind async for kind, _ in pod.watch()]  # from the Pod's resourceVersion

    watcher = asyncio.create_task(pod_events())
    await job.delete(propagation_policy="Foreground")
    await eventually(lambda: not emulator.objects("jobs") and not emulator.objects("pods"))
    assert emulator.objects("secrets") == []
    emulator.break_watches()
    assert (await watcher)[-1] == "DELETED"
    with pytest.raises(ProcessLookupError):
        os.kill(process, 0)


async def test_a_job_deleted_with_no_policy_orphans_its_pod(
    api: Any, emulator: KubernetesEmulator
) -> None:
    job = await create_job(api, job_manifest("orphaner", image="emulator/sleep"))
    pod = await job_pod(api, "orphaner")
    await job.delete()  # batch/v1's default: Orphan
    await pod.refresh()
    assert not emulator.objects("jobs") and not pod.metadata.get("ownerReferences")
    await pod.delete(grace_period=1)
    await eventually(lambda: not emulator.objects("pods"))


@pytest.mark.parametrize(
    ("image", "reason"),
    [
        ("emulator/image-pull-error", "ImagePullBackOff"),
        ("emulator/unschedulable", "Unschedulable"),
    ],
)
async def test_pods_that_never_start(api: Any, image: str, reason: str) -> None:
    job = await create_job(api, job_manifest("stuck", image=image))
    pod = await job_pod(api, "stuck")
    await eventually(lambda: waiting_reason(pod), lambda found: found == reason)
    assert pod.status.phase == "Pending"
    assert await conditions(job) == {} and job.status.active == 1
    with pytest.raises(kr8s.ServerError) as no_log:
        _ = [line async for line in pod.logs()]
    assert no_log.value.status["reason"] == "BadRequest"


async def test_oom_killed_and_evicted_pods(api: Any) -> None:
    oom = await create_job(api, job_manifest("oom", image="emulator/oom"))
    evicted = await create_job(api, job_manifest("evicted", image="emulator/evicted"))
    assert (await finished(oom))["Failed"]["reason"] == "BackoffLimitExceeded"
    terminated = container_status(await job_pod(api, "oom"))["state"]["terminated"]
    assert (terminated["reason"], terminated["exitCode"]) == ("OOMKilled", 137)

    await finished(evicted)
    pod = await job_pod(api, "evicted")
    assert (pod.status.phase, pod.status.reason) == ("Failed", "Evicted")


async def test_active_deadline_kills_the_pod(api: Any, emulator: KubernetesEmulator) -> None:
    manifest = job_manifest("slow", image="emulator/sleep")
    manifest["spec"]["activeDeadlineSeconds"] = 1
    job = await create_job(api, manifest)
    pod = await job_pod(api, "slow")
    process = await eventually(lambda: running_pid(pod))
    found = await finished(job)
    assert found["Failed"]["reason"] == found["FailureTarget"]["reason"] == "DeadlineExceeded"
    assert job.status.failed == 1 and "completionTime" not in job.status
    await eventually(lambda: not emulator.objects("pods"))
    with pytest.raises(ProcessLookupError):
        os.kill(process, 0)


async def test_the_emulator_stops_its_processes_on_exit(tmp_path: Path) -> None:
    async with KubernetesEmulator(tmp_path) as emu:
        api = await kr8s.asyncio.api(url=emu.url, namespace=NS)
        await create_job(api, job_manifest("left", image="emulator/sleep"))
        pod = await job_pod(api, "left")
        process = await eventually(lambda: running_pid(pod))
    with pytest.raises(ProcessLookupError):
        os.kill(process, 0)


def volume_pod(tmp_path: Path, name: str, init: list[str], main: list[str]) -> dict:
    """A Job whose Pod has a claim, an emptyDir and a Secret volume, an init container and
    two containers."""
    mount = tmp_path / "mnt"
    mount.mkdir(exist_ok=True)
    mounts = [
        {"name": "claim", "mountPath": f"{mount}/claim"},
        {"name": "scratch", "mountPath": f"{mount}/scratch"},
        {"name": "secret", "mountPath": f"{mount}/secret", "readOnly": True},
    ]
    manifest = job_manifest(name)
    spec = manifest["spec"]["template"]["spec"]
    spec["volumes"] = [
        {"name": "claim", "persistentVolumeClaim": {"claimName": f"{name}-claim"}},
        {"name": "scratch", "emptyDir": {}},
        {"name": "secret", "secret": {"secretName": f"{name}-secret"}},
    ]
    spec["initContainers"] = [
        {"name": "init", "image": "emulator/run", "command": init, "volumeMounts": mounts}
    ]
    spec["containers"] = [
        {"name": "main", "image": "emulator/run", "command": main, "volumeMounts": mounts},
        {
            "name": "sub",
            "image": "emulator/run",
            "command": ["sh", "-c", f"cat {mount}/claim/note"],
            "volumeMounts": [{"name": "claim", "mountPath": f"{mount}/claim", "subPath": "inner"}],
        },
    ]
    return manifest


async def create_claim_and_secret(api: Any, name: str) -> None:
    claim = await kr8s.asyncio.objects.PersistentVolumeClaim(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": f"{name}-claim", "namespace": NS},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
        api=api,
    )
    await claim.create()
    secret = await Secret(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{name}-secret", "namespace": NS},
            "stringData": {"key.txt": "from the secret\n"},
        },
        api=api,
    )
    await secret.create()


async def test_init_containers_then_containers_share_the_pods_volumes(
    api: Any, emulator: KubernetesEmulator, tmp_path: Path
) -> None:
    """The init container writes the claim (a subPath among it) and the emptyDir; the
    containers read them, each with a log of its own; the Secret volume is read-only; the
    claim waits for its PersistentVolumeClaim, bound at once."""
    mount = tmp_path / "mnt"
    init = [
        "sh",
        "-c",
        f"mkdir -p {mount}/claim/inner && echo first > {mount}/claim/inner/note"
        f" && echo scratch > {mount}/scratch/x && echo init ran",
    ]
    main = [
        "sh",
        "-c",
        f"cat {mount}/scratch/x {mount}/secret/key.txt;"
        f" (echo no > {mount}/secret/key.txt) 2>/dev/null || echo read-only",
    ]
    job = await create_job(api, volume_pod(tmp_path, "vols", init, main))
    pod = await job_pod(api, "vols")
    assert await waiting_reason(pod) == "ContainerCreating"  # no claim yet
    await create_claim_and_secret(api, "vols")
    assert "Complete" in await finished(job)
    await pod.refresh()
    (claim,) = emulator.objects("persistentvolumeclaims", NS)
    assert claim["status"]["phase"] == "Bound"
    assert [s["name"] for s in pod.raw["status"]["initContainerStatuses"]] == ["init"]
    assert sorted(s["name"] for s in pod.raw["status"]["containerStatuses"]) == ["main", "sub"]
    assert [line async for line in pod.logs(container="init")] == ["init ran"]
    assert [line async for line in pod.logs(container="main")] == [
        "scratch",
        "from the secret",
        "read-only",
    ]
    assert [line async for line in pod.logs(container="sub")] == ["first"]


async def test_a_failed_init_container_fails_the_pod_before_its_containers(
    api: Any, emulator: KubernetesEmulator, tmp_path: Path
) -> None:
    await create_claim_and_secret(api, "initfails")
    job = await create_job(
        api,
        volume_pod(tmp_path, "initfails", ["sh", "-c", "exit 3"], ["sh", "-c", "echo main ran"]),
    )
    assert "Failed" in await finished(job)
    pod = await job_pod(api, "initfails")
    (init,) = pod.raw["status"]["initContainerStatuses"]
    assert init["state"]["terminated"]["exitCode"] == 3
    # Its containers never ran.
    states = [s["state"] for s in pod.raw["status"].get("containerStatuses", [])]
    assert all(set(state) == {"waiting"} for state in states), states
    assert not emulator.kubelet.log_path(pod.raw, "main").exists()
