"""The Kubernetes manifests in deploy/k8s: every object they build is valid for the pinned
Kubernetes version (tests/k8s_schema.py), the security properties hold (non-root, no privilege,
least-privilege RBAC, agents fenced in by a NetworkPolicy, root only in the coding agents'
sandbox namespace under gVisor, within the Pod Security Standard each namespace enforces), and
the pieces agree with each other and with the `darl` command line. The kustomizations are
built here without kustomize, for the few features they use."""

from __future__ import annotations

import base64
import copy
import re
import shlex
from pathlib import Path
from typing import Any

import jinja2
import pytest
import typer
import typer.main
import yaml
from temporalio.exceptions import ApplicationError

from darl.activities.agent_contract import ContractIssuer
from darl.activities.runners.kubernetes import KubernetesJobRunner
from darl.activities.runners.kubernetes_grading import KubernetesGrading
from darl.activities.runners.kubernetes_settings import KubernetesSettings
from darl.workflows import search_attributes
from darl.workflows.contracts import (
    AgentHandle,
    AwaitRequest,
    GraderSpec,
    KubernetesAgentSpec,
    RewardSpec,
    RolloutSpec,
    RolloutTimeouts,
)
from darl.workflows.training_config import TrainingConfig
from tests.k8s_emulator_pods import expand
from tests.k8s_schema import InvalidObject, validate

REPO = Path(__file__).parents[2]
K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
EXAMPLE = K8S / "examples" / "arithmetic"
JOB_TEMPLATE = EXAMPLE / "job-template.yaml"
TEMPORAL_DEV = K8S / "examples" / "temporal-dev"
SWE = K8S / "examples" / "swe"
SWE_JOB_TEMPLATE = SWE / "job-template.yaml"
SWE_AGENT_CONFIG = SWE / "mini-swe-agent.yaml"
KUSTOMIZATIONS = [BASE, EXAMPLE, TEMPORAL_DEV, SWE]
UID = 10001
GATEWAY_PORT = 8100

# --- a small `kustomize build` ------------------------------------------------------------


def build(directory: Path) -> list[dict]:
    """What `kustomize build directory` gives for the fields DARL's kustomizations use, with
    generated names left without their hash suffix. Secrets come from the `.example` of
    their env file (the real one is the user's and not in git)."""
    kustomization = _load_kustomization(directory, "Kustomization")
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += build(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    _apply(kustomization, directory, objects)
    return objects


def _load_kustomization(directory: Path, kind: str) -> dict:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kustomization["kind"] == kind, directory
    known = {"apiVersion", "kind", "resources", "components", "images", "patches"}
    known |= {"configMapGenerator", "secretGenerator"}
    assert set(kustomization) <= known, f"{directory}: teach build() {set(kustomization) - known}"
    return kustomization


def _apply(kustomization: dict, directory: Path, objects: list[dict]) -> None:
    for kind, key in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for generator in kustomization.get(key, []):
            _generate(kind, generator, directory, objects)
    for entry in kustomization.get("components", []):
        component = directory / entry
        loaded = _load_kustomization(component, "Component")
        for resource in loaded.get("resources", []):
            objects += [d for d in yaml.safe_load_all((component / resource).read_text()) if d]
        _apply(loaded, component, objects)
    for patch in kustomization.get("patches", []):
        targets = [o for o in objects if _matches(o, patch["target"])]
        assert targets, f"{directory}: a patch matches nothing: {patch['target']}"
        for target in targets:
            _json_patch(target, yaml.safe_load(patch["patch"]))
    for image in kustomization.get("images", []):
        for _, pod in _pods(objects):
            for container in pod["containers"]:
                if re.split(r"[:@]", container["image"])[0] == image["name"]:
                    container["image"] = f"{image['newName']}:{image['newTag']}"


def _generate(kind: str, generator: dict, directory: Path, objects: list[dict]) -> None:
    data: dict[str, str] = {}
    for source in generator.get("files", []):
        key, _, file = source.rpartition("=") if "=" in source else (Path(source).name, "", source)
        data[key] = (directory / file).read_text()
    for source in generator.get("envs", []):
        path = directory / source
        example = path.with_name(path.name + ".example")
        data |= _env_file(example if example.exists() else path)
    metadata = {"name": generator["name"], "namespace": generator.get("namespace", "default")}
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": kind, "metadata": metadata}
    if kind == "Secret":
        obj["type"] = generator.get("type", "Opaque")
        obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    else:
        obj["data"] = data
    same = [o for o in objects if o["kind"] == kind and o["metadata"] == metadata]
    behavior = generator.get("behavior", "create")
    assert bool(same) == (behavior != "create"), f"{kind} {metadata}: behavior {behavior}"
    for old in same:
        objects.remove(old)
    objects.append(obj)


def _env_file(path: Path) -> dict[str, str]:
    """kustomize's env file: KEY=VALUE lines; blank lines and # comments skipped."""
    pairs = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"{path}: {line!r}"
            pairs[key] = value
    return pairs


def _matches(obj: dict, target: dict) -> bool:
    fields = {"kind": obj["kind"], **{k: obj["metadata"].get(k) for k in ("name", "namespace")}}
    return all(fields.get(key) == value for key, value in target.items())


def _json_patch(obj: dict, operations: list[dict]) -> None:
    """RFC 6902 remove/replace/add, failing like kustomize on a path that is not there."""
    for operation in operations:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"][1:].split("/")]
        node: Any = obj
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list) and parts[-1] == "-" and operation["op"] == "add":
            node.append(copy.deepcopy(operation["value"]))
            continue
        last: Any = int(parts[-1]) if isinstance(node, list) else parts[-1]
        if operation["op"] == "remove":
            del node[last]
        elif operation["op"] == "replace":
            _ = node[last]  # replace needs the path to be there, as in kustomize
            node[last] = copy.deepcopy(operation["value"])
        elif operation["op"] == "add" and isinstance(node, list):
            node.insert(last, copy.deepcopy(operation["value"]))
        elif operation["op"] == "add":
            node[last] = copy.deepcopy(operation["value"])
        else:
            raise AssertionError(f"teach _json_patch {operation['op']}")


