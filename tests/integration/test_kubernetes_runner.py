"""The Kubernetes Job runner with the real kr8s client over real HTTP, against the Kubernetes
API emulator of tests/k8s_emulator.py (an emulator, not Kubernetes: no kube-apiserver can run
here). The emulator's Pods run their command as local processes, or act out a failure chosen
by their image."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from darl.activities.agent_contract import ContractIssuer
from darl.activities.runners.kubernetes import KubernetesJobRunner
from darl.activities.runners.kubernetes_manifest import job_name
from darl.activities.runners.kubernetes_settings import KubernetesSettings
from darl.workflows.contracts import (
    AgentExit,
    AgentHandle,
    AwaitRequest,
    KubernetesAgentSpec,
    LaunchRequest,
    RewardSpec,
    RolloutSpec,
    RolloutTimeouts,
)
from darl.workflows.rollout_status import RolloutStatus
from tests.integration.replay_checks import (
    REPLAY_AGENT,
    Scenario,
    check_resumed,
    local_spec,
    replay_settings,
    run_killed,
)
from tests.integration.stack import Stack
from tests.k8s_emulator import KubernetesEmulator
from tests.k8s_schema import validate

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
NAMESPACE = "darl-agents"
ISSUER = ContractIssuer("http://127.0.0.1:9", b"secret")
TIMEOUT = 60


def runner_for(emu: KubernetesEmulator, **settings: object) -> KubernetesJobRunner:
    return KubernetesJobRunner(KubernetesSettings(namespace=NAMESPACE, api_url=emu.url, **settings))


def rollout(image: str, command: list[str] | None = None, seconds: float = 60) -> RolloutSpec:
    return RolloutSpec(
        run_id="k8s",
        rollout_id=f"k8s.{image.rsplit('/', 1)[-1]}.{uuid.uuid4().hex[:8]}",
        task={"id": "t1"},
        agent=KubernetesAgentSpec(image=image, command=command),
        timeouts=RolloutTimeouts(agent_seconds=seconds, heartbeat_seconds=3),
    )


async def launch(runner: KubernetesJobRunner, spec: RolloutSpec, attempt: int = 1) -> AgentHandle:
    contract = ISSUER.issue(spec, attempt, None, {})
    return await runner.launch(LaunchRequest(spec=spec, attempt=attempt), contract)


async def wait(runner: KubernetesJobRunner, spec: RolloutSpec, handle: AgentHandle) -> AgentExit:
    contract = ISSUER.issue(spec, handle.attempt, None, {})
    request = AwaitRequest(spec=spec, attempt=handle.attempt, handle=handle)
    beats: list[object] = []
    return await asyncio.wait_for(runner.wait(request, contract, beats.append), TIMEOUT)


async def test_an_agent_job_runs_to_its_exit_with_the_contract(emulator: KubernetesEmulator):
    runner = runner_for(emulator)
    spec = rollout(
        "emulator/run",
        ["sh", "-c", 'echo "rollout=$DARL_ROLLOUT_ID key=$OPENAI_API_KEY"; exit 0'],
    )
    handle = await launch(runner, spec)
    job = next(j for j in emulator.objects("jobs", NAMESPACE))
    validate(job)
    agent_exit = await wait(runner, spec, handle)
    assert agent_exit.exit_code == 0 and not agent_exit.timed_out
    token = ISSUER.issue(spec, 1, None, {}).token.split(".")[0]
    assert f"rollout={spec.rollout_id}" in agent_exit.log_tail
    assert f"key={token}" in agent_exit.log_tail  # the token came from the Secret
    (secret,) = [s for s in emulator.objects("secrets", NAMESPACE)]
    assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]


async def test_a_large_task_reaches_the_job_as_a_file_from_its_secret(
    emulator: KubernetesEmulator,
):
    """A SWE-bench-sized task (over what Linux takes in one environment string) is in
    DARL_TASK_FILE, projected from the attempt's Secret (no DARL_TASK); one over a Secret's
    room is refused at launch, naming the task's size, before any Job is made."""
    runner = runner_for(emulator)
    tests = [f"tests/test_x.py::test_{i}" for i in range(8000)]
    reads = (
        "import json, os; t = json.load(open(os.environ['DARL_TASK_FILE']));"
        " print('DARL_TASK' in os.environ, len(t['tests']), sorted(os.listdir('/run/darl')))"
    )
    spec = rollout("emulator/run", [sys.executable, "-c", reads]).model_copy(
        update={"task": {"id": "t1", "tests": tests}}
    )
    agent_exit = await wait(runner, spec, await launch(runner, spec))
    assert agent_exit.exit_code == 0, agent_exit.log_tail
    assert "False 8000 ['task.json']" in agent_exit.log_tail  # the token is not in the file
    huge = spec.model_copy(
        update={"rollout_id": f"huge-{uuid.uuid4().hex[:8]}", "task": {"blob": "x" * 800_000}}
    )
    with pytest.raises(ApplicationError, match="travels in its attempt's Secret"):
        await launch(runner, huge)
    assert [j for j in emulator.objects("jobs", NAMESPACE) if "huge" in j["metadata"]["name"]] == []


