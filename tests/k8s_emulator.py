"""A Kubernetes API emulator for tests, not Kubernetes: just enough of the API server for
kr8s's async client to create, get, list, watch, patch and delete Jobs, Pods and Secrets over
real HTTP, with Kubernetes' Status errors, watch streams and garbage collection. What Pods do
(chosen by their image) and the Job controller live in `k8s_emulator_pods`."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import copy
import json
import re
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from darl.deploy.serving import bind
from tests.k8s_emulator_pods import JobController, Kubelet, TaskSet, name_suffix, now


@dataclass(frozen=True)
class Resource:
    plural: str
    kind: str
    group: str = ""
    short_names: tuple[str, ...] = ()
    fields: frozenset[str] = frozenset({"metadata.name", "metadata.namespace"})

    @property
    def api_version(self) -> str:
        return f"{self.group}/v1" if self.group else "v1"

    @property
    def qualified(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


PODS = Resource("pods", "Pod", short_names=("po",), fields=Resource.fields | {"status.phase"})
SECRETS = Resource("secrets", "Secret", fields=Resource.fields | {"type"})
JOBS = Resource("jobs", "Job", group="batch")
CLAIMS = Resource("persistentvolumeclaims", "PersistentVolumeClaim", short_names=("pvc",))
RESOURCES = {resource.plural: resource for resource in (PODS, SECRETS, JOBS, CLAIMS)}
# batch/v1 Jobs orphan their Pods when a DELETE names no policy (kubectl sends Background).
DEFAULT_PROPAGATION = {"jobs": "Orphan"}
# Metadata only the server sets; a patch cannot change these nor the name and namespace.
SERVER_FIELDS = (
    "uid",
    "creationTimestamp",
    "resourceVersion",
    "generation",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
)
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


class ApiError(Exception):
    """A request the emulated API server refuses, answered with a Kubernetes Status."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.details = code, reason, details

    def status(self) -> dict:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
        body.update(message=str(self), reason=self.reason, code=self.code)
        if self.details:
            body["details"] = self.details
        return body


def _details(resource: Resource, name: str) -> dict:
    details = {"name": name, "kind": resource.plural}
    return {**details, "group": resource.group} if resource.group else details


def not_found(resource: Resource, name: str) -> ApiError:
    message = f'{resource.qualified} "{name}" not found'
    return ApiError(404, "NotFound", message, _details(resource, name))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(resource: Resource, name: str, errors: list[tuple[str, str]]) -> ApiError:
    shown = [f"{path}: {message}" for path, message in errors]
    kind = f"{resource.kind}.{resource.group}" if resource.group else resource.kind
    text = shown[0] if len(shown) == 1 else "[" + ", ".join(shown) + "]"
    causes = [{"reason": "FieldValueInvalid", "message": m, "field": p} for p, m in errors]
    details = {**_details(resource, name), "kind": resource.kind, "causes": causes}
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {text}', details)


# --- selectors ------------------------------------------------------------------------------


def selector_matcher(resource: Resource, labels: str, fields: str) -> Callable[[dict], bool]:
    """Equality selectors (`a=b`, `a==b`, `a!=b`, joined by commas) on labels, and on the
    fields Kubernetes lets one select a resource by (400 for any other field)."""
    tests: list[tuple[bool, str, str, bool]] = []
    for selector, on_labels in ((labels, True), (fields, False)):
        for part in filter(None, (part.strip() for part in selector.split(","))):
            found = re.fullmatch(r"([\w./-]+)\s*(==|=|!=)\s*([\w.-]*)", part)
            if found is None:
                raise bad_request(f"the emulator takes only equality selectors, not {part!r}")
            key, op, value = found.groups()
            if not on_labels and key not in resource.fields:
                raise bad_request(f'field label not supported: "{key}"')
            tests.append((on_labels, key, value, op != "!="))
    return lambda obj: all((_value(obj, on, key) == v) == eq for on, key, v, eq in tests)


def _value(obj: dict, on_labels: bool, key: str) -> str | None:
    if on_labels:
        return (obj["metadata"].get("labels") or {}).get(key)
    value: Any = obj
    for part in key.split("."):
        value = value.get(part, "") if isinstance(value, dict) else ""
    return str(value)


