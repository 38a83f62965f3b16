"""Grading a Kubernetes agent, with the real kr8s client against the Kubernetes API emulator of
tests/k8s_emulator.py (an emulator, not Kubernetes: no kube-apiserver or kubelet runs here;
the emulated kubelet runs containers as local processes, their volumes bind-mounted with
bubblewrap, and has no images: the "task image" is the host with the repository at the
agent's workdir). The agent's Job works on the attempt's volume; a second Job grades it there
with DARL's trusted steps first and the tests after, and the runner judges what the API gives
back as the local grader does: a fix 1, a wrong fix 0, forged outcomes 0 with the reason, a
workspace over its limits 0, the hidden tests never in the agent's reach.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from kr8s.asyncio.objects import Job
from temporalio.exceptions import ApplicationError

from darl.activities.agent_contract import ContractIssuer
from darl.activities.runners import kubernetes_grading_manifest
from darl.activities.runners.kubernetes import KubernetesJobRunner
from darl.activities.runners.kubernetes_grading import KubernetesGrading
from darl.activities.runners.kubernetes_grading_manifest import grading_job_name
from darl.activities.runners.kubernetes_manifest import attempt_claim
from darl.activities.runners.kubernetes_settings import KubernetesSettings
from darl.activities.sandbox.errors import GradingError
from darl.workflows.contracts import (
    AwaitRequest,
    GradeReport,
    GraderSpec,
    KubernetesAgentSpec,
    LaunchRequest,
    RewardSpec,
    RolloutSpec,
    RolloutTimeouts,
    SandboxLimits,
)
from tests.integration.test_grader import CALC, FIXED, Repo, repo, task
from tests.k8s_emulator import KubernetesEmulator
from tests.k8s_schema import validate

__all__ = ["repo"]  # the fixture, used by name

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="the emulator mounts with bwrap"),
]

NAMESPACE = "darl-agents"
ISSUER = ContractIssuer("http://127.0.0.1:9", b"secret")
TIMEOUT = 120


@pytest.fixture
def image(repo: Repo, tmp_path: Path) -> Path:
    """What the task's image holds at its workdir: the repository at the task's commit."""
    workdir = tmp_path / "image" / "testbed"
    workdir.parent.mkdir()
    subprocess.run(
        ["git", "clone", "-q", str(repo.repos_dir / "org__calc"), str(workdir)], check=True
    )
    subprocess.run(["git", "-C", str(workdir), "checkout", "-q", repo.commit], check=True)
    return workdir


def runner_for(emu: KubernetesEmulator, tmp_path: Path) -> KubernetesJobRunner:
    mounts = tmp_path / "mnt"
    mounts.mkdir(exist_ok=True)
    return KubernetesJobRunner(
        KubernetesSettings(
            namespace=NAMESPACE,
            api_url=emu.url,
            grading_image="registry.example.com/darl:test",
            grading_python=sys.executable,
            grading_mount_root=str(mounts),
        )
    )


def graded_rollout(
    repo: Repo, workdir: Path, script: str, limits: SandboxLimits | None = None
) -> RolloutSpec:
    return RolloutSpec(
        run_id="k8s-graded",
        rollout_id=f"k8s-graded.{uuid.uuid4().hex[:8]}",
        task=task(repo),
        agent=KubernetesAgentSpec(
            image="emulator/run",
            command=["/bin/sh", "-c", script],
            workdir=str(workdir),
            test_python=sys.executable,
            limits=limits or SandboxLimits(),
        ),
        reward=RewardSpec(grader=GraderSpec()),
        timeouts=RolloutTimeouts(agent_seconds=60, heartbeat_seconds=3, reward_seconds=60),
        revision=3,
    )


async def run_and_grade(
    runner: KubernetesJobRunner, spec: RolloutSpec
) -> tuple[int | None, GradeReport]:
    contract = ISSUER.issue(spec, 1, None, {})
    handle = await runner.launch(LaunchRequest(spec=spec, attempt=1), contract)
    request = AwaitRequest(spec=spec, attempt=1, handle=handle, one_activity=True)
    beats: list[object] = []
    agent_exit = await asyncio.wait_for(runner.wait(request, contract, beats.append), TIMEOUT)
    report = await asyncio.wait_for(runner.grade(request, beats.append), TIMEOUT)
    return agent_exit.exit_code, report


def writes(path: str, text: str) -> str:
    return f"cat > {path} <<'DARL_FILE'\n{text}DARL_FILE\n"


async def test_the_fix_grades_1_on_the_attempts_volume(
    emulator: KubernetesEmulator, repo: Repo, image: Path, tmp_path: Path
) -> None:
    """The agent fixes the code in its workdir (the attempt's volume): graded 1 by a second
    Job; the image's repository itself is untouched; the Jobs and the volume are the
    schema's; what the agent could see holds neither the base nor the hidden tests."""
    runner = runner_for(emulator, tmp_path)
    peek = (
        f'echo "volume: [$(ls {tmp_path}/mnt/attempt 2>/dev/null)]"; '
        'echo "workdir: [$(ls)]"; cat tests/test_hidden.py 2>&1;'
    )
    spec = graded_rollout(repo, image, peek + writes("calc.py", FIXED))
    exit_code, report = await run_and_grade(runner, spec)
    assert exit_code == 0
    assert (report.reward, report.passed, report.tests) == (1.0, 4, 4), report.reason
    assert report.reason == "4 of 4 listed tests passed"
    assert "+    return a + b" in report.diff
    assert (image / "calc.py").read_text() == CALC
    (agent_job,) = [
        j for j in emulator.objects("jobs", NAMESPACE) if j["metadata"]["name"].endswith("-a1")
    ]
    name = agent_job["metadata"]["name"]
    grading = next(
        j
        for j in emulator.objects("jobs", NAMESPACE)
        if j["metadata"]["name"] == grading_job_name(name)
    )
    (claim,) = emulator.objects("persistentvolumeclaims", NAMESPACE)
    for obj in (agent_job, grading, claim):
        validate(obj)
    assert claim["metadata"]["name"] == attempt_claim(name)
    assert claim["metadata"]["ownerReferences"][0]["uid"] == agent_job["metadata"]["uid"]
    assert grading["metadata"]["ownerReferences"][0]["uid"] == agent_job["metadata"]["uid"]
    assert grading["spec"]["template"]["metadata"]["labels"]["darl.dev/role"] == "grading"
    # The agent's container: its workspace at its workdir, nothing else of the volume.
    agent_log = (await _pod_log(emulator, name)).decode()
    assert "volume: []" in agent_log  # no base/, no other attempt's files
    assert "workdir: [calc.py\npyproject.toml\ntests]" in agent_log
    assert "test_hidden.py: No such file" in agent_log


async def _pod_log(emu: KubernetesEmulator, job: str) -> bytes:
    (pod,) = [
        p for p in emu.objects("pods", NAMESPACE) if p["metadata"]["labels"].get("job-name") == job
    ]
    return emu.kubelet.log_path(pod).read_bytes()


async def test_a_wrong_fix_and_a_forgery_grade_0(
    emulator: KubernetesEmulator, repo: Repo, image: Path, tmp_path: Path
) -> None:
    runner = runner_for(emulator, tmp_path)
    wrong = graded_rollout(repo, image, writes("calc.py", CALC.replace("a - b", "a * b")))
    forged = CALC + (
        "\nimport sys\n"
        "_recorder = getattr(sys.modules.get('__main__'), 'Recorder', None)\n"
        "if _recorder is not None:\n"
        "    _record = _recorder.record\n"
        "    def _forged(self, record, _record=_record):\n"
        "        if record.get('outcome') == 'failed':\n"
        "            record = dict(record, outcome='passed')\n"
        "        _record(self, record)\n"
        "    _recorder.record = _forged\n"
    )
    hack = graded_rollout(repo, image, writes("calc.py", forged))
    (_, wrong_report), (_, hack_report) = await asyncio.gather(
        run_and_grade(runner, wrong), run_and_grade(runner, hack)
    )
    assert wrong_report.reward == 0.0 and wrong_report.reason == "1 of 4 listed tests passed"
    assert hack_report.reward == 0.0 and hack_report.reason is not None
    assert hack_report.reason.startswith("tampering: the canary test that must fail")


async def test_a_workspace_over_its_limits_grades_0(
    emulator: KubernetesEmulator, repo: Repo, image: Path, tmp_path: Path
) -> None:
    runner = runner_for(emulator, tmp_path)
    spec = graded_rollout(
        repo,
        image,
        "for n in $(seq 1 300); do echo x > f$n; done",
        limits=SandboxLimits(workspace_files=150),
    )
    _, report = await run_and_grade(runner, spec)
    assert report.reward == 0.0
    assert report.reason is not None and report.reason.startswith(
        "not graded: the workspace holds more than 150 entries"
    )


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({}, "needs DARL's image for the grading Job: start the worker with --k8s-grading-image"),
        # 2048 MiB three times over is 6 GiB: the agent could fill a 5Gi volume within its
        # limits and fail its own grading as DARL's.
        (
            {"grading_image": "darl:test", "grading_volume_size": "5Gi"},
            r"volume \(5Gi, --k8s-grading-volume-size\) must hold limits.workspace_mb "
            r"\(2048 MiB\) three times over",
        ),
    ],
    ids=["no DARL image", "a volume too small"],
)
async def test_an_attempt_that_could_not_be_graded_is_refused_before_any_job(
    emulator: KubernetesEmulator,
    repo: Repo,
    image: Path,
    settings: dict[str, str],
    refusal: str,
) -> None:
    runner = KubernetesJobRunner(
        KubernetesSettings(namespace=NAMESPACE, api_url=emulator.url, **settings)
    )
    spec = graded_rollout(repo, image, "true")
    with pytest.raises(ApplicationError, match=refusal) as refused:
        await runner.launch(LaunchRequest(spec=spec, attempt=1), ISSUER.issue(spec, 1, None, {}))
    assert refused.value.non_retryable
    assert emulator.objects("jobs", NAMESPACE) == []