async def test_a_failing_agent_is_a_result_with_its_exit_code(emulator: KubernetesEmulator):
    runner = runner_for(emulator)
    spec = rollout("emulator/run", ["sh", "-c", "echo broken >&2; exit 3"])
    agent_exit = await wait(runner, spec, await launch(runner, spec))
    assert agent_exit.exit_code == 3 and "broken" in agent_exit.log_tail


async def test_a_new_worker_reattaches_to_the_job_and_never_makes_a_second(
    emulator: KubernetesEmulator,
):
    spec = rollout("emulator/run", ["sh", "-c", "sleep 1; echo done"])
    first = await launch(runner_for(emulator), spec)
    # The worker crashed; its replacement retries the launch and awaits the same Job.
    replacement = runner_for(emulator)
    again = await launch(replacement, spec)
    assert again.data["job"] == first.data["job"] and again.data["uid"] == first.data["uid"]
    emulator.break_watches()  # a broken watch is re-listed, not lost
    agent_exit = await wait(replacement, spec, first)
    assert agent_exit.exit_code == 0 and "done" in agent_exit.log_tail
    assert emulator.jobs_created(job_name(spec.rollout_id, 1), NAMESPACE) == 1


@pytest.mark.parametrize(
    ("image", "why"),
    [
        ("emulator/image-pull-error", "cannot be pulled"),
        ("emulator/unschedulable", "cannot be scheduled"),
        ("emulator/evicted", "evicted"),
    ],
)
async def test_infra_failures_end_the_attempt_for_a_retry(
    emulator: KubernetesEmulator, image: str, why: str
):
    runner = runner_for(emulator, unschedulable_seconds=0)
    spec = rollout(image, ["sleep", "30"])
    handle = await launch(runner, spec)
    with pytest.raises(ApplicationError) as raised:
        await wait(runner, spec, handle)
    assert raised.value.type == "AgentLostError" and why in str(raised.value)
    # The failed Job is deleted, so the next attempt starts clean.
    async with asyncio.timeout(TIMEOUT):
        while emulator.objects("jobs", NAMESPACE):
            await asyncio.sleep(0.1)


async def test_an_oom_killed_agent_is_reported_as_such(emulator: KubernetesEmulator):
    runner = runner_for(emulator)
    spec = rollout("emulator/oom", ["sleep", "30"])
    agent_exit = await wait(runner, spec, await launch(runner, spec))
    assert agent_exit.oom_killed and agent_exit.exit_code == 137


async def test_the_deadline_ends_the_job_as_a_timeout(emulator: KubernetesEmulator):
    runner = runner_for(emulator)
    spec = rollout("emulator/sleep", seconds=1)
    agent_exit = await wait(runner, spec, await launch(runner, spec))
    assert agent_exit.timed_out and agent_exit.exit_code is None


async def test_cancelling_deletes_the_job_with_its_pod_and_secret(emulator: KubernetesEmulator):
    runner = runner_for(emulator)
    marker = "darl-k8s-cancel-test"
    spec = rollout(
        "emulator/run", [sys.executable, "-c", f"import time; time.sleep(60)  # {marker}"]
    )
    handle = await launch(runner, spec)
    async with asyncio.timeout(TIMEOUT):
        while not _processes_with(marker):
            await asyncio.sleep(0.1)
    await runner.kill(handle)
    async with asyncio.timeout(TIMEOUT):
        while (
            emulator.objects("jobs", NAMESPACE)
            or emulator.objects("pods", NAMESPACE)
            or emulator.objects("secrets", NAMESPACE)
            or _processes_with(marker)
        ):
            await asyncio.sleep(0.1)
    await runner.kill(handle)  # idempotent


