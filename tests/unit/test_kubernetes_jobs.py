"""The Jobs the Kubernetes runner generates: names, labels, the agent contract in the
environment (the token only through the Secret), and the fields DARL enforces over a
template that asks for more. Every generated Job validates against the Kubernetes schema."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from darl.activities.agent_contract import ContractIssuer
from darl.activities.runners.kubernetes import JobRateLimiter, KubernetesJobRunner
from darl.activities.runners.kubernetes_grading import own_storage_eviction
from darl.activities.runners.kubernetes_manifest import job_name
from darl.activities.runners.kubernetes_settings import KubernetesSettings
from darl.workflows.contracts import KubernetesAgentSpec, RolloutSpec, RolloutTimeouts
from tests.k8s_schema import validate

TEMPLATE = Path(__file__).parents[1] / "k8s_fixtures" / "loose-job.yaml"
AGL_TEMPLATE = Path(__file__).parents[1] / "k8s_fixtures" / "agl-job.yaml"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def spec(
    agent: KubernetesAgentSpec, rollout_id: str = "run.e0.t3.1", task: object = None
) -> RolloutSpec:
    return RolloutSpec(
        run_id="run",
        rollout_id=rollout_id,
        group_id="run.e0.t3",
        task=task if task is not None else {"id": "t3", "question": "2+2", "answer": "4"},
        agent=agent,
        timeouts=RolloutTimeouts(agent_seconds=90),
    )


def manifest(rollout: RolloutSpec, attempt: int = 1) -> dict:
    runner = KubernetesJobRunner(KubernetesSettings(namespace="agents"))
    contract = ContractIssuer("http://darl-gateway.darl.svc:8100", b"secret").issue(
        rollout, attempt, None, rollout.agent.env_map
    )
    return runner.job_manifest(rollout, attempt, contract)


@pytest.mark.parametrize(
    "rollout_id", ["r", "run.e0.t3.1", "A_Very.Long-Rollout_id." * 8, "x" * 200]
)
def test_job_names_are_dns_labels_unique_per_rollout_and_attempt(rollout_id: str):
    name = job_name(rollout_id, 3)
    assert DNS_LABEL.match(name) and len(name) <= 63
    assert name == job_name(rollout_id, 3) != job_name(rollout_id, 4)
    assert name != job_name(rollout_id + "x", 3)


def test_a_template_is_rendered_and_tightened():
    job = manifest(spec(KubernetesAgentSpec(job_template=str(TEMPLATE))), attempt=2)
    validate(job)
    meta, job_spec = job["metadata"], job["spec"]
    assert meta["name"] == job_name("run.e0.t3.1", 2) and meta["namespace"] == "agents"
    assert meta["labels"]["team"] == "rl" and meta["labels"]["task"] == "t3"
    assert meta["labels"]["darl.dev/attempt"] == "2"
    assert meta["annotations"]["darl.dev/rollout-id"] == "run.e0.t3.1"
    assert job_spec["backoffLimit"] == 0 and job_spec["activeDeadlineSeconds"] == 90
    assert job_spec["ttlSecondsAfterFinished"] > 0
    pod = job_spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    box = pod["containers"][0]["securityContext"]
    assert box["privileged"] is False and box["allowPrivilegeEscalation"] is False
    assert box["runAsNonRoot"] is True
    assert box["capabilities"] == {"drop": ["ALL"]}
    assert job_spec["template"]["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "darl"
    assert pod["containers"][0]["command"] == ["sh", "-c", "echo task t3"]


def test_the_token_reaches_the_agent_only_through_the_secret():
    job = manifest(spec(KubernetesAgentSpec(job_template=str(TEMPLATE))))
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AGL_KEY"):
        assert "value" not in env[name]
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == job["metadata"]["name"]
    assert env["KEEP_ME"]["value"] == "1"
    assert env["DARL_ROLLOUT_ID"]["value"] == "run.e0.t3.1"
    assert env["OPENAI_BASE_URL"]["value"].startswith("http://darl-gateway.darl.svc:8100/")
    assert not {"DARL_TOKEN_SECRET", "DARL_ADMIN_KEY"} & set(env)


def test_an_agent_lightning_template_renders_unchanged():
    question = 'Say "hi": {then} \\ go\nnext line # not a comment'
    task = {"question": question, "level": 3}
    job = manifest(spec(KubernetesAgentSpec(job_template=str(AGL_TEMPLATE)), task=task))
    validate(job)
    assert job["metadata"]["name"] == job_name("run.e0.t3.1", 1)
    assert job["metadata"]["labels"]["app"] == "agl-agent"
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["QUESTION"]["value"] == question and env["LEVEL"]["value"] == "3"
    assert "valueFrom" in env["AGL_KEY"]


def test_a_template_may_render_a_task_that_is_not_an_object(tmp_path: Path):
    template = tmp_path / "job.yaml"
    template.write_text(
        AGL_TEMPLATE.read_text()
        .replace("input.question", "input")
        .replace("input.level", "task | tojson")
    )
    job = manifest(spec(KubernetesAgentSpec(job_template=str(template)), task="just a string"))
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["QUESTION"]["value"] == "just a string"
    assert env["LEVEL"]["value"] == '"just a string"'


def test_a_template_of_more_than_one_document_is_a_spec_error(tmp_path: Path):
    two = tmp_path / "two.yaml"
    two.write_text(AGL_TEMPLATE.read_text() + "\n---\n" + AGL_TEMPLATE.read_text())
    with pytest.raises(ApplicationError, match="one Job manifest") as raised:
        manifest(
            spec(KubernetesAgentSpec(job_template=str(two)), task={"question": "q", "level": 1})
        )
    assert raised.value.type == "AgentSpecError"


def test_an_image_alone_makes_a_one_container_job():
    agent = KubernetesAgentSpec(image="registry.example/agent:1", command=["python", "-m", "a"])
    job = manifest(spec(agent))
    validate(job)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example/agent:1"


def test_a_template_that_does_not_render_is_a_spec_error(tmp_path: Path):
    broken = tmp_path / "job.yaml"
    broken.write_text(TEMPLATE.read_text().replace("task.id", "task.missing"))
    with pytest.raises(ApplicationError) as raised:
        manifest(spec(KubernetesAgentSpec(job_template=str(broken))))
    assert raised.value.type == "AgentSpecError" and raised.value.non_retryable
    with pytest.raises(ApplicationError, match=r"does not exist|No such file"):
        manifest(spec(KubernetesAgentSpec(job_template=str(tmp_path / "none.yaml"))))


async def test_the_rate_limit_holds_the_next_creation():
    limiter = JobRateLimiter(per_minute=2)
    await limiter.acquire()
    await limiter.acquire()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(limiter.acquire(), timeout=0.5)


# The kubelet's eviction messages (pkg/kubelet/eviction/helpers.go), as a Pod's status has them.
OWN_STORAGE = [
    'Usage of EmptyDir volume "darl-tmp" exceeds the limit "1Gi". ',
    'Container darl-tests exceeded its local ephemeral storage limit "1024Mi". ',
    "Pod ephemeral local storage usage exceeds the total limit of containers 1Gi. ",
]
NODE_PRESSURE = (
    "The node was low on resource: ephemeral-storage. Threshold quantity: 10Gi, available: 9Gi. "
    "Container darl-tests was using 3Gi, which exceeds its request of 0. "
)


class _Pod:
    def __init__(self, reason: str, message: str) -> None:
        self.raw = {"status": {"phase": "Failed", "reason": reason, "message": message}}


@pytest.mark.parametrize("message", OWN_STORAGE)
def test_a_grading_pod_evicted_for_its_own_storage_is_its_tests_doing(message: str) -> None:
    assert own_storage_eviction(_Pod("Evicted", message)) == message.strip()


@pytest.mark.parametrize(
    ("reason", "message"),
    [("Evicted", NODE_PRESSURE), ("Evicted", ""), ("DeadlineExceeded", OWN_STORAGE[0])],
)
def test_an_eviction_for_the_nodes_sake_is_not(reason: str, message: str) -> None:
    assert own_storage_eviction(_Pod(reason, message)) is None