def test_a_volume_size_kubernetes_would_not_take_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="'20GB' is not a size Kubernetes takes"):
        KubernetesSettings(grading_volume_size="20GB")


async def test_an_agent_that_ran_out_of_time_is_graded_on_what_it_left(
    emulator: KubernetesEmulator, repo: Repo, image: Path, tmp_path: Path
) -> None:
    """The runner ends a graded attempt at its deadline by its Pod, not its Job: the volume
    (the Job's) stays, and what the agent left is graded."""
    runner = runner_for(emulator, tmp_path)
    spec = graded_rollout(repo, image, writes("calc.py", FIXED) + "exec sleep 600\n")
    spec = spec.model_copy(
        update={"timeouts": spec.timeouts.model_copy(update={"agent_seconds": 3})}
    )
    contract = ISSUER.issue(spec, 1, None, {})
    handle = await runner.launch(LaunchRequest(spec=spec, attempt=1), contract)
    request = AwaitRequest(spec=spec, attempt=1, handle=handle, one_activity=True)
    agent_exit = await asyncio.wait_for(runner.wait(request, contract, lambda *_: None), TIMEOUT)
    assert agent_exit.timed_out
    assert [j["metadata"]["name"] for j in emulator.objects("jobs", NAMESPACE)] == [
        handle.data["job"]
    ]
    report = await asyncio.wait_for(runner.grade(request, lambda *_: None), TIMEOUT)
    assert report.reward == 1.0, report.reason