def _pods(objects: list[dict]) -> list[tuple[str, dict]]:
    """(name, Pod spec) of every workload."""
    workloads = ("Deployment", "StatefulSet", "DaemonSet", "Job")
    return [
        (o["metadata"]["name"], o["spec"]["template"]["spec"])
        for o in objects
        if o["kind"] in workloads
    ]


# --- helpers over the built objects -------------------------------------------------------


def find(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def container(objects: list[dict], deployment: str) -> dict:
    (only,) = find(objects, "Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return only


def flags(box: dict) -> dict[str, str]:
    """`--name=value` arguments as a dict (the manifests write every flag that way)."""
    return dict(arg[2:].split("=", 1) for arg in box["args"][1:])


def render_job_template(task: dict) -> dict:
    """The example's template rendered as the runner renders it, then named as it names it."""
    templates = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
    text = templates.from_string(JOB_TEMPLATE.read_text()).render(
        task=task, rollout_id="arith.e0.t3.1", attempt=1, run_id="arith", mode="train"
    )
    job = yaml.safe_load(text)
    job["metadata"] |= {"name": "darl-arith-e0-t3-1-0123abcd-a1", "namespace": "darl-agents"}
    return job


BUILT = {directory.relative_to(K8S).as_posix(): build(directory) for directory in KUSTOMIZATIONS}
ALL_OBJECTS = [
    pytest.param(obj, id=f"{where}:{obj['kind']}/{obj['metadata']['name']}")
    for where, objects in BUILT.items()
    for obj in objects
]
TASKS = [
    {"id": "t00", "question": "What is 3 + 4?", "answer": "7"},
    {"id": 7, "question": "a number as the id", "answer": "1"},
    {"id": 'it\'s "quoted"\nand: {braces} # no comment', "question": "?", "answer": "0"},
]


# --- validity -----------------------------------------------------------------------------


@pytest.mark.parametrize("obj", ALL_OBJECTS)
def test_every_object_is_valid_kubernetes(obj: dict):
    validate(obj)


@pytest.mark.parametrize("task", TASKS, ids=["text-id", "number-id", "hostile-id"])
def test_the_job_template_renders_to_a_valid_job_for_any_task(task: dict):
    job = render_job_template(task)
    validate(job)
    assert job["metadata"]["annotations"]["darl.dev/task-id"] == str(task["id"])


def test_every_yaml_file_is_built_or_checked():
    """No manifest lies beside the kustomizations unvalidated."""
    reached = {EXAMPLE / "train.yaml", JOB_TEMPLATE, SWE_JOB_TEMPLATE, SWE_AGENT_CONFIG}
    for directory in [*KUSTOMIZATIONS, *K8S.glob("components/*")]:
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        reached |= {directory / "kustomization.yaml"}
        reached |= {directory / r for r in kustomization.get("resources", [])}
    assert {p.resolve() for p in K8S.rglob("*.yaml")} <= {p.resolve() for p in reached}


def test_the_validator_refuses_what_the_api_server_would():
    good = find(BUILT["base"], "Deployment", "darl-gateway")
    broken = copy.deepcopy(good)
    broken["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    broken["metadata"]["labels"]["app.kubernetes.io/name"] = "not a label value"
    broken["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "2 cores"
    with pytest.raises(InvalidObject, match=r"containers\[0\]: Additional properties"):
        validate(broken)
    del broken["spec"]["template"]["spec"]["containers"][0]["securityContex"]
    with pytest.raises(InvalidObject) as caught:
        validate(broken)
    assert len(caught.value.problems) == 2, caught.value
    with pytest.raises(InvalidObject, match="Couldn't find schema"):
        validate({**good, "apiVersion": "apps/v1beta1"})
    with pytest.raises(InvalidObject, match="not a DNS-1123 label"):
        validate(render_job_template(TASKS[0]) | {"metadata": {"name": "x" * 64}})


# --- security -----------------------------------------------------------------------------


SECURED_PODS = [
    pytest.param(pod, id=f"{where}:{name}")
    for where, objects in BUILT.items()
    for name, pod in _pods(objects)
] + [pytest.param(render_job_template(TASKS[0])["spec"]["template"]["spec"], id="job-template")]


@pytest.mark.parametrize("pod", SECURED_PODS)
def test_every_container_runs_unprivileged(pod: dict):
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    assert all("hostPath" not in volume for volume in pod.get("volumes", []))
    pod_context = pod.get("securityContext", {})
    for box in [*pod.get("initContainers", []), *pod["containers"]]:
        context = pod_context | box.get("securityContext", {})
        assert context.get("runAsNonRoot") is True, box["name"]
        assert context.get("runAsUser") == UID, box["name"]
        assert context.get("seccompProfile") == {"type": "RuntimeDefault"}, box["name"]
        assert context.get("allowPrivilegeEscalation") is False, box["name"]
        assert context.get("readOnlyRootFilesystem") is True, box["name"]
        assert context.get("capabilities") == {"drop": ["ALL"]}, box["name"]
        assert not context.get("privileged"), box["name"]
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(box["resources"][bound]), (box["name"], bound)


def test_only_the_rollout_worker_holds_an_api_token():
    for name, pod in _pods(BUILT["base"]):
        if name == "darl-rollout-worker":
            assert pod["serviceAccountName"] == "darl-rollout-worker"
            assert pod["automountServiceAccountToken"] is True
        else:
            assert pod["automountServiceAccountToken"] is False, name
    account = find(BUILT["base"], "ServiceAccount", "darl-rollout-worker")
    assert account["automountServiceAccountToken"] is False


def test_the_rollout_worker_may_do_exactly_what_the_job_runner_needs():
    objects = BUILT["base"]
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    (role,) = [o for o in objects if o["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "darl-agents"
    grants = {
        (group, resource): sorted(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert grants == {
        ("batch", "jobs"): sorted(["create", "get", "list", "watch", "delete"]),
        # Delete: a graded attempt that runs out of time loses its Pod, not its Job.
        ("", "pods"): sorted(["get", "list", "watch", "delete"]),
        ("", "pods/log"): ["get"],
        ("", "secrets"): sorted(["create", "get", "delete"]),
        ("", "persistentvolumeclaims"): sorted(["create", "get", "delete"]),
    }
    (binding,) = [o for o in objects if o["kind"] == "RoleBinding"]
    assert binding["metadata"]["namespace"] == "darl-agents"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "darl-rollout-worker", "namespace": "darl"}
    ]


def test_agents_reach_only_the_gateway_and_dns():
    policies = {
        o["metadata"]["name"]: o["spec"]
        for o in BUILT["base"]
        if o["kind"] == "NetworkPolicy" and o["metadata"]["namespace"] == "darl-agents"
    }
    agents = policies.pop("darl-agents")
    assert agents["podSelector"] == {"matchLabels": {"app.kubernetes.io/managed-by": "darl"}}
    assert sorted(agents["policyTypes"]) == ["Egress", "Ingress"]
    assert agents["ingress"] == []
    gateway_pods = find(BUILT["base"], "Deployment", "darl-gateway")["spec"]["selector"]
    assert agents["egress"] == [
        {
            "to": [
                {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "darl"}},
                    "podSelector": gateway_pods,
                }
            ],
            "ports": [{"protocol": "TCP", "port": GATEWAY_PORT}],
        },
        {
            "to": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                    },
                    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                }
            ],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
        },
    ]
    # Everything else in the namespace: no traffic at all.
    assert policies == {"default-deny": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}}
    for namespace in (o for o in BUILT["base"] if o["kind"] == "Namespace"):
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_the_trainer_gets_a_gpu_unless_the_cpu_component_takes_it_away():
    gpu = find(BUILT["base"], "Deployment", "darl-trainer-worker")["spec"]["template"]["spec"]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu[
        "tolerations"
    ]
    cpu = find(BUILT["examples/arithmetic"], "Deployment", "darl-trainer-worker")
    pod = cpu["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]


# --- the pieces agree ---------------------------------------------------------------------


def _darl_commands() -> dict[str, Any]:
    from darl.deploy.cli import app

    return typer.main.get_command(app).commands


@pytest.mark.parametrize("where", list(BUILT))
def test_containers_use_real_darl_flags_and_variables(where: str):
    commands = _darl_commands()
    for obj in BUILT[where]:
        if obj["kind"] != "Deployment":
            continue
        box = obj["spec"]["template"]["spec"]["containers"][0]
        if "command" in box:  # not `darl` (the dev Temporal)
            continue
        command = commands[box["args"][0]]
        options = {opt[2:] for param in command.params for opt in param.opts}
        assert set(flags(box)) <= options, (box["name"], set(flags(box)) - options)
        variables = {param.envvar for param in command.params}
        darl_env = {e["name"] for e in box.get("env", []) if e["name"].startswith("DARL_K8S")}
        assert darl_env <= variables, (box["name"], darl_env - variables)


def test_the_gateway_is_where_everyone_looks_for_it():
    objects = BUILT["base"]
    gateway = container(objects, "darl-gateway")
    assert flags(gateway)["host"] == "0.0.0.0"
    assert flags(gateway)["port"] == str(GATEWAY_PORT)
    assert gateway["ports"] == [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    service = find(objects, "Service", "darl-gateway")["spec"]
    assert service["ports"] == [
        {"name": "http", "port": GATEWAY_PORT, "targetPort": "http", "protocol": "TCP"}
    ]
    deployment = find(objects, "Deployment", "darl-gateway")
    assert service["selector"] == deployment["spec"]["selector"]["matchLabels"]
    url = f"http://darl-gateway.darl.svc:{GATEWAY_PORT}"
    assert flags(container(objects, "darl-rollout-worker"))["gateway-url"] == url
    policy = find(objects, "Service", "darl-policy-server")["spec"]["ports"][0]["port"]
    assert flags(gateway)["upstream"] == f"http://darl-policy-server.darl.svc:{policy}"


def _mounts(objects: list[dict], deployment: str) -> dict[str, tuple[str, bool]]:
    """claim name -> (mount path, read-only) for a Deployment's volume claims."""
    pod = find(objects, "Deployment", deployment)["spec"]["template"]["spec"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    return {
        claims[m["name"]]: (m["mountPath"], m.get("readOnly", False))
        for m in pod["containers"][0]["volumeMounts"]
        if m["name"] in claims
    }


def test_the_gateway_writes_the_store_the_trainer_reads():
    # The base: one S3 store for every replica and the trainer, credentials from darl-s3.
    objects = BUILT["base"]
    gateway, trainer = container(objects, "darl-gateway"), container(objects, "darl-trainer-worker")
    assert flags(gateway)["store-url"] == flags(trainer)["store-url"]
    assert flags(gateway)["store-url"].startswith("s3://")
    for box in (gateway, trainer):
        assert "store-dir" not in flags(box)
        assert {"secretRef": {"name": "darl-s3", "optional": True}} in box["envFrom"]
    assert "darl-trajectories" not in _mounts(objects, "darl-gateway")
    assert not [o for o in objects if o["metadata"]["name"] == "darl-trajectories"]
    # The directory-store component (the example): the store on one RWX volume instead.
    objects = BUILT["examples/arithmetic"]
    claim = find(objects, "PersistentVolumeClaim", "darl-trajectories")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert _mounts(objects, "darl-gateway")["darl-trajectories"] == ("/data/trajectories", False)
    trainer_mounts = _mounts(objects, "darl-trainer-worker")
    assert trainer_mounts["darl-trajectories"] == ("/data/trajectories", True)
    for deployment in ("darl-gateway", "darl-trainer-worker"):
        assert flags(container(objects, deployment))["store-dir"] == "/data/trajectories"
        assert "store-url" not in flags(container(objects, deployment))
    # Checkpoints travel by path: the policy server sees the runs volume where the trainer does.
    assert trainer_mounts["darl-runs"] == ("/data/runs", False)
    assert _mounts(objects, "darl-policy-server")["darl-runs"][0] == "/data/runs"


def test_the_viewer_reads_what_the_gateway_writes_and_is_reached_by_port_forward():
    # The base: the gateway's S3 store, the runs volume read-only, Temporal as every component.
    objects = BUILT["base"]
    viewer, gateway = container(objects, "darl-viewer"), container(objects, "darl-gateway")
    assert viewer["args"][0] == "viewer"
    assert flags(viewer)["store-url"] == flags(gateway)["store-url"]
    assert "store-dir" not in flags(viewer)
    assert viewer["envFrom"] == gateway["envFrom"]
    assert _mounts(objects, "darl-viewer") == {"darl-runs": ("/data/runs", True)}
    assert flags(viewer)["runs-dir"] == "/data/runs"
    assert flags(viewer)["host"] == "0.0.0.0"
    port = int(flags(viewer)["port"])
    assert viewer["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    # Only inside the cluster (kubectl port-forward): a ClusterIP Service, nothing exposed.
    service = find(objects, "Service", "darl-viewer")["spec"]
    assert service["type"] == "ClusterIP"
    assert service["ports"] == [
        {"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}
    ]
    deployment = find(objects, "Deployment", "darl-viewer")
    assert service["selector"] == deployment["spec"]["selector"]["matchLabels"]
    for where, built in BUILT.items():
        assert not [o for o in built if o["kind"] == "Ingress"], where
        exposed = [o for o in built if o["kind"] == "Service" and o["spec"].get("type")]
        assert {o["spec"]["type"] for o in exposed} <= {"ClusterIP"}, where
    # The directory-store component (the example): the store's volume, read-only.
    objects = BUILT["examples/arithmetic"]
    viewer = container(objects, "darl-viewer")
    assert flags(viewer)["store-dir"] == flags(container(objects, "darl-gateway"))["store-dir"]
    assert "store-url" not in flags(viewer)
    assert _mounts(objects, "darl-viewer") == {
        "darl-trajectories": ("/data/trajectories", True),
        "darl-runs": ("/data/runs", True),
    }


@pytest.mark.parametrize("where", ["base", "examples/arithmetic"])
def test_the_gateway_runs_as_replicas_that_survive_disruption(where: str):
    objects = BUILT[where]
    deployment = find(objects, "Deployment", "darl-gateway")
    spec = deployment["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    pod_labels = spec["template"]["metadata"]["labels"]
    budget = find(objects, "PodDisruptionBudget", "darl-gateway")["spec"]
    assert budget["minAvailable"] == 1
    assert budget["selector"]["matchLabels"].items() <= pod_labels.items()
    pod = spec["template"]["spec"]
    gateway = container(objects, "darl-gateway")
    for probe in ("readinessProbe", "livenessProbe"):
        assert gateway[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    # Out of the endpoints (preStop), then SIGTERM's drain, within the grace period.
    pre_stop = gateway["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(flags(gateway)["shutdown-grace-seconds"])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain
    # Each replica its own name in the shared journal: its Pod's.
    assert flags(gateway)["instance"] == "$(POD_NAME)"
    (name,) = [e for e in gateway["env"] if e["name"] == "POD_NAME"]
    assert name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_the_trainer_finds_every_replica_through_the_headless_service():
    objects = BUILT["base"]
    deployment = find(objects, "Deployment", "darl-gateway")
    headless = find(objects, "Service", "darl-gateway-replicas")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert not headless["spec"].get("publishNotReadyAddresses", False)
    (port,) = headless["spec"]["ports"]
    assert port["targetPort"] == "http"
    # Agents keep the balanced Service (a cluster IP of its own).
    assert "clusterIP" not in find(objects, "Service", "darl-gateway")["spec"]
    config = TrainingConfig.model_validate(yaml.safe_load((EXAMPLE / "train.yaml").read_text()))
    meta = headless["metadata"]
    assert config.weight_sync.admin_urls == [
        f"dns+http://{meta['name']}.{meta['namespace']}.svc:{port['port']}"
    ]


def test_every_reference_to_a_config_map_or_secret_resolves():
    for where, objects in BUILT.items():
        present = {(o["kind"], o["metadata"]["name"]): o for o in objects}
        for _, pod in _pods(objects):
            for box in pod["containers"]:
                for source in box.get("envFrom", []):
                    for kind, ref in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                        if ref in source and not source[ref].get("optional"):
                            assert (kind, source[ref]["name"]) in present, (where, source)
                for env in box.get("env", []):
                    ref = env.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        secret = present[("Secret", ref["name"])]
                        assert ref["key"] in secret["data"], (where, ref)
    keys = find(BUILT["base"], "Secret", "darl-keys")["data"]
    assert set(keys) == {"DARL_TOKEN_SECRET", "DARL_ADMIN_KEY"}


def test_the_example_training_config_fits_the_cluster():
    config = TrainingConfig.model_validate(yaml.safe_load((EXAMPLE / "train.yaml").read_text()))
    objects = BUILT["examples/arithmetic"]
    worker = find(objects, "Deployment", "darl-rollout-worker")["spec"]["template"]["spec"]
    (mount,) = [m for m in worker["containers"][0]["volumeMounts"] if m["name"] == "job-templates"]
    (volume,) = [v for v in worker["volumes"] if v["name"] == "job-templates"]
    templates = find(objects, "ConfigMap", volume["configMap"]["name"])["data"]
    template = Path(config.rollout.agent.job_template)
    assert template.parent == Path(mount["mountPath"])
    assert templates[template.name] == JOB_TEMPLATE.read_text()
    policy = flags(container(objects, "darl-policy-server"))
    assert config.backend.model_dir == policy["model-dir"]
    assert [s.url for s in config.weight_sync.policy_servers] == [
        f"http://darl-policy-server.darl.svc:{policy['port']}"
    ]
    assert {s.kind for s in config.weight_sync.policy_servers} == {"reference"}
    # The image holds the repository under /app.
    assert (REPO / Path(config.dataset.path).relative_to("/app")).is_file()


@pytest.mark.parametrize("dockerfile", [K8S / "Dockerfile", EXAMPLE / "Dockerfile"])
def test_images_run_as_the_numeric_non_root_user(dockerfile: Path):
    text = dockerfile.read_text()
    assert re.findall(r"^USER (.+)$", text, re.M)[-1] == f"{UID}:{UID}"
    for sources in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for source in sources.split():
            assert (REPO / source).exists(), f"{dockerfile}: COPY {source}"


def _search_attribute_types() -> dict[str, str]:
    return dict(flag.split("=") for flag in search_attributes.dev_server_flags()[1::2])


def test_the_dev_temporal_is_what_darl_settings_point_at():
    settings = find(BUILT["base"], "ConfigMap", "darl-settings")["data"]
    objects = BUILT["examples/temporal-dev"]
    args = container(objects, "temporal-dev")["args"]
    registered = dict(a.split("=", 2)[1:] for a in args if a.startswith("--search-attribute="))
    assert registered == _search_attribute_types()
    assert f"--namespace={settings['TEMPORAL_NAMESPACE']}" in args
    host, port = settings["TEMPORAL_ADDRESS"].rsplit(":", 1)
    service, namespace, _ = host.split(".")
    frontend = find(objects, "Service", service)
    assert frontend["metadata"]["namespace"] == namespace
    assert frontend["spec"]["ports"][0]["port"] == int(port)


def test_the_temporal_guide_creates_every_search_attribute():
    guide = (REPO / "docs" / "kubernetes-temporal.md").read_text()
    for name, kind in _search_attribute_types().items():
        assert f"--name {name} --type {kind}" in guide, name


# --- coding agents: root only in the sandbox namespace, under gVisor ----------------------

# The Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards),
# the checks that concern what DARL's Jobs set, as Pod Security admission applies them.
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip


def pod_security_violations(pod: dict, level: str) -> list[str]:
    """What Pod Security admission at `level` (baseline or restricted) refuses in `pod`."""
    found = [
        f"host namespace {key}" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)
    ]
    volumes = pod.get("volumes", [])
    found += [f"hostPath volume {v['name']}" for v in volumes if "hostPath" in v]
    pod_context = pod.get("securityContext", {})
    boxes = [*pod.get("initContainers", []), *pod["containers"]]
    for box in boxes:
        context = box.get("securityContext", {})
        added = set(context.get("capabilities", {}).get("add", []))
        if context.get("privileged"):
            found.append(f"{box['name']}: privileged")
        if added - BASELINE_CAPABILITIES:
            found.append(f"{box['name']}: capabilities {sorted(added - BASELINE_CAPABILITIES)}")
        if any(port.get("hostPort") for port in box.get("ports", [])):
            found.append(f"{box['name']}: hostPort")
        seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get(
            "type"
        )
        if seccomp == "Unconfined":
            found.append(f"{box['name']}: seccomp Unconfined")
        if level != "restricted":
            continue
        merged = pod_context | context
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{box['name']}: allowPrivilegeEscalation != false")
        if merged.get("runAsNonRoot") is not True:
            found.append(f"{box['name']}: runAsNonRoot != true")
        if merged.get("runAsUser") == 0:
            found.append(f"{box['name']}: runAsUser=0")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{box['name']}: seccomp {seccomp}")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{box['name']}: capabilities not dropped")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{box['name']}: capabilities added {capabilities['add']}")
    if level == "restricted":
        for volume in volumes:
            if not set(volume) - {"name"} <= RESTRICTED_VOLUMES:
                found.append(f"volume {volume['name']}: {sorted(set(volume) - {'name'})}")
    return found


def worker_env(objects: list[dict]) -> dict[str, str]:
    box = container(objects, "darl-rollout-worker")
    return {e["name"]: e["value"] for e in box.get("env", []) if "value" in e}


def runner_settings(objects: list[dict]) -> KubernetesSettings:
    """The Kubernetes runner's settings as the rollout worker of `objects` gets them."""
    env = worker_env(objects)
    return KubernetesSettings(
        namespace=env["DARL_K8S_NAMESPACE"],
        sandbox_namespace=env.get("DARL_K8S_SANDBOX_NAMESPACE"),
        sandbox_runtime_class=env.get("DARL_K8S_SANDBOX_RUNTIME_CLASS"),
        grading_image=env.get("DARL_K8S_GRADING_IMAGE"),
    )


def rollout_spec(template: Path, task: dict, graded: bool = False) -> RolloutSpec:
    return RolloutSpec(
        run_id="swe",
        rollout_id="swe.e0.t3.1",
        task=task,
        agent=KubernetesAgentSpec(job_template=str(template)),
        reward=RewardSpec(grader=GraderSpec() if graded else None),
        timeouts=RolloutTimeouts(agent_seconds=7200),
        revision=3,
    )


def enforced_job(
    template: Path, task: dict, settings: KubernetesSettings, graded: bool = False
) -> dict:
    """The Job the Kubernetes runner makes of `template` for `task`: rendered, placed and
    with DARL's fields enforced."""
    spec = rollout_spec(template, task, graded)
    contract = ContractIssuer("http://darl-gateway.darl.svc:8100", b"secret").issue(
        spec, 1, None, {}
    )
    return KubernetesJobRunner(settings).job_manifest(spec, 1, contract)


def grading_job(agent_job: dict, template: Path, task: dict, settings: KubernetesSettings) -> dict:
    """The grading Job the runner makes for the attempt whose Job is `agent_job` (as stored)."""
    stored = {**agent_job, "metadata": {**agent_job["metadata"], "uid": "u-1"}}
    spec = rollout_spec(template, task, graded=True)
    handle = AgentHandle(kind="kubernetes", rollout_id=spec.rollout_id, attempt=1, started_at=0)
    request = AwaitRequest(spec=spec, attempt=1, handle=handle, one_activity=True)
    return KubernetesGrading(KubernetesJobRunner(settings)).grading_job(stored, request)


def namespace_level(objects: list[dict], name: str) -> str:
    return find(objects, "Namespace", name)["metadata"]["labels"][
        "pod-security.kubernetes.io/enforce"
    ]


SWE_TASKS = [
    {
        "instance_id": "john-kurkowski__tldextract.3d1bf184.func_pm_remove_cond__1",
        "repo": "swesmith/john-kurkowski__tldextract.3d1bf184",
        "image_name": "jyangballin/swesmith.x86_64.john-kurkowski_1776_tldextract.3d1bf184",
        "problem_statement": "Subdomains are dropped when the suffix is private.",
        "FAIL_TO_PASS": ["tests/main_test.py::test_private_domains"],
        "PASS_TO_PASS": [],
    },
    {
        "instance_id": 'it\'s "quoted"',
        "image_name": "registry.example.com/task:1",
        "problem_statement": 'Costs $$5 or $(HOME) or $PATH: {x} # no comment\n  "quoted"\\ $',
    },
]


@pytest.mark.parametrize("task", SWE_TASKS, ids=["swe-smith", "hostile"])
def test_the_swe_job_runs_the_task_image_as_root_in_the_sandbox_under_gvisor(task: dict):
    objects = BUILT["examples/swe"]
    settings = runner_settings(objects)
    job = enforced_job(SWE_JOB_TEMPLATE, task, settings)
    validate(job)
    assert job["metadata"]["namespace"] == settings.sandbox_namespace
    assert job["metadata"]["annotations"]["darl.dev/task-id"] == task["instance_id"]
    pod = job["spec"]["template"]["spec"]
    runtime = find(objects, "RuntimeClass", pod["runtimeClassName"])
    assert runtime["handler"] == "runsc"
    assert runtime["scheduling"]["nodeSelector"] == {"sandbox.darl.dev/gvisor": "true"}
    (agent,) = pod["containers"]
    assert agent["image"] == task["image_name"] and agent["workingDir"] == "/testbed"
    assert pod["securityContext"]["runAsUser"] == 0
    # The problem statement reaches mini's --task exactly, through Kubernetes' expansion of
    # the environment and of the command, and the shell's of "$PROBLEM".
    env: dict[str, str] = {}
    for var in agent["env"]:
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
    assert env["PROBLEM"] == task["problem_statement"]
    assert agent["command"] == ["/bin/sh", "-c"]
    (script,) = [expand(arg, env) for arg in agent["args"]]
    assert script == agent["args"][0] and '--task="$PROBLEM"' in script
    assert env["MSWEA_CONFIGURED"] == "true" and env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    # Contained as any agent, root and the six capabilities aside.
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] == 7200
    assert pod["automountServiceAccountToken"] is False and pod["restartPolicy"] == "Never"
    for box in [*pod["initContainers"], agent]:
        assert box["securityContext"]["allowPrivilegeEscalation"] is False
        assert box["securityContext"]["capabilities"] == {
            "drop": ["ALL"],
            "add": ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "SETGID", "SETUID"],
        }


def test_the_swe_job_is_admitted_by_its_namespace_and_would_be_refused_by_the_agents_one():
    objects = BUILT["examples/swe"]
    settings = runner_settings(objects)
    pod = enforced_job(SWE_JOB_TEMPLATE, SWE_TASKS[0], settings)["spec"]["template"]["spec"]
    sandbox = namespace_level(objects, settings.sandbox_namespace or "")
    assert sandbox == "baseline"
    assert pod_security_violations(pod, sandbox) == []
    assert namespace_level(objects, settings.namespace) == "restricted"
    refused = pod_security_violations(pod, "restricted")
    assert "agent: runAsUser=0" in refused and "agent: runAsNonRoot != true" in refused
    # Every other Job stays where it was, and restricted admits it.
    arithmetic = enforced_job(JOB_TEMPLATE, TASKS[0], settings)
    assert arithmetic["metadata"]["namespace"] == settings.namespace
    assert "runtimeClassName" not in arithmetic["spec"]["template"]["spec"]
    assert pod_security_violations(arithmetic["spec"]["template"]["spec"], "restricted") == []


GRADED_TASK = {
    **SWE_TASKS[0],
    "FAIL_TO_PASS": ["tests/main_test.py::test_private_domains"],
    "PASS_TO_PASS": [],
    "test_patch": "(the hidden tests)",
}


@pytest.mark.parametrize("where", ["examples/swe", "examples/arithmetic"])
def test_a_graded_attempt_and_its_grading_are_admitted_and_fenced(where: str):
    """The SWE Job (root, in the sandbox namespace) and a non-root one: graded, each works on
    its attempt's volume (the seed first, the agent's workdir on the volume, the base in no
    container of the agent's), and its grading Job is admitted where it runs, carries none
    of the agent contract, and is selected by no NetworkPolicy but default-deny."""
    objects = BUILT[where]
    settings = runner_settings(objects)
    settings = KubernetesSettings(
        **{**settings.__dict__, "grading_image": "registry.example.com/darl:0.1.0"}
    )
    template = SWE_JOB_TEMPLATE if where == "examples/swe" else JOB_TEMPLATE
    task = GRADED_TASK if where == "examples/swe" else {**TASKS[0], **GRADED_TASK}
    job = enforced_job(template, task, settings, graded=True)
    validate(job)
    pod = job["spec"]["template"]["spec"]
    seed, *_ = pod["initContainers"]
    assert seed["name"] == "darl-seed" and seed["image"] == pod["containers"][0]["image"]
    agent = pod["containers"][0]
    (workspace,) = [m for m in agent["volumeMounts"] if m["name"] == "darl-attempt"]
    assert workspace == {"name": "darl-attempt", "mountPath": "/testbed", "subPath": "workspace"}
    namespace = job["metadata"]["namespace"]
    level = namespace_level(objects, namespace)
    assert pod_security_violations(pod, level) == []
    grading = grading_job(job, template, task, settings)
    validate(grading)
    grading_pod = grading["spec"]["template"]["spec"]
    assert grading["metadata"]["namespace"] == namespace
    assert grading_pod.get("runtimeClassName") == pod.get("runtimeClassName")
    assert pod_security_violations(grading_pod, level) == []
    (prepare,) = grading_pod["initContainers"]
    (tests,) = grading_pod["containers"]
    assert prepare["image"] == "registry.example.com/darl:0.1.0"
    assert tests["image"] == agent["image"]
    names = {var["name"] for var in tests["env"]}
    assert not {n for n in names if n.startswith(("DARL_", "OPENAI_", "ANTHROPIC_", "AGL_"))}
    assert not any("valueFrom" in var for var in tests["env"])
    # No NetworkPolicy of the namespace selects the grading Pod but default-deny.
    labels = grading["spec"]["template"]["metadata"]["labels"]
    policies = [
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["namespace"] == namespace
    ]
    selecting = [
        p["metadata"]["name"]
        for p in policies
        if all(
            labels.get(k) == v for k, v in p["spec"]["podSelector"].get("matchLabels", {}).items()
        )
    ]
    assert selecting == ["default-deny"]


def test_a_worker_without_a_sandbox_refuses_the_swe_job():
    settings = runner_settings(BUILT["examples/arithmetic"])
    assert settings.sandbox_namespace is None
    with pytest.raises(ApplicationError, match=r"asks for root \(runAsUser: 0\)"):
        enforced_job(SWE_JOB_TEMPLATE, SWE_TASKS[0], settings)


def test_sandboxed_agents_get_the_same_fence_and_the_worker_the_same_rights():
    objects = BUILT["examples/swe"]
    sandbox = runner_settings(objects).sandbox_namespace

    def in_namespace(kind: str, namespace: str | None) -> dict[str, dict]:
        return {
            o["metadata"]["name"]: o
            for o in objects
            if o["kind"] == kind and o["metadata"].get("namespace") == namespace
        }

    for kind, field in (("NetworkPolicy", "spec"), ("Role", "rules"), ("RoleBinding", "subjects")):
        agents, sandboxed = in_namespace(kind, "darl-agents"), in_namespace(kind, sandbox)
        assert set(agents) == set(sandboxed), kind
        for name in agents:
            assert sandboxed[name][field] == agents[name][field], (kind, name)
    # The runner's Jobs carry the label the policy selects.
    policy = in_namespace("NetworkPolicy", sandbox)["darl-agents"]["spec"]
    assert policy["podSelector"] == {"matchLabels": {"app.kubernetes.io/managed-by": "darl"}}
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_the_swe_overlay_gives_the_worker_its_template_and_the_jobs_their_config():
    objects = BUILT["examples/swe"]
    templates = find(objects, "ConfigMap", "darl-job-templates")["data"]
    assert templates == {"swe.yaml": SWE_JOB_TEMPLATE.read_text()}
    job = enforced_job(SWE_JOB_TEMPLATE, SWE_TASKS[0], runner_settings(objects))
    pod = job["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    config = find(objects, "ConfigMap", volume["configMap"]["name"])
    assert config["metadata"]["namespace"] == job["metadata"]["namespace"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    (file,) = config["data"]
    assert config["data"][file] == SWE_AGENT_CONFIG.read_text()
    words = shlex.split(pod["containers"][0]["args"][0])
    assert f"--config={mount['mountPath']}/{file}" in words
    # The harness the init container copies is where the agent runs it from.
    (init,) = pod["initContainers"]
    (harness,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "harness"]
    assert init["command"][-2:] == [f"{harness['mountPath']}/.", "/harness/"]
    assert words[0].startswith(harness["mountPath"] + "/")
    # An episode that filled the context ends the Job as a success, as in the local recipe.
    output = next(w.removeprefix("--output=") for w in words if w.startswith("--output="))
    assert words[words.index("||") + 1 :] == [
        "grep", "-q", '"exit_status": "ContextWindowExceededError"', output,
    ]  # fmt: skip
