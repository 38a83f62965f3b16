"""The training run's inputs and files: datasets (Parquet and JSON lines, the per-epoch order),
metrics.jsonl and the reward plot, and config loading for `darl train`."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from pydantic import ValidationError

from darl.deploy.config_file import ConfigFileError, load_config
from darl.examples.digits.task import DEMO
from darl.trainer.datasets import DatasetError, TaskTables, load_tasks
from darl.trainer.run_files import REWARD_PLOT, plot_rewards, read_metrics, write_step
from darl.workflows.training_config import (
    VERL_ROLLOUT_N,
    PolicyServerSpec,
    TrainingConfig,
    WeightSyncSettings,
)

ROWS = [{"id": i, "prompt": f"{i}=", "answer": str(i)} for i in range(10)]
DEMO_CONFIG = Path(__file__).parents[2] / "examples" / "digits" / "train.yaml"
GSM8K_CONFIG = Path(__file__).parents[2] / "examples" / "gsm8k" / "train.yaml"


def test_parquet_and_jsonl_give_the_same_rows(tmp_path: Path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "tasks.parquet")
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert load_tasks(tmp_path / "tasks.parquet").rows == ROWS
    assert load_tasks(tmp_path / "tasks.jsonl").rows == ROWS


def test_a_json_lines_task_may_be_any_json_value_and_is_kept_as_written(tmp_path: Path):
    tasks = ["What is 2 + 2?", 7, [1, "a"], {"question": "q"}, {"when": "2024-01-02"}, True]
    (tmp_path / "tasks.jsonl").write_text("\n".join(json.dumps(t) for t in tasks) + "\n\n")
    # No fields of other lines added (as null), no date-like string turned into a timestamp.
    assert load_tasks(tmp_path / "tasks.jsonl").rows == tasks


def test_a_null_line_is_not_a_task(tmp_path: Path):
    (tmp_path / "tasks.jsonl").write_text('{"question": "q"}\nnull\n')
    with pytest.raises(DatasetError, match="line 2 is null"):
        load_tasks(tmp_path / "tasks.jsonl")


def test_epoch_order_is_a_deterministic_permutation(tmp_path: Path):
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    table = TaskTables().get(str(tmp_path / "tasks.jsonl"))
    first = table.order(epoch=0, seed=3, shuffle=True)
    assert sorted(first) == list(range(10))
    assert list(first) == list(table.order(epoch=0, seed=3, shuffle=True))
    assert list(first) != list(table.order(epoch=1, seed=3, shuffle=True))
    assert list(table.order(epoch=5, seed=3, shuffle=False)) == list(range(10))


@pytest.mark.parametrize(
    ("name", "content", "why"),
    [
        ("missing.jsonl", None, "does not exist"),
        ("empty.jsonl", "", "cannot be read|no rows"),
        ("tasks.csv", "a,b\n", "expected .parquet or .jsonl"),
        ("broken.jsonl", "{not json\n", "cannot be read"),
        ("broken-later.jsonl", '{"a": 1}\n{not json\n', "cannot be read: line 2"),
    ],
)
def test_a_bad_dataset_is_a_clear_error(tmp_path: Path, name: str, content: str | None, why: str):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(DatasetError, match=why):
        TaskTables().get(str(tmp_path / name))


def test_a_step_written_again_replaces_its_line_and_the_plot_is_drawn(tmp_path: Path):
    record = {"step": 1, "reward_mean": 0.1, "reward_std": 0.05, "success_rate": 0.0}
    write_step(tmp_path, record)
    write_step(tmp_path, {**record, "step": 2, "reward_mean": 0.4})
    write_step(tmp_path, {**record, "val_reward_mean": 0.3})
    assert [(r["step"], r.get("val_reward_mean")) for r in read_metrics(tmp_path)] == [
        (1, 0.3),
        (2, None),
    ]
    assert plot_rewards(tmp_path, "run") == tmp_path / REWARD_PLOT
    assert (tmp_path / REWARD_PLOT).read_bytes()[:4] == b"\x89PNG"
    assert plot_rewards(tmp_path / "nothing-yet") is None


def test_a_validation_result_keeps_the_trainer_figures_its_line_has(tmp_path: Path):
    """The run's state keeps the trainer's figures in its last step record only: a later
    validation result on an earlier record comes without them, and the line keeps its own."""
    record = {"step": 1, "reward_mean": 0.1, "trainer": {"actor/pg_loss": 0.5}}
    write_step(tmp_path, record)
    write_step(tmp_path, {**record, "trainer": {}, "val_reward_mean": 0.3})
    [line] = read_metrics(tmp_path)
    assert line["trainer"] == {"actor/pg_loss": 0.5} and line["val_reward_mean"] == 0.3
    write_step(tmp_path, {**record, "trainer": {"actor/pg_loss": 0.7}})
    assert read_metrics(tmp_path)[0]["trainer"] == {"actor/pg_loss": 0.7}


def test_the_demo_config_loads_with_absolute_paths(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(DEMO_CONFIG, run_id="mine")
    assert config.run_id == "mine"
    assert Path(config.dataset.path).is_absolute()
    assert config.backend.model_dir == str(tmp_path / ".darl" / "models" / "digits")


def test_the_demo_config_is_the_digits_demo_recipe():
    """examples/digits/train.yaml and darl.examples.digits.task.DEMO describe one recipe."""
    config = load_config(DEMO_CONFIG)
    assert config.group_size == DEMO.group_size
    assert config.batch_size == DEMO.groups_per_step
    assert config.total_steps == DEMO.steps
    assert {k: config.backend.settings[k] for k in DEMO.trainer} == DEMO.trainer
    tasks = [json.loads(line) for line in Path(config.dataset.path).read_text().splitlines()]
    assert {t["max_tokens"] for t in tasks} == {DEMO.max_tokens}
    assert {len(t["answer"]) for t in tasks} == set(range(DEMO.min_digits, DEMO.max_digits + 1))


def test_a_bad_config_names_the_field(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text(DEMO_CONFIG.read_text().replace("group_size: 8", "group_size: 0"))
    with pytest.raises(ConfigFileError, match="group_size"):
        load_config(path)
    path.write_text("- just a list\n")
    with pytest.raises(ConfigFileError, match="mapping"):
        load_config(path)


def test_policy_servers_are_urls_or_specs_and_keep_refuses_servers_that_restart():
    plain = WeightSyncSettings(gateway_admin_url="http://g", policy_servers=["http://p"])
    assert plain.policy_servers == [PolicyServerSpec(kind="reference", url="http://p")]
    # The same through JSON, as `temporal workflow start --input-file` sends it.
    assert WeightSyncSettings.model_validate_json(plain.model_dump_json()) == plain
    vllm = {"kind": "vllm", "url": "http://v", "launcher_url": "http://l"}
    mixed = WeightSyncSettings(gateway_admin_url="http://g", policy_servers=["http://p", vllm])
    assert [s.restarts_to_load for s in mixed.policy_servers] == [False, True]
    with pytest.raises(ValidationError, match="restart to load weights"):
        WeightSyncSettings(gateway_admin_url="http://g", policy_servers=[vllm], inflight="keep")
    in_place = WeightSyncSettings(
        gateway_admin_url="http://g",
        policy_servers=[{"kind": "vllm", "url": "http://v"}],
        inflight="keep",
    )
    assert not in_place.policy_servers[0].restarts_to_load
    with pytest.raises(ValidationError, match="kind"):
        WeightSyncSettings(
            gateway_admin_url="http://g", policy_servers=[{"kind": "sglang", "url": "http://s"}]
        )


def test_verl_rollout_n_is_the_group_size():
    data = yaml.safe_load(GSM8K_CONFIG.read_text())
    data["backend"]["settings"].pop(VERL_ROLLOUT_N)
    data["group_size"] = 6
    assert TrainingConfig.model_validate(data).backend.settings[VERL_ROLLOUT_N] == 6
    data["backend"]["settings"][VERL_ROLLOUT_N] = 5
    with pytest.raises(ValidationError, match="must equal group_size"):
        TrainingConfig.model_validate(data)
    data["backend"]["settings"][VERL_ROLLOUT_N] = 6
    assert TrainingConfig.model_validate(data).backend.settings["data.train_batch_size"] == 256
    data["backend"]["settings"]["data.train_batch_size"] = 128
    with pytest.raises(ValidationError, match="must equal batch_size"):
        TrainingConfig.model_validate(data)
    # The reference backend's settings are its own: nothing is added to them.
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    assert VERL_ROLLOUT_N not in TrainingConfig.model_validate(demo).backend.settings