# What the code under test does in the tests container when the tests import it.
IN_THE_TESTS = {
    # A FIFO where the tests' log is: the container reads the log back by a descriptor it
    # opened before, so nothing waits on the FIFO.
    "a FIFO in place of the tests' log": (
        FIXED
        + "import os\n_log = os.path.join(os.environ['TMPDIR'], 'darl-tests.log')\n"
        + "os.unlink(_log)\nos.mkfifo(_log)\n",
        1.0,
        "4 of 4 listed tests passed",
    ),
    # The status the container keeps for "the tests could not start" (DARL's failure): the
    # tests exiting with it are their own outcome.
    "an exit with the not-ready status": (
        CALC + "import os\nos._exit(97)\n",
        0.0,
        "the test run ended before pytest finished its session (exit status 96)",
    ),
}


@pytest.mark.parametrize("trick", list(IN_THE_TESTS))
async def test_what_the_tests_do_in_their_container_decides_nothing_but_their_grade(
    emulator: KubernetesEmulator, repo: Repo, image: Path, tmp_path: Path, trick: str
) -> None:
    code, reward, reason = IN_THE_TESTS[trick]
    runner = runner_for(emulator, tmp_path)
    _, report = await run_and_grade(runner, graded_rollout(repo, image, writes("calc.py", code)))
    assert (report.reward, report.reason) == (reward, reason)