async def test_a_stopped_attempt_refuses_a_late_launch(emulator: KubernetesEmulator):
    runner = runner_for(emulator)
    spec = rollout("emulator/sleep")
    await runner.stop(LaunchRequest(spec=spec, attempt=1))
    with pytest.raises(ApplicationError) as raised:
        await launch(runner, spec)
    assert raised.value.type == "AgentStopped"
    assert not emulator.objects("jobs", NAMESPACE)


async def test_the_rate_limit_holds_job_creation(emulator: KubernetesEmulator):
    runner = runner_for(emulator, jobs_per_minute=2)
    specs = [rollout("emulator/sleep") for _ in range(3)]
    await launch(runner, specs[0])
    await launch(runner, specs[1])
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(launch(runner, specs[2]), timeout=1.5)
    assert len(emulator.objects("jobs", NAMESPACE)) == 2


# --- root Jobs: only in the operator's sandbox namespace, under its RuntimeClass -----------

SANDBOX = {"sandbox_namespace": "darl-sandboxed-agents", "sandbox_runtime_class": "gvisor"}


def root_rollout(tmp_path: Path, command: list[str], where: str = "pod") -> RolloutSpec:
    """A rollout whose Job template asks for root as a SWE-smith task image needs it: on
    the Pod (`where` "pod") or on its one container ("container")."""
    root = {"runAsUser": 0}
    container: dict = {"name": "agent", "image": "emulator/run", "command": command}
    pod: dict = {"containers": [container]}
    if where == "pod":
        pod["securityContext"] = root
    else:
        container["securityContext"] = root
    template = tmp_path / f"root-{where}.yaml"
    job = {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": pod}}}
    template.write_text(yaml.safe_dump(job))
    return RolloutSpec(
        run_id="k8s",
        rollout_id=f"k8s.root.{uuid.uuid4().hex[:8]}",
        task={"id": "t1", "image_name": "emulator/run"},
        agent=KubernetesAgentSpec(job_template=str(template)),
        timeouts=RolloutTimeouts(agent_seconds=60, heartbeat_seconds=3),
    )


@pytest.mark.parametrize("where", ["pod", "container"])
async def test_a_root_job_runs_in_the_sandbox_namespace_under_the_runtime_class(
    emulator: KubernetesEmulator, tmp_path: Path, where: str
):
    runner = runner_for(emulator, **SANDBOX)
    command = ["sh", "-c", 'echo "key=$OPENAI_API_KEY"']
    spec = root_rollout(tmp_path, command, where)
    handle = await launch(runner, spec)
    assert handle.data["namespace"] == "darl-sandboxed-agents"
    assert not emulator.objects("jobs", NAMESPACE) and not emulator.objects("secrets", NAMESPACE)
    (job,) = emulator.objects("jobs", "darl-sandboxed-agents")
    validate(job)
    pod = job["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "gvisor"
    assert pod["automountServiceAccountToken"] is False and job["spec"]["backoffLimit"] == 0
    assert job["spec"]["activeDeadlineSeconds"] == 60
    context = pod.get("securityContext", {}) | pod["containers"][0]["securityContext"]
    assert context["runAsUser"] == 0 and not context.get("runAsNonRoot")
    assert context["allowPrivilegeEscalation"] is False and context["privileged"] is False
    assert context["capabilities"] == {
        "drop": ["ALL"],
        "add": ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "SETGID", "SETUID"],
    }
    # The token's Secret is beside the Job, where the Pod can read it.
    agent_exit = await wait(runner, spec, handle)
    assert agent_exit.exit_code == 0, agent_exit.log_tail
    token = ISSUER.issue(spec, 1, None, {}).token.split(".")[0]
    assert f"key={token}" in agent_exit.log_tail
    (secret,) = emulator.objects("secrets", "darl-sandboxed-agents")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]


async def test_the_same_runner_keeps_every_other_job_non_root_in_the_agents_namespace(
    emulator: KubernetesEmulator,
):
    runner = runner_for(emulator, **SANDBOX)
    spec = rollout("emulator/run", ["sh", "-c", "exit 0"])
    handle = await launch(runner, spec)
    assert handle.data["namespace"] == NAMESPACE
    assert not emulator.objects("jobs", "darl-sandboxed-agents")
    (job,) = emulator.objects("jobs", NAMESPACE)
    pod = job["spec"]["template"]["spec"]
    assert "runtimeClassName" not in pod
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert (await wait(runner, spec, handle)).exit_code == 0


