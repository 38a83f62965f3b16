"""The coding agents' GPU recipe on paper: examples/swe/train-gpu.yaml loads with DARL's config
loader and verl takes its settings; its paths are this repository's files as the recipe lays
them out; mini-swe-agent (the real one, from .venv-swe) takes its command's options and the
config DARL merges over mini's own SWE-bench config; and its sizes agree with each other."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from darl.deploy.config_file import ConfigFileError, load_config, with_base
from darl.trainer.verl_config import build_verl_config
from darl.workflows.contracts import KubernetesAgentSpec, LocalAgentSpec

REPO = Path(__file__).parents[2]
CONFIG = REPO / "examples" / "swe" / "train-gpu.yaml"
AGENT_CONFIG = REPO / "deploy" / "k8s" / "examples" / "swe" / "mini-swe-agent.yaml"
SWE_PYTHON = REPO / ".venv-swe" / "bin" / "python"
# Where the recipe keeps this repository on its machine.
CHECKOUT = Path("/opt/darl")
# Qwen2.5-Coder-7B-Instruct's context (its config.json's max_position_embeddings).
CONTEXT_TOKENS = 32768


def here(path: str) -> Path:
    """A recipe path under /opt/darl as this checkout's path."""
    return REPO / Path(path).relative_to(CHECKOUT)


def agent() -> LocalAgentSpec:
    spec = load_config(CONFIG).rollout.agent
    assert isinstance(spec, LocalAgentSpec)
    return spec


def shell_words() -> tuple[list[str], list[str]]:
    """The words of the agent's shell line: mini's command, and what runs when mini fails."""
    command = agent().command or []
    assert command[:2] == ["/bin/sh", "-c"]
    words = shlex.split(command[2])
    cut = words.index("||")
    return words[:cut], words[cut + 1 :]


def mini_command() -> list[str]:
    return shell_words()[0]


def test_the_recipe_loads_and_verl_takes_its_settings():
    config = load_config(CONFIG)
    assert config.backend.name == "verl" and config.mode == "async"
    assert config.rollout.reward.grader is not None
    assert config.rollout.reward.grader.kind == "swe_tests"
    settings = build_verl_config(Path(config.backend.model_dir), config.backend.settings)
    assert settings.world_size == config.backend.settings["trainer.n_gpus_per_node"] == 4
    assert not settings.use_reference  # no KL loss: no reference model to hold
    # An actor update is ppo_mini_batch_size groups of group_size episodes.
    mini_batch = config.backend.settings["actor_rollout_ref.actor.ppo_mini_batch_size"]
    assert config.batch_size % mini_batch == 0
    assert settings.mini_batch_rows == mini_batch * config.group_size
    assert config.knobs.max_inflight >= config.batch_size * config.group_size


def test_the_recipes_paths_are_this_repositorys_files():
    config = load_config(CONFIG)
    assert here(config.dataset.path).name == "tasks.jsonl"
    sandbox = agent().sandbox
    assert sandbox is not None and sandbox.isolation == "bubblewrap"
    for path in sandbox.read_only:
        assert here(path).exists(), path
    words = mini_command()
    assert here(words[0]) == REPO / ".venv-swe" / "bin" / "mini"
    assert here(words[0]).exists(), "make swe installs .venv-swe"
    configs = [w.removeprefix("--config=") for w in words if w.startswith("--config=")]
    assert [here(c).is_file() for c in configs] == [True, True], configs
    assert here(configs[0]).name == "swebench.yaml" and here(configs[1]) == AGENT_CONFIG
    # Every file the agent needs is under a path its sandbox shows, and so is the Python
    # its commands find first, the worker's (the grader's).
    python = Path(agent().env["PATH"].split(":")[0]) / "python"
    assert here(str(python)) == REPO / ".venv" / "bin" / "python"
    for path in (words[0], *configs, str(python)):
        assert any(Path(path).is_relative_to(root) for root in sandbox.read_only), path