async def test_an_image_whose_python_cannot_run_pytest_is_darls_failure(
    emulator: KubernetesEmulator, repo: Repo, image: Path, tmp_path: Path
) -> None:
    """The tests container checks the image's Python (from `/`, nothing of the workspace on
    its path) before the tests: a Python without pytest is the grading's failure, retried,
    never the agent's 0."""
    runner = runner_for(emulator, tmp_path)
    spec = graded_rollout(repo, image, writes("calc.py", FIXED))
    # Not a Python at all (the tests container's /tmp is its own: no script of the test's
    # there): what it says comes back in the error.
    agent = spec.agent.model_copy(update={"test_python": "/bin/sh"})
    spec = spec.model_copy(update={"agent": agent})
    with pytest.raises(GradingError, match="could not start in the task's image") as failed:
        await run_and_grade(runner, spec)
    assert "pytest_results.py" in str(failed.value)


async def test_a_grading_job_left_without_its_secret_gets_it_on_the_retry(
    emulator: KubernetesEmulator, repo: Repo, image: Path, tmp_path: Path
) -> None:
    """A try that died between creating the grading Job and its Secret: the next try finds
    the Job and makes the Secret its Pod waits for."""
    runner = runner_for(emulator, tmp_path)
    spec = graded_rollout(repo, image, writes("calc.py", FIXED))
    contract = ISSUER.issue(spec, 1, None, {})
    handle = await runner.launch(LaunchRequest(spec=spec, attempt=1), contract)
    request = AwaitRequest(spec=spec, attempt=1, handle=handle, one_activity=True)
    await asyncio.wait_for(runner.wait(request, contract, lambda *_: None), TIMEOUT)
    api = await runner.api()
    agent_job = await runner.find(Job, handle.data["job"], api, NAMESPACE)
    grading = KubernetesGrading(runner)
    await runner.create_or_find_job(grading.grading_job(agent_job.raw, request), api)
    report = await asyncio.wait_for(runner.grade(request, lambda *_: None), TIMEOUT)
    assert report.reward == 1.0, report.reason


async def test_tests_that_outrun_the_grading_jobs_deadline_grade_0(
    emulator: KubernetesEmulator,
    repo: Repo,
    image: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An image without `timeout` leaves the tests to the grading Job's deadline: the Job's
    controller ends them, and the attempt is graded 0, timed out (not retried as DARL's
    failure). The deadline is shortened to seconds here."""
    monkeypatch.setattr(kubernetes_grading_manifest, "PREPARE_SECONDS", 8)
    monkeypatch.setattr(kubernetes_grading_manifest, "DEADLINE_GRACE_SECONDS", 1)
    tools = tmp_path / "bin"  # the task image's PATH: no `timeout`
    tools.mkdir()
    for tool in ("sh", "cat", "tail", "sleep"):
        (tools / tool).symlink_to(shutil.which(tool) or tool)
    runner = runner_for(emulator, tmp_path)
    hangs = CALC + "import time\ntime.sleep(600)\n"
    spec = graded_rollout(repo, image, writes("calc.py", hangs))
    agent = spec.agent.model_copy(update={"env": {"PATH": str(tools)}})
    timeouts = spec.timeouts.model_copy(update={"reward_seconds": 2})
    spec = spec.model_copy(update={"agent": agent, "timeouts": timeouts})
    _, report = await run_and_grade(runner, spec)
    assert (report.reward, report.timed_out) == (0.0, True)
    assert report.reason == "the tests did not finish within 2s"