# --- storage and watch ----------------------------------------------------------------------


@dataclass(frozen=True)
class StoreEvent:
    resource_version: int
    type: str  # ADDED | MODIFIED | DELETED
    plural: str
    obj: dict


class ObjectStore:
    """The emulator's etcd: objects by (resource, namespace, name), one resourceVersion
    counter, the whole event history (any watch can resume: nothing expires, no 410), and
    the controllers that react to each change, called in order as it is written."""

    def __init__(self) -> None:
        self._objects: dict[tuple[str, str, str], dict] = {}
        self._history: list[StoreEvent] = []
        self._streams: set[asyncio.Queue[StoreEvent | None]] = set()
        self.listeners: list[Callable[[StoreEvent], None]] = []

    @property
    def resource_version(self) -> str:
        return str(len(self._history))

    def get(self, plural: str, namespace: str, name: str) -> dict | None:
        obj = self._objects.get((plural, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def list(
        self, plural: str, namespace: str | None, match: Callable[[dict], bool] | None = None
    ) -> list[dict]:
        return [
            copy.deepcopy(obj)
            for (kind, ns, _), obj in sorted(self._objects.items())
            if kind == plural and namespace in (None, ns) and (match is None or match(obj))
        ]

    def write(self, plural: str, obj: dict, event_type: str) -> dict:
        """Store (or, for DELETED, remove) the object under a new resourceVersion, then tell
        the watches and the controllers."""
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(len(self._history) + 1)
        meta = obj["metadata"]
        key = (plural, meta["namespace"], meta["name"])
        if event_type == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        event = StoreEvent(len(self._history) + 1, event_type, plural, copy.deepcopy(obj))
        self._history.append(event)
        for stream in self._streams:
            stream.put_nowait(event)
        for listener in self.listeners:
            listener(event)
        return copy.deepcopy(obj)

    async def watch(
        self,
        plural: str,
        namespace: str | None,
        match: Callable[[dict], bool],
        since: int | None,
        timeout: float | None,
    ) -> AsyncIterator[dict]:
        """Watch events as the API server sends them: with no resourceVersion, a synthetic
        ADDED for every object that matches now, then live changes; with one, every change
        after it. Ends at `timeout` or when `break_watches` is called."""
        stream: asyncio.Queue[StoreEvent | None] = asyncio.Queue()
        if since is None:
            backlog = [StoreEvent(0, "ADDED", plural, obj) for obj in self.list(plural, None)]
        else:
            backlog = [event for event in self._history if event.resource_version > since]
        self._streams.add(stream)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout

        def wanted(event: StoreEvent) -> bool:
            meta = event.obj["metadata"]
            return (
                event.plural == plural
                and namespace in (None, meta["namespace"])
                and match(event.obj)
            )

        try:
            for event in backlog:
                if wanted(event):
                    yield {"type": event.type, "object": event.obj}
            while True:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    event = await asyncio.wait_for(stream.get(), remaining)
                except TimeoutError:
                    return
                if event is None:
                    return
                if wanted(event):
                    yield {"type": event.type, "object": event.obj}
        finally:
            self._streams.discard(stream)

    def break_watches(self) -> None:
        for stream in self._streams:
            stream.put_nowait(None)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (strategic merge patches are applied the same way)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# --- the emulator ---------------------------------------------------------------------------


@dataclass
class RequestRecord:
    method: str
    path: str
    query: str
    status: int = 0


class KubernetesEmulator:
    """A Kubernetes API emulator for tests, not Kubernetes, served on 127.0.0.1 in the
    test's event loop. `async with KubernetesEmulator(tmp_path) as emu:` then point kr8s at
    `emu.url`. Namespaces need not be created. On exit every Pod process is killed."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.url = ""
        self.store = ObjectStore()
        self.kubelet = Kubelet(self.store, self.workdir)
        self.job_controller = JobController(
            self.store, lambda ns, pod: self.create(PODS, ns, pod), self.delete_if_present
        )
        self.store.listeners += [
            self.kubelet.on_event,
            self.job_controller.on_event,
            self._collect_garbage,
        ]
        self.requests: list[RequestRecord] = []
        self._jobs_created: Counter[tuple[str, str]] = Counter()
        self._deletions: dict[str, asyncio.Task] = {}
        self._tasks = TaskSet()
        self._server: uvicorn.Server | None = None
        self._serving: asyncio.Task | None = None
        self.app = build_app(self)

    async def __aenter__(self) -> KubernetesEmulator:
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(
            self.app, lifespan="off", log_level="warning", timeout_graceful_shutdown=2
        )
        self._server = _TestServer(config)
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serving.done():
                await self._serving
                raise RuntimeError("the Kubernetes emulator did not start")
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.store.break_watches()
        # Nothing reacts to changes any more; then stop the work in flight and every process.
        self.store.listeners.clear()
        await self._tasks.aclose()
        await self.job_controller.aclose()
        await self.kubelet.aclose()
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await self._serving
        failures = [*self.kubelet.failures, *self.job_controller.failures, *self._tasks.failures]
        if failures and exc_info[0] is None:
            raise RuntimeError("a Kubernetes emulator task failed") from failures[0]

    # --- test hooks ---------------------------------------------------------------------

    def objects(self, plural: str, namespace: str | None = None) -> list[dict]:
        """The stored objects of a resource ("jobs", "pods", "secrets")."""
        return self.store.list(plural, namespace)

    def jobs_created(self, name: str, namespace: str = "default") -> int:
        """How many Jobs of this name were ever created (a 409 does not count)."""
        return self._jobs_created[(namespace, name)]

    def break_watches(self) -> None:
        """End every open watch stream, as an API server restart or a load balancer does."""
        self.store.break_watches()

    # --- the API verbs ------------------------------------------------------------------

    def get(self, resource: Resource, namespace: str, name: str) -> dict:
        obj = self.store.get(resource.plural, namespace, name)
        if obj is None:
            raise not_found(resource, name)
        return obj

    def create(self, resource: Resource, namespace: str, body: dict) -> dict:
        if (
            body.get("apiVersion", resource.api_version) != resource.api_version
            or body.get("kind", resource.kind) != resource.kind
        ):
            raise bad_request(f"the body is not a {resource.api_version} {resource.kind}")
        meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        if meta.get("namespace") not in (None, "", namespace):
            raise bad_request(
                "the namespace of the provided object does not match the namespace sent on "
                "the request"
            )
        obj = {**copy.deepcopy(body), "apiVersion": resource.api_version, "kind": resource.kind}
        meta = obj["metadata"] = {
            key: value for key, value in meta.items() if key not in SERVER_FIELDS
        }
        name = meta.get("name") or ""
        if not name and meta.get("generateName"):
            name = meta["generateName"][:58] + name_suffix()
        meta.update(name=name, namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=now())
        _apply_defaults(resource, obj)
        if errors := _validate(resource, obj):
            raise invalid(resource, name, errors)
        if self.store.get(resource.plural, namespace, name) is not None:
            message = f'{resource.qualified} "{name}" already exists'
            raise ApiError(409, "AlreadyExists", message, _details(resource, name))
        if resource is JOBS:
            self._jobs_created[(namespace, name)] += 1
        return self.store.write(resource.plural, obj, "ADDED")

    def patch(self, resource: Resource, namespace: str, name: str, body: dict) -> dict:
        """A merge patch (strategic merge is applied the same way) of metadata only."""
        current = self.get(resource, namespace, name)
        if set(body) - {"apiVersion", "kind", "metadata"}:
            raise invalid(resource, name, [("spec", "Forbidden: the emulator patches metadata")])
        meta = merge_patch(current["metadata"], body.get("metadata") or {})
        for key in ("name", "namespace", *SERVER_FIELDS):
            meta.pop(key, None)
            if key in current["metadata"]:
                meta[key] = current["metadata"][key]
        if errors := _label_errors(meta.get("labels"), "metadata.labels"):
            raise invalid(resource, name, errors)
        if meta == current["metadata"]:
            return current
        return self.store.write(resource.plural, {**current, "metadata": meta}, "MODIFIED")

    async def delete(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        policy: str | None = None,
        grace_seconds: int | None = None,
    ) -> dict:
        """DELETE as the API server does it: a Pod terminates (its processes get SIGTERM,
        then SIGKILL after the grace period) before it goes; Foreground keeps the owner,
        marked, until its dependents are gone; Background removes the owner now and the
        garbage collector its dependents; Orphan strips the dependents' ownerReferences."""
        obj = self.get(resource, namespace, name)
        uid = obj["metadata"]["uid"]
        if uid in self._deletions:
            return obj
        policy = policy or DEFAULT_PROPAGATION.get(resource.plural, "Background")
        if policy not in ("Orphan", "Background", "Foreground"):
            raise bad_request(f"unsupported propagationPolicy {policy!r}")
        if policy == "Orphan":
            self._orphan_dependents(obj)
        if resource is not PODS and policy != "Foreground":
            self._remove(resource, obj)
            return obj
        if resource is PODS and grace_seconds is None:
            grace_seconds = obj["spec"].get("terminationGracePeriodSeconds", 30)
        obj = self._mark_terminating(resource, obj, policy, grace_seconds)
        task = self._deletions[uid] = self._tasks.spawn(
            self._finish_deletion(resource, obj, policy)
        )
        task.add_done_callback(lambda _: self._deletions.pop(uid, None))
        return obj

    async def delete_if_present(
        self, plural: str, namespace: str, name: str, policy: str | None
    ) -> None:
        with contextlib.suppress(ApiError):
            await self.delete(RESOURCES[plural], namespace, name, policy)

    def _mark_terminating(
        self, resource: Resource, obj: dict, policy: str, grace_seconds: int | None
    ) -> dict:
        meta = obj["metadata"]
        meta["deletionTimestamp"] = now()
        if resource is PODS:
            meta["deletionGracePeriodSeconds"] = grace_seconds
        if policy == "Foreground":
            meta["finalizers"] = [*meta.get("finalizers", []), "foregroundDeletion"]
        return self.store.write(resource.plural, obj, "MODIFIED")

    async def _finish_deletion(self, resource: Resource, obj: dict, policy: str) -> None:
        if policy == "Foreground":
            await asyncio.gather(*(self._reap(kind, dep) for kind, dep in self._dependents(obj)))
        if resource is PODS:
            await self.kubelet.stop(obj, obj["metadata"]["deletionGracePeriodSeconds"])
        self._remove(resource, obj)

    def _remove(self, resource: Resource, obj: dict) -> None:
        meta = obj["metadata"]
        current = self.store.get(resource.plural, meta["namespace"], meta["name"])
        if current is None or current["metadata"]["uid"] != meta["uid"]:
            return
        finalizers = [
            f for f in current["metadata"].pop("finalizers", []) if f != "foregroundDeletion"
        ]
        if finalizers:
            current["metadata"]["finalizers"] = finalizers
        self.store.write(resource.plural, current, "DELETED")

    async def _reap(self, resource: Resource, obj: dict) -> None:
        """Delete a dependent as the garbage collector does, and wait until it is gone."""
        meta = obj["metadata"]
        await self.delete_if_present(resource.plural, meta["namespace"], meta["name"], None)
        if (task := self._deletions.get(meta["uid"])) is not None:
            await task

    def _dependents(self, owner: dict) -> list[tuple[Resource, dict]]:
        meta = owner["metadata"]

        def owned(obj: dict) -> bool:
            refs = obj["metadata"].get("ownerReferences") or []
            return any(ref.get("uid") == meta["uid"] for ref in refs)

        return [
            (resource, obj)
            for resource in RESOURCES.values()
            for obj in self.store.list(resource.plural, meta["namespace"], owned)
        ]

    def _orphan_dependents(self, owner: dict) -> None:
        uid = owner["metadata"]["uid"]
        for resource, obj in self._dependents(owner):
            refs = obj["metadata"]["ownerReferences"]
            obj["metadata"]["ownerReferences"] = [ref for ref in refs if ref.get("uid") != uid]
            self.store.write(resource.plural, obj, "MODIFIED")

    def _collect_garbage(self, event: StoreEvent) -> None:
        if event.type == "DELETED":
            for resource, obj in self._dependents(event.obj):
                self._tasks.spawn(self._reap(resource, obj))


class _TestServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The test process keeps its own SIGINT/SIGTERM handling.
        yield


# --- defaults and validation ----------------------------------------------------------------


def _apply_defaults(resource: Resource, obj: dict) -> None:
    meta = obj["metadata"]
    if resource is SECRETS:
        _normalize_secret(obj)
        return
    meta["generation"] = 1
    if resource is CLAIMS:
        # Bound at once, as a dynamically provisioned claim soon is.
        spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
        obj["spec"] = {"volumeMode": "Filesystem", **spec}
        requests = (spec.get("resources") or {}).get("requests") or {}
        obj["status"] = {
            "phase": "Bound",
            "accessModes": list(spec.get("accessModes") or []),
            "capacity": {"storage": requests.get("storage", "")},
        }
        return
    spec = obj["spec"] = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    if resource is PODS:
        _default_pod_spec(spec)
        obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        return
    obj["status"] = {}
    defaults = {"backoffLimit": 6, "completions": 1, "parallelism": 1, "suspend": False}
    defaults.update(completionMode="NonIndexed", podReplacementPolicy="TerminatingOrFailed")
    for key, value in defaults.items():
        spec.setdefault(key, value)
    template = spec["template"] = spec.get("template") or {}
    template_meta = template["metadata"] = template.get("metadata") or {}
    if not meta.get("labels") and template_meta.get("labels"):
        meta["labels"] = dict(template_meta["labels"])
    uid, name = meta["uid"], meta["name"]
    template_meta["labels"] = {
        **(template_meta.get("labels") or {}),
        "batch.kubernetes.io/controller-uid": uid,
        "batch.kubernetes.io/job-name": name,
        "controller-uid": uid,
        "job-name": name,
    }
    spec.setdefault("selector", {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}})
    template["spec"] = template.get("spec") or {}
    _default_pod_spec(template["spec"])


def _default_pod_spec(spec: dict) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)