def test_mini_takes_the_command_and_the_config_merged_over_its_own(tmp_path: Path):
    words = mini_command()
    answer = tmp_path / "probe.json"
    configs = [str(here(w.removeprefix("--config="))) for w in words if w.startswith("--config=")]
    probe = f"""
import json, typer
from minisweagent.agents.default import AgentConfig
from minisweagent.config import get_config_from_spec
from minisweagent.environments import get_environment_class
from minisweagent.run.mini import app
from minisweagent.utils.serialize import recursive_merge
config = recursive_merge(*(get_config_from_spec(c) for c in {configs!r}))
environment = dict(config["environment"])
kind = get_environment_class(environment.pop("environment_class"))
options = [o for p in typer.main.get_command(app).params for o in p.opts]
json.dump({{
    "options": options,
    "agent": AgentConfig(**config["agent"]).model_dump(mode="json"),
    "environment": kind.__name__,
    "environment_config": kind(**environment).config.model_dump(mode="json"),
    "model": config["model"],
}}, open({str(answer)!r}, "w"))
"""
    done = subprocess.run(
        [str(SWE_PYTHON), "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(answer.read_text())
    for word in words[1:]:
        assert word.split("=", 1)[0] in found["options"], word
    assert words[-1] == "--task=$PROBLEM" and agent().env_map == {
        "PROBLEM": "input.problem_statement"
    }
    # mini's own SWE-bench prompts, DARL's limits; commands run in the sandbox's workdir
    # without the rollout token.
    assert "PR description" in found["agent"]["instance_template"]
    assert found["agent"]["step_limit"] == 50 and found["agent"]["cost_limit"] == 0
    assert found["environment"] == "LocalEnvironment"
    assert found["environment_config"]["cwd"] == agent().sandbox.workdir  # type: ignore[union-attr]
    blanked = {"OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AGL_KEY", "DARL_RESULT_URL"}
    assert {
        k: v for k, v in found["environment_config"]["env"].items() if k in blanked
    } == dict.fromkeys(blanked, "")
    assert found["model"]["model_name"].startswith("openai/")
    assert found["model"]["cost_tracking"] == "ignore_errors"
    assert found["model"]["model_kwargs"]["tool_choice"] == "required"


def test_an_episode_that_filled_the_context_is_graded():
    # mini exits 1 then, with the exception's name as its exit status in the trajectory; the
    # fallback turns exactly that into an exit 0, which DARL grades.
    words, fallback = shell_words()
    output = next(w.removeprefix("--output=") for w in words if w.startswith("--output="))
    assert fallback == ["grep", "-q", '"exit_status": "ContextWindowExceededError"', output]
    assert Path(output).is_relative_to("/tmp")  # the sandbox's private /tmp


def test_the_recipes_sizes_agree():
    config = load_config(CONFIG)
    mini = yaml.safe_load(AGENT_CONFIG.read_text())
    # mini ends the episode itself, and is graded, before DARL's timeout would kill it.
    assert mini["agent"]["wall_time_limit_seconds"] < config.rollout.timeouts.agent_seconds
    # An episode (first prompt, then everything after) fits the model's context, and one
    # training sequence fits a GPU's token budget across the sequence-parallel group.
    aggregation = config.aggregation
    assert aggregation.max_prompt_length + aggregation.max_response_length == CONTEXT_TOKENS
    settings = config.backend.settings
    budget = settings["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]
    assert budget * settings["actor_rollout_ref.actor.ulysses_sequence_parallel_size"] >= (
        CONTEXT_TOKENS
    )
    # A model turn fits in what is left after the first prompt.
    assert mini["model"]["model_kwargs"]["max_tokens"] < aggregation.max_response_length
    # A call in flight at a weight sync can finish within the drain.
    assert config.weight_sync.inflight == "drain"


K8S_CONFIG = REPO / "examples" / "swe" / "train-gpu-k8s.yaml"


def test_the_recipe_on_a_cluster_is_the_same_run_with_jobs_graded_on_their_volumes():
    """train-gpu-k8s.yaml extends train-gpu.yaml: every section it does not give is the
    recipe's; its agent is the shipped Job template (the name the swe overlay mounts it
    under), graded."""
    base, cluster = load_config(CONFIG), load_config(K8S_CONFIG)
    agent = cluster.rollout.agent
    assert isinstance(agent, KubernetesAgentSpec) and agent.workdir == "/testbed"
    assert agent.job_template == "/etc/darl/job-templates/swe.yaml"
    overlay = yaml.safe_load((REPO / "deploy/k8s/examples/swe/kustomization.yaml").read_text())
    (templates,) = [g for g in overlay["configMapGenerator"] if g["name"] == "darl-job-templates"]
    assert "swe.yaml=job-template.yaml" in templates["files"]
    assert cluster.rollout.reward == base.rollout.reward
    for section in ("backend", "aggregation", "knobs", "validation", "mode", "group_size"):
        assert getattr(cluster, section) == getattr(base, section), section
    assert cluster.run_id != base.run_id


def test_a_config_that_extends_another(tmp_path: Path):
    (tmp_path / "base.yaml").write_text("run_id: base\ngroup_size: 3\ndataset: {path: d.jsonl}\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nrun_id: child\n")
    child = yaml.safe_load((tmp_path / "child.yaml").read_text())
    merged = with_base(tmp_path / "child.yaml", child, None)
    assert merged["run_id"] == "child" and merged["group_size"] == 3
    assert merged["dataset"]["path"] == str(tmp_path / "d.jsonl")
    (tmp_path / "loop.yaml").write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigFileError, match="goes round"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "lost.yaml").write_text("extends: nowhere.yaml\n")
    with pytest.raises(ConfigFileError, match=r"nowhere\.yaml"):
        load_config(tmp_path / "lost.yaml")