async def test_a_root_job_is_killed_and_stopped_in_the_sandbox_namespace(
    emulator: KubernetesEmulator, tmp_path: Path
):
    runner = runner_for(emulator, **SANDBOX)
    killed = root_rollout(tmp_path, ["sleep", "60"])
    await runner.kill(await launch(runner, killed))
    stopped = root_rollout(tmp_path, ["sleep", "60"])
    await launch(runner, stopped)
    await runner.stop(LaunchRequest(spec=stopped, attempt=1))
    async with asyncio.timeout(TIMEOUT):
        while emulator.objects("jobs", "darl-sandboxed-agents") or emulator.objects(
            "pods", "darl-sandboxed-agents"
        ):
            await asyncio.sleep(0.1)
    with pytest.raises(ApplicationError) as raised:
        await launch(runner, stopped)
    assert raised.value.type == "AgentStopped"


async def test_a_root_job_is_refused_unless_the_operator_gave_a_sandbox(
    emulator: KubernetesEmulator, tmp_path: Path
):
    runner = runner_for(emulator)
    spec = root_rollout(tmp_path, ["sh", "-c", "exit 0"])
    with pytest.raises(ApplicationError) as raised:
        await launch(runner, spec)
    assert raised.value.type == "AgentSpecError" and raised.value.non_retryable
    message = str(raised.value)
    assert "asks for root (runAsUser: 0)" in message and "\n" not in message
    assert "--k8s-sandbox-namespace" in message and "--k8s-sandbox-runtime-class" in message
    assert not emulator.objects("jobs") and not emulator.objects("secrets")


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"sandbox_namespace": "darl-sandboxed-agents"}, "together"),
        ({"sandbox_runtime_class": "gvisor"}, "together"),
        ({"sandbox_namespace": NAMESPACE, "sandbox_runtime_class": "gvisor"}, "restricted"),
    ],
)
def test_the_sandbox_settings_are_whole_and_apart_from_the_agents_namespace(
    settings: dict, why: str
):
    with pytest.raises(ValueError, match=why):
        KubernetesSettings(namespace=NAMESPACE, **settings)


def _processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if marker in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


async def start_on_the_emulator(
    stack: Stack, emulator: KubernetesEmulator, *flags: str
) -> tuple[str, ...]:
    """The policy server, the gateway and a rollout worker whose agents are Jobs on the
    emulator (with more of its flags); returns the worker's Kubernetes flags (for a worker
    started again)."""
    await asyncio.to_thread(stack.start_policy_server)
    await asyncio.to_thread(stack.start_gateway)
    k8s = ("--k8s-namespace", NAMESPACE, "--k8s-api-url", emulator.url, *flags)
    await asyncio.to_thread(stack.start_worker, "worker", *k8s)
    return k8s


@pytest.mark.parametrize("kill_worker", [False, True])
async def test_a_rollout_runs_its_agent_as_a_job_end_to_end(
    emulator: KubernetesEmulator, dev_env: WorkflowEnvironment, tmp_path: Path, kill_worker: bool
):
    """RolloutWorkflow on the dev server, a worker with the Kubernetes runner, the emulator's
    Pod running the example OpenAI-SDK agent, the real gateway and policy server: everything
    but the cluster is real. With `kill_worker`, the worker is SIGKILLed while the Job runs and
    its replacement re-attaches to the same Job (one Job, one attempt)."""
    agent = [sys.executable, "-m", "darl.examples.arithmetic.agent"]
    if kill_worker:
        agent = ["sh", "-c", "sleep 4; exec " + " ".join(agent)]
    template = tmp_path / "arithmetic-job.yaml"
    template.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"labels": {"task": "{{ task.id }}"}},
                "spec": {
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "agent",
                                    "image": "emulator/run",
                                    "command": agent,
                                    "workingDir": str(ROOT),
                                }
                            ]
                        }
                    }
                },
            }
        )
    )
    stack = Stack(tmp_path / "stack", dev_env.client)
    try:
        k8s = await start_on_the_emulator(stack, emulator)
        spec = RolloutSpec(
            run_id="k8s-e2e",
            rollout_id=f"k8s-e2e-{uuid.uuid4().hex[:8]}",
            task={"id": "t07", "question": "What is 3 + 4?", "answer": "7"},
            agent=KubernetesAgentSpec(job_template=str(template)),
            reward=RewardSpec(function="numeric_match"),
            timeouts=RolloutTimeouts(agent_seconds=120, heartbeat_seconds=10),
        )
        handle = await stack.start_rollout(spec)
        if kill_worker:
            async with asyncio.timeout(TIMEOUT):
                while not any(
                    p.get("status", {}).get("phase") == "Running"
                    for p in emulator.objects("pods", NAMESPACE)
                ):
                    await asyncio.sleep(0.1)
            stack.processes.pop("worker").kill()
            await asyncio.to_thread(stack.start_worker, "worker-2", *k8s)
        result = await asyncio.wait_for(handle.result(), 180)
    finally:
        await asyncio.to_thread(stack.stop)
    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert result.attempts == 1
    assert result.calls == 1 and result.reward in (0.0, 1.0)
    job = job_name(spec.rollout_id, 1)
    assert emulator.jobs_created(job, NAMESPACE) == 1
    records = stack.store().read_sync(spec.rollout_id)
    assert [r.call_id for r in records] == result.call_ids


