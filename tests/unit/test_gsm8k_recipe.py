"""The GSM8K GPU recipe (examples/gsm8k) without a GPU: its data preparation from GSM8K's parquet
schema, the reward against verl's own GSM8K score, the agent's prompt and calls against a fake
gateway, and its train.yaml as `darl train` loads it."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from openai import OpenAI
from typer.testing import CliRunner

from darl.activities.rewards import RewardFunctionError, resolve, score
from darl.deploy.config_file import load_config
from darl.examples.gsm8k import agent
from darl.examples.gsm8k.agent_service import GSM8KAgent, create_service_app
from darl.examples.gsm8k.prepare_data import GSM8KDataError, app, ground_truth, prepare
from darl.examples.gsm8k.reward import gsm8k_reward, verl_gsm8k
from darl.trainer.datasets import load_tasks
from darl.workflows.contracts import RewardSpec, TrajectorySummary

REPO = Path(__file__).parents[2]
CONFIG = REPO / "examples" / "gsm8k" / "train.yaml"

# Three rows in openai/gsm8k's `main` schema (the first two are GSM8K's first train rows).
GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
        "many clips in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
        "<<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes "
        "of babysitting. How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she "
        "earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    },
    {
        "question": "A farmer plants 4 fields with 400 corn plants each. How many corn plants "
        "does he plant?",
        "answer": "He plants 4 x 400 = <<4*400=1600>>1,600 corn plants.\n#### 1,600",
    },
]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_empty_gsm8k(path: Path) -> Path:
    schema = pa.schema([("question", pa.string()), ("answer", pa.string())])
    pq.write_table(schema.empty_table(), path)
    return path


@pytest.fixture
def gsm8k_files(tmp_path: Path) -> tuple[Path, Path]:
    train = write_parquet(tmp_path / "train-00000-of-00001.parquet", GSM8K_ROWS)
    test = write_parquet(tmp_path / "test-00000-of-00001.parquet", GSM8K_ROWS[:2])
    return train, test


# --- data preparation ------------------------------------------------------------------------


def test_prepared_tasks_carry_question_and_ground_truth_in_darls_format(
    gsm8k_files: tuple[Path, Path], tmp_path: Path
):
    train, test = gsm8k_files
    counts = prepare(train, test, tmp_path / "out")
    assert counts == {"train": 3, "test": 2}
    rows = load_tasks(tmp_path / "out" / "train.jsonl").rows
    assert [r["ground_truth"] for r in rows] == ["72", "10", "1600"]
    assert [r["question"] for r in rows] == [r["question"] for r in GSM8K_ROWS]
    assert [r["id"] for r in rows] == [
        "gsm8k-train-00000",
        "gsm8k-train-00001",
        "gsm8k-train-00002",
    ]
    test_rows = load_tasks(tmp_path / "out" / "test.jsonl").rows
    assert [(r["id"], r["ground_truth"]) for r in test_rows] == [
        ("gsm8k-test-00000", "72"),
        ("gsm8k-test-00001", "10"),
    ]


@pytest.mark.parametrize(
    ("answer", "truth"),
    [("so 5 + 7 = 12\n#### 12", "12"), ("#### -3", "-3"), ("#### 1,234,567", "1234567")],
)
def test_ground_truth_is_extracted_as_verl_does(answer: str, truth: str):
    assert ground_truth(answer) == truth


def test_the_cli_writes_both_splits(gsm8k_files: tuple[Path, Path], tmp_path: Path):
    train, test = gsm8k_files
    out = tmp_path / "tasks"
    args = ["--train", str(train), "--test", str(test), "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "3 tasks" in result.output and "2 tasks" in result.output
    assert (out / "train.jsonl").is_file() and (out / "test.jsonl").is_file()


def test_the_cli_says_what_is_wrong_and_exits_non_zero(tmp_path: Path):
    missing = tmp_path / "nowhere.parquet"
    result = CliRunner().invoke(app, ["--train", str(missing), "--test", str(missing)])
    assert result.exit_code == 1
    assert "does not exist" in result.output


@pytest.mark.parametrize(
    ("which", "make", "why"),
    [
        ("train", lambda p: p, "does not exist"),
        ("test", lambda p: p, "does not exist"),
        ("train", lambda p: (p.write_text("question,answer\n"), p)[1], "not a readable parquet"),
        (
            "train",
            lambda p: write_parquet(p, [{"question": "q", "solution": "#### 1"}]),
            "no column 'answer'",
        ),
        (
            "test",
            lambda p: write_parquet(p, [{"problem": "q", "solution": "#### 1"}]),
            "no column 'question', 'answer'",
        ),
        (
            "test",
            lambda p: write_parquet(p, [*GSM8K_ROWS, {"question": "q", "answer": "it is 4"}]),
            "test row 3: no '#### <number>'",
        ),
        ("train", lambda p: write_empty_gsm8k(p), "no rows"),
    ],
)
def test_a_bad_file_is_a_clear_error_and_nothing_is_written(
    gsm8k_files: tuple[Path, Path], tmp_path: Path, which: str, make, why: str
):
    train, test = gsm8k_files
    bad = make(tmp_path / f"bad-{which}.parquet")
    paths = {"train": train, "test": test, which: bad}
    with pytest.raises(GSM8KDataError, match=why):
        prepare(paths["train"], paths["test"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- reward ----------------------------------------------------------------------------------

REPLY = "Natalia sold 48/2 = 24 clips in May and 48 + 24 = 72 in all.\n"


@pytest.mark.parametrize(
    ("reply", "truth", "expected"),
    [
        (REPLY + "#### 72", "72", 1.0),  # right, in the format
        (REPLY + "#### 71", "72", 0.0),  # wrong number
        (REPLY + "The answer is 72.", "72", 0.0),  # right number, no "####"
        (REPLY + "####72", "72", 0.0),  # no space after "####"
        (REPLY + "\\boxed{72}", "72", 0.0),  # another format
        (REPLY + "#### $72", "72", 0.0),  # a unit in the way
        ("#### 1,600 corn plants", "1600", 1.0),  # thousands separator
        ("#### 72, no wait: #### 73", "72", 0.0),  # the last answer counts
        ("x" * 400 + "#### 72", "72", 1.0),  # a long reply (verl reads its last 300 chars)
    ],
)
def test_the_reward_is_verls_gsm8k_score(reply: str, truth: str, expected: float):
    from verl.utils.reward_score.gsm8k import compute_score

    task = {"id": "t", "question": "q", "ground_truth": truth}
    assert gsm8k_reward(task, reply) == expected
    assert gsm8k_reward(task, reply) == float(compute_score(reply, truth))


def test_the_reward_uses_verls_own_file():
    import verl.utils.reward_score.gsm8k as verls

    assert Path(verl_gsm8k().__file__) == Path(verls.__file__)


def test_no_reply_scores_zero_and_a_task_without_truth_is_a_non_retryable_error():
    assert gsm8k_reward({"ground_truth": "72"}, None) == 0.0
    with pytest.raises(RewardFunctionError, match="prepare_data"):
        gsm8k_reward({"id": "t", "answer": "72"}, "#### 72")


def test_darl_scores_a_rollout_with_it():
    spec = RewardSpec(function="darl.examples.gsm8k.reward:gsm8k_reward")
    summary = TrajectorySummary(
        rollout_id="r", attempt=1, calls=1, prompt_tokens=90, completion_tokens=60, call_ids=["c"]
    )
    task = {"id": "t", "question": "q", "ground_truth": "72"}
    assert asyncio.run(score(spec, task, REPLY + "#### 72", summary)) == 1.0
    assert asyncio.run(score(spec, task, REPLY + "#### 7", summary)) == 0.0


def test_scoring_does_not_import_torch():
    # The rollout worker imports the reward on first use, on its event loop.
    code = (
        "import sys; from darl.examples.gsm8k.reward import gsm8k_reward; "
        "assert gsm8k_reward({'ground_truth': '3'}, '#### 3') == 1.0; "
        "print(sorted(m for m in ('torch', 'ray', 'verl') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- the agent -------------------------------------------------------------------------------


def completion(text: str) -> dict:
    return {
        "id": "cmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "policy",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": text},
            }
        ],
    }


class FakeGateway:
    """Answers chat completions with `reply` (or `status`) and keeps what it was sent."""

    def __init__(self, reply: str = REPLY + "#### 72", status: int = 200) -> None:
        self.reply, self.status = reply, status
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "no"}})
        return httpx.Response(200, json=completion(self.reply))

    def body(self, i: int = -1) -> dict:
        return json.loads(self.requests[i].content)


TASK = {"id": "gsm8k-train-00000", "question": GSM8K_ROWS[0]["question"], "ground_truth": "72"}
BASE = "http://gateway.test/rollouts/r1/v1"


def test_the_prompt_is_verls_quickstart_prompt():
    assert agent.messages(TASK) == [
        {"role": "user", "content": GSM8K_ROWS[0]["question"] + " " + INSTRUCTION}
    ]


def test_a_task_that_is_the_question_itself_gets_the_same_prompt():
    assert agent.messages(TASK["question"]) == agent.messages(TASK)
    with pytest.raises(ValueError, match="no string 'question'"):
        agent.messages(["not", "a", "question"])


def test_the_agent_asks_once_and_answers_with_the_whole_reply():
    gateway = FakeGateway()
    client = OpenAI(
        base_url=BASE,
        api_key="rollout-token",
        http_client=httpx.Client(transport=httpx.MockTransport(gateway)),
    )
    assert agent.solve(client, TASK) == REPLY + "#### 72"
    [request] = gateway.requests
    assert str(request.url) == f"{BASE}/chat/completions"
    assert request.headers["authorization"] == "Bearer rollout-token"
    assert gateway.body()["messages"] == agent.messages(TASK)
    assert gateway.body()["max_tokens"] == 256


def test_the_agent_reports_its_answer_with_the_rollout_token():
    seen: list[httpx.Request] = []

    def result_url(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={})

    with httpx.Client(transport=httpx.MockTransport(result_url)) as http:
        agent.report("#### 72", "http://gateway.test/results/r1", "rollout-token", http)
        agent.report("#### 72", None, "rollout-token", http)  # run by hand: no report
    [request] = seen
    assert request.headers["authorization"] == "Bearer rollout-token"
    assert json.loads(request.content)["answer"] == "#### 72"


def rollout(service_agent: GSM8KAgent, task: dict) -> httpx.Response:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_service_app(service_agent))
        async with httpx.AsyncClient(transport=transport, base_url="http://agent") as client:
            body = {
                "rollout_id": "r1",
                "attempt": 1,
                "task": task,
                "openai_base_url": BASE,
                "api_key": "rollout-token",
            }
            return await client.post("/rollouts", json=body)

    return asyncio.run(post())


def service(gateway: FakeGateway) -> GSM8KAgent:
    http = httpx.AsyncClient(transport=httpx.MockTransport(gateway))
    return GSM8KAgent(http_client=http, max_retries=0)


def test_the_agent_service_answers_with_the_reply_through_the_rollouts_gateway():
    gateway = FakeGateway()
    response = rollout(service(gateway), TASK)
    assert response.status_code == 200
    assert response.json()["answer"] == REPLY + "#### 72"
    [request] = gateway.requests
    assert str(request.url) == f"{BASE}/chat/completions"
    assert request.headers["authorization"] == "Bearer rollout-token"
    assert gateway.body()["messages"] == agent.messages(TASK)


@pytest.mark.parametrize("gateway_status", [503, 400])
def test_a_gateway_error_fails_the_attempt_and_darl_tells_whose_fault_it_was(
    gateway_status: int,
):
    # The agent does not classify: the gateway records its own 5xx answers, and the rollout
    # workflow retries an attempt that failed after one (tests/workflow).
    response = rollout(service(FakeGateway(status=gateway_status)), TASK)
    assert response.status_code == 500
    assert str(gateway_status) in response.json()["detail"]


def test_a_task_without_a_question_is_refused():
    gateway = FakeGateway()
    assert rollout(service(gateway), {"id": "t", "ground_truth": "1"}).status_code == 422
    assert gateway.requests == []


# --- train.yaml ------------------------------------------------------------------------------

QUICKSTART = {
    "algorithm.adv_estimator": "grpo",
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 64,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
    "actor_rollout_ref.rollout.n": 5,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 8,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 4,
    "trainer.n_gpus_per_node": 1,
    "trainer.nnodes": 1,
}


def test_train_yaml_is_verls_quickstart_with_grpo():
    config = load_config(CONFIG)
    assert config.backend.name == "verl"
    # DARL fills in verl's prompts per step from batch_size.
    assert config.backend.settings == {**QUICKSTART, "data.train_batch_size": 256}
    assert (config.group_size, config.batch_size, config.epochs) == (5, 256, 15)
    assert config.backend.settings["actor_rollout_ref.rollout.n"] == config.group_size
    assert (config.aggregation.max_prompt_length, config.aggregation.max_response_length) == (
        512,
        256,
    )
    assert config.mode == "sync" and config.equal_reward_groups == "train"
    assert config.validation.every_steps == 10 and config.validation.tasks == 1319
    # verl's own checks: the batch splits into mini-batches, a mini-batch into micro-batches.
    mini = QUICKSTART["actor_rollout_ref.actor.ppo_mini_batch_size"]
    assert config.batch_size % mini == 0
    assert (mini * config.group_size) % QUICKSTART[
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    ] == 0


def test_train_yaml_names_the_recipes_parts():
    config = load_config(CONFIG)
    [server] = config.weight_sync.policy_servers
    assert (server.kind, server.url, server.launcher_url) == ("vllm", "http://127.0.0.1:8000", None)
    assert config.rollout.agent.kind == "http"
    assert config.rollout.agent.url == "http://127.0.0.1:8300/rollouts"
    assert resolve(config.rollout.reward) is gsm8k_reward
    assert config.dataset.path == str(REPO / ".darl" / "data" / "gsm8k" / "train.jsonl")
    assert config.validation.path == str(REPO / ".darl" / "data" / "gsm8k" / "test.jsonl")
    assert config.aggregation.max_response_length == agent.MAX_TOKENS


def test_every_backend_setting_is_a_key_of_verls_ppo_trainer():
    verl = importlib.util.find_spec("verl")
    assert verl is not None and verl.submodule_search_locations
    reference = Path(next(iter(verl.submodule_search_locations)))
    tree = yaml.safe_load((reference / "trainer/config/_generated_ppo_trainer.yaml").read_text())
    for key in load_config(CONFIG).backend.settings:
        node = tree
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{key}: verl has no {part!r}"
            node = node[part]


def test_verl_takes_the_settings_and_updates_on_quickstart_sized_mini_batches():
    from darl.trainer.verl_config import build_verl_config

    config = load_config(CONFIG)
    settings = build_verl_config(Path(config.backend.model_dir), config.backend.settings)
    # 64 prompts x 5 answers: four actor updates per step of 1,280 answers, as in verl.
    assert settings.mini_batch_rows == 320
    assert settings.use_reference  # the KL loss needs verl's reference model
    assert settings.world_size == 1