def _normalize_secret(secret: dict) -> None:
    """As the API server stores a Secret: stringData merged into base64 data."""
    data = secret.get("data") or {}
    for key, value in data.items():
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, TypeError) as err:
            raise bad_request(f"Secret data[{key}] is not base64: {err}") from err
    for key, value in (secret.pop("stringData", None) or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    if data:
        secret["data"] = data
    secret.setdefault("type", "Opaque")


def _validate(resource: Resource, obj: dict) -> list[tuple[str, str]]:
    name = obj["metadata"]["name"]
    errors: list[tuple[str, str]] = []
    if not name:
        errors.append(("metadata.name", "Required value: name or generateName is required"))
    elif len(name) > 253 or not DNS_SUBDOMAIN.fullmatch(name):
        errors.append(("metadata.name", f'Invalid value: "{name}": must be an RFC 1123 subdomain'))
    errors += _label_errors(obj["metadata"].get("labels"), "metadata.labels")
    if resource is PODS:
        errors += _pod_spec_errors(obj["spec"], "spec")
    if resource is CLAIMS:
        spec = obj["spec"]
        if not spec.get("accessModes"):
            errors.append(("spec.accessModes", "Required value: at least 1 access mode"))
        if not ((spec.get("resources") or {}).get("requests") or {}).get("storage"):
            errors.append(("spec.resources.requests[storage]", "Required value"))
    if resource is JOBS:
        spec = obj["spec"]
        labels = spec["template"]["metadata"]["labels"]
        errors += _label_errors(labels, "spec.template.metadata.labels")
        errors += _pod_spec_errors(spec["template"]["spec"], "spec.template.spec")
        policy = spec["template"]["spec"]["restartPolicy"]
        if policy != "Never":
            message = f'Unsupported value: "{policy}": supported values: "Never" (emulator)'
            errors.append(("spec.template.spec.restartPolicy", message))
        for key in ("completions", "parallelism"):
            if spec[key] != 1:
                errors.append((f"spec.{key}", "Invalid value: the emulator runs one Pod per Job"))
    return errors


def _label_errors(labels: Any, path: str) -> list[tuple[str, str]]:
    errors = []
    for key, value in (labels or {}).items():
        prefix, _, name = key.rpartition("/")
        if len(name) > 63 or not name or not LABEL_VALUE.fullmatch(name):
            errors.append((path, f'Invalid value: "{key}": not a valid label key'))
        if prefix and (len(prefix) > 253 or not DNS_SUBDOMAIN.fullmatch(prefix)):
            errors.append((path, f'Invalid value: "{key}": the prefix must be a DNS subdomain'))
        if not isinstance(value, str):
            errors.append((f"{path}[{key}]", "Invalid value: a label value must be a string"))
        elif len(value) > 63:
            errors.append((path, f'Invalid value: "{value}": must be no more than 63 characters'))
        elif not LABEL_VALUE.fullmatch(value):
            errors.append((path, f'Invalid value: "{value}": not a valid label value'))
    return errors


def _pod_spec_errors(spec: dict, path: str) -> list[tuple[str, str]]:
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        return [(f"{path}.containers", "Required value")]
    errors = []
    for index, container in enumerate(containers):
        for key in ("name", "image"):
            if not isinstance(container, dict) or not container.get(key):
                errors.append((f"{path}.containers[{index}].{key}", "Required value"))
    return errors


# --- HTTP -----------------------------------------------------------------------------------

VERSION = {
    "major": "1",
    "minor": "33",
    "gitVersion": "v1.33.0-emulator",
    "platform": "linux/amd64",
    "goVersion": "go1.24.0",
}


def _discovery(group_version: str) -> dict:
    resources = []
    for resource in RESOURCES.values():
        if resource.api_version != group_version:
            continue
        verbs = ["create", "delete", "get", "list", "patch", "watch"]
        resources.append(
            {
                "name": resource.plural,
                "singularName": resource.kind.lower(),
                "namespaced": True,
                "kind": resource.kind,
                "verbs": verbs,
                **({"shortNames": list(resource.short_names)} if resource.short_names else {}),
            }
        )
    if group_version == "v1":
        resources.append(
            {"name": "pods/log", "singularName": "", "namespaced": True, "kind": "Pod"}
            | {"verbs": ["get"]}
        )
    return {"kind": "APIResourceList", "groupVersion": group_version, "resources": resources}


MERGE_PATCHES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
BATCH_GROUP = {
    "name": "batch",
    "versions": [{"groupVersion": "batch/v1", "version": "v1"}],
    "preferredVersion": {"groupVersion": "batch/v1", "version": "v1"},
}


class _RequestLog:
    """ASGI middleware noting each request and its status (streams are not buffered)."""

    def __init__(self, app: ASGIApp, records: list[RequestRecord]) -> None:
        self.app, self.records = app, records

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(scope["method"], scope["path"], scope["query_string"].decode())
        self.records.append(record)

        async def noting_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        await self.app(scope, receive, noting_status)


def build_app(emulator: KubernetesEmulator) -> FastAPI:
    app = FastAPI(title="Kubernetes API emulator (tests only)", openapi_url=None)
    app.add_middleware(_RequestLog, records=emulator.requests)
    store = emulator.store

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> Response:
        return JSONResponse(err.status(), err.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        if err.status_code == 404:
            error = ApiError(404, "NotFound", "the server could not find the requested resource")
        else:
            error = ApiError(err.status_code, "MethodNotAllowed", str(err.detail))
        return JSONResponse(error.status(), err.status_code)

    @app.get("/version")
    @app.get("/version/")
    async def version() -> dict:
        return VERSION

    @app.get("/api")
    @app.get("/api/")
    async def core_versions() -> dict:
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}

    @app.get("/api/v1")
    async def core_resources() -> dict:
        return _discovery("v1")

    @app.get("/apis")
    @app.get("/apis/")
    async def groups() -> dict:
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [BATCH_GROUP]}

    @app.get("/apis/batch/v1")
    async def batch_resources() -> dict:
        return _discovery("batch/v1")

    async def collection(request: Request) -> Response:
        resource = _resource(request)
        namespace = request.path_params.get("namespace")
        if request.method == "POST" and namespace is not None:
            obj = emulator.create(resource, namespace, await _body(request))
            return JSONResponse(obj, 201)
        query = request.query_params
        labels, fields = query.get("labelSelector", ""), query.get("fieldSelector", "")
        match = selector_matcher(resource, labels, fields)
        if query.get("watch") in ("true", "1"):
            since = query.get("resourceVersion")
            since_rv = None if since in (None, "", "0") else _integer(query, "resourceVersion")
            timeout = _integer(query, "timeoutSeconds")
            events = store.watch(resource.plural, namespace, match, since_rv, timeout)
            return StreamingResponse(_json_lines(events), media_type="application/json")
        items = [
            {key: value for key, value in obj.items() if key not in ("apiVersion", "kind")}
            for obj in store.list(resource.plural, namespace, match)
        ]
        body = {"kind": f"{resource.kind}List", "apiVersion": resource.api_version}
        body.update(metadata={"resourceVersion": store.resource_version}, items=items)
        return JSONResponse(body)

    async def item(request: Request) -> Response:
        resource = _resource(request)
        namespace, name = request.path_params["namespace"], request.path_params["name"]
        if request.method == "GET":
            return JSONResponse(emulator.get(resource, namespace, name))
        if request.method == "PATCH":
            media = request.headers.get("content-type", "").split(";")[0].strip()
            if media not in MERGE_PATCHES:
                message = f"the emulator supports merge and strategic merge patches, not {media!r}"
                raise ApiError(415, "UnsupportedMediaType", message)
            return JSONResponse(emulator.patch(resource, namespace, name, await _body(request)))
        options = await _body(request, required=False)
        policy = request.query_params.get("propagationPolicy") or options.get("propagationPolicy")
        grace = _integer(request.query_params, "gracePeriodSeconds")
        if grace is None and options.get("gracePeriodSeconds") is not None:
            grace = int(options["gracePeriodSeconds"])
        obj = await emulator.delete(resource, namespace, name, policy, grace)
        return JSONResponse(obj)

    async def pod_log(request: Request) -> Response:
        namespace, name = request.path_params["namespace"], request.path_params["name"]
        pod = emulator.get(PODS, namespace, name)
        spec = pod["spec"]
        names = [c["name"] for c in [*(spec.get("initContainers") or []), *spec["containers"]]]
        container = request.query_params.get("container", spec["containers"][0]["name"])
        if container not in names:
            raise bad_request(f"container {container} is not valid for pod {name}")
        log_path = emulator.kubelet.log_path(pod, container)
        # The log so far, even with follow=true: a client sees that stream end early.
        if not log_path.exists():
            status = pod.get("status", {})
            statuses = [
                s
                for s in [
                    *(status.get("initContainerStatuses") or []),
                    *(status.get("containerStatuses") or []),
                ]
                if s.get("name") == container
            ] or [{}]
            waiting = statuses[0].get("state", {}).get("waiting", {}).get("reason")
            message = f'container "{container}" in pod "{name}" is waiting to start'
            raise bad_request(f"{message}: {waiting or 'ContainerCreating'}")
        text = log_path.read_bytes()
        tail = _integer(request.query_params, "tailLines")
        if tail is not None:
            text = b"".join(text.splitlines(keepends=True)[-tail:]) if tail > 0 else b""
        return Response(text, media_type="text/plain")

    for prefix in ("/api/{version}", "/apis/{group}/{version}"):
        app.add_api_route(prefix + "/{plural}", collection, methods=["GET"])
        named = prefix + "/namespaces/{namespace}/{plural}"
        app.add_api_route(named, collection, methods=["GET", "POST"])
        app.add_api_route(named + "/{name}", item, methods=["GET", "PATCH", "DELETE"])
    app.add_api_route("/api/v1/namespaces/{namespace}/pods/{name}/log", pod_log, methods=["GET"])
    return app


def _resource(request: Request) -> Resource:
    params = request.path_params
    resource = RESOURCES.get(params["plural"])
    group_version = (
        f"{params['group']}/{params['version']}" if "group" in params else params["version"]
    )
    if resource is None or resource.api_version != group_version:
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    return resource


def _integer(query: Mapping[str, str], key: str) -> int | None:
    if query.get(key) in (None, ""):
        return None
    try:
        return int(query[key])
    except ValueError as err:
        raise bad_request(f"{key} must be an integer, not {query[key]!r}") from err


async def _body(request: Request, required: bool = True) -> dict:
    raw = await request.body()
    if not raw.strip() and not required:
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(f"the request body is not JSON: {err}") from err
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


async def _json_lines(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for event in events:
        yield json.dumps(event) + "\n"