async def test_a_worker_started_with_a_sandbox_runs_a_root_agent_there(
    emulator: KubernetesEmulator, dev_env: WorkflowEnvironment, tmp_path: Path
):
    """The operator's setting as a worker gets it (`darl worker --k8s-sandbox-namespace
    --k8s-sandbox-runtime-class`): a RolloutWorkflow whose Job template asks for root runs
    the example OpenAI-SDK agent in the sandbox namespace, under the runtime class, to a
    reward through the real gateway."""
    agent = [sys.executable, "-m", "darl.examples.arithmetic.agent"]
    spec = root_rollout(tmp_path, agent)
    template = yaml.safe_load(Path(spec.agent.job_template or "").read_text())
    template["spec"]["template"]["spec"]["containers"][0]["workingDir"] = str(ROOT)
    Path(spec.agent.job_template or "").write_text(yaml.safe_dump(template))
    spec = spec.model_copy(
        update={
            "task": {"id": "t07", "question": "What is 3 + 4?", "answer": "7"},
            "reward": RewardSpec(function="numeric_match"),
        }
    )
    stack = Stack(tmp_path / "stack", dev_env.client)
    sandbox = ("--k8s-sandbox-namespace", "darl-sandboxed-agents")
    sandbox += ("--k8s-sandbox-runtime-class", "gvisor")
    try:
        await start_on_the_emulator(stack, emulator, *sandbox)
        result = await asyncio.wait_for((await stack.start_rollout(spec)).result(), 180)
    finally:
        await asyncio.to_thread(stack.stop)
    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert result.calls == 1 and result.reward in (0.0, 1.0)
    job = job_name(spec.rollout_id, 1)
    assert emulator.jobs_created(job, "darl-sandboxed-agents") == 1
    assert emulator.jobs_created(job, NAMESPACE) == 0
    (pod,) = emulator.objects("pods", "darl-sandboxed-agents")
    assert pod["spec"]["runtimeClassName"] == "gvisor"


async def test_an_agent_whose_pod_is_deleted_resumes_by_replay(
    emulator: KubernetesEmulator, dev_env: WorkflowEnvironment, tmp_path: Path
):
    """Rule 10 on Kubernetes: the replay test agent's Pod is deleted (`kubectl delete pod`,
    on the emulator) after 3 of its 6 calls; the Job fails under it, which is no fault of the
    agent's, and the next attempt's Job replays the 3 recorded calls."""
    stack = Stack(tmp_path / "stack", dev_env.client)
    scenario = Scenario("k8s", kill_after=3, turns=6)
    try:
        await start_on_the_emulator(stack, emulator)
        agent = KubernetesAgentSpec(
            image="emulator/run",
            command=[sys.executable, REPLAY_AGENT],
            env=replay_settings(stack, scenario),
        )
        spec = local_spec(stack, scenario, agent)

        async def delete_the_pod() -> None:
            job = job_name(spec.rollout_id, 1)
            pods = [
                p["metadata"]["name"]
                for p in emulator.objects("pods", NAMESPACE)
                if p["metadata"].get("labels", {}).get("job-name") == job
            ]
            async with httpx.AsyncClient(base_url=emulator.url) as api:
                path = f"/api/v1/namespaces/{NAMESPACE}/pods/{pods[0]}"
                (await api.delete(path)).raise_for_status()

        result = await run_killed(stack, spec, delete_the_pod)
    finally:
        await asyncio.to_thread(stack.stop)
    check_resumed(stack, result, scenario.kill_after)
    assert emulator.jobs_created(job_name(spec.rollout_id, 1), NAMESPACE) == 1
    assert emulator.jobs_created(job_name(spec.rollout_id, 2), NAMESPACE) == 1
