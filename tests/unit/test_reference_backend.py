"""The CPU reference trainer backend: per-step idempotence, resuming from disk (weights and
AdamW state), the direction of the policy-gradient step, and checkpoints the policy server
loads."""

from __future__ import annotations

import asyncio
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from verl import DataProto

from darl.examples.digits import task as digits_task
from darl.serving.policy_server import PolicyServer
from darl.serving.tiny_model import MODEL_PRESETS, create_model_dir, load_model_dir
from darl.trainer.backend import (
    BatchError,
    CheckpointError,
    StepOutcome,
    StepOutOfOrderError,
    StepOverrides,
    TrainerBackend,
)
from darl.trainer.checkpoints import CheckpointStore
from darl.trainer.reference_backend import (
    OPTIMIZER_JSON,
    OPTIMIZER_TENSORS,
    ReferenceBackend,
    ReferenceTrainerSettings,
)

SETTINGS = ReferenceTrainerSettings(lr=1e-2, ppo_mini_batch_size=4, ppo_epochs=2, shuffle=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model_dir(tmp_path_factory.mktemp("digits"), MODEL_PRESETS["digits"])


def backend_at(model_dir: Path, checkpoints: Path, **settings: object) -> ReferenceBackend:
    backend = ReferenceBackend(
        model_dir, checkpoints, SETTINGS.model_copy(update=settings) if settings else SETTINGS
    )
    backend.initialize()
    return backend


def make_batch(
    backend: ReferenceBackend, rows: list[tuple[str, str, float, str]], eos: bool = True
) -> DataProto:
    """Rows of (prompt, response text, reward, group uid), each response ending in EOS."""
    tokenizer = backend.tokenizer
    assert tokenizer is not None
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, *_ in rows]
    response_ids = [
        tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * eos
        for _, r, *_ in rows
    ]
    rewards = [reward for *_, reward, _ in rows]
    return batch_of(backend, prompt_ids, response_ids, rewards, [uid for *_, uid in rows])


def batch_of(
    backend: ReferenceBackend,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    rewards: list[float],
    uids: list[str],
) -> DataProto:
    """The rows laid out as trainer/aggregation.py does, with the current model's log-probs as
    the rollout log-probs (on-policy; the policy server's agree to ~1e-7)."""
    assert backend.tokenizer is not None
    pad = backend.tokenizer.pad_token_id
    width_p = max(map(len, prompt_ids))
    width_r = max(map(len, response_ids))
    prompts = torch.tensor([[pad] * (width_p - len(x)) + x for x in prompt_ids])
    responses = torch.tensor([x + [pad] * (width_r - len(x)) for x in response_ids])
    prompt_lengths = torch.tensor([len(x) for x in prompt_ids])[:, None]
    response_lengths = torch.tensor([len(x) for x in response_ids])[:, None]
    prompt_mask = torch.arange(width_p) >= width_p - prompt_lengths
    response_mask = torch.arange(width_r) < response_lengths
    attention_mask = torch.cat([prompt_mask, response_mask], 1).long()
    scores = torch.zeros(len(rewards), width_r)
    scores[torch.arange(len(rewards)), response_lengths[:, 0] - 1] = torch.tensor(rewards)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": response_mask.long(),
        "token_level_scores": scores,
        "token_level_rewards": scores.clone(),
    }
    tensors["old_log_probs"] = response_log_probs(backend, tensors)
    tensors["rollout_log_probs"] = tensors["old_log_probs"].clone()
    rollout_ids = [f"rollout-{i}" for i in range(len(rewards))]
    return DataProto.from_dict(
        tensors,
        non_tensors={
            "uid": np.array(uids, dtype=object),
            "rollout_id": np.array(rollout_ids, dtype=object),
        },
    )


def response_log_probs(backend: ReferenceBackend, t: dict[str, torch.Tensor]) -> torch.Tensor:
    assert backend.model is not None
    width_p, width_r = t["prompts"].shape[1], t["responses"].shape[1]
    with torch.no_grad():
        logits = backend.model(
            input_ids=t["input_ids"],
            attention_mask=t["attention_mask"],
            position_ids=t["position_ids"],
        ).logits[:, width_p - 1 : width_p + width_r - 1]
    chosen = torch.log_softmax(logits, -1).gather(-1, t["responses"][..., None])[..., 0]
    return chosen * t["response_mask"]


ROWS = [
    ("372=", "372", 1.0, "a"),
    ("372=", "37", 0.5, "a"),
    ("372=", "9", 0.0, "a"),
    ("372=", "3721", 0.6, "a"),
    ("5=", "5", 1.0, "b"),
    ("5=", "55", 0.3, "b"),
    ("5=", "0", 0.0, "b"),
    ("5=", "", 0.2, "b"),
]


def weights(backend: ReferenceBackend) -> dict[str, torch.Tensor]:
    assert backend.model is not None
    return {k: v.detach().clone() for k, v in backend.model.state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_the_reference_backend_meets_the_contract(model_dir: Path, tmp_path: Path) -> None:
    backend = backend_at(model_dir, tmp_path)
    assert isinstance(backend, TrainerBackend)
    assert backend.checkpoint_steps() == [0]
    assert backend.latest_step() == 0
    assert backend.initialize().step == 0  # idempotent


def test_a_step_is_trained_once_however_often_it_is_called(model_dir: Path, tmp_path: Path) -> None:
    backend = backend_at(model_dir, tmp_path)
    before = weights(backend)
    first = backend.train_step(1, make_batch(backend, ROWS))
    after = weights(backend)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    again = backend.train_step(1, make_batch(backend, ROWS[:4]))
    assert again == first
    assert_same_weights(weights(backend), after)
    assert backend.checkpoint_steps() == [0, 1]
    assert first.checkpoint == backend.policy_path(1)
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/grad_norm"):
        assert np.isfinite(first.metrics[key])
    assert first.metrics["training/rows"] == len(ROWS)


def test_a_step_out_of_order_is_refused(model_dir: Path, tmp_path: Path) -> None:
    backend = backend_at(model_dir, tmp_path)
    with pytest.raises(StepOutOfOrderError):
        backend.train_step(2, make_batch(backend, ROWS))
    backend.train_step(1, make_batch(backend, ROWS))
    with pytest.raises(StepOutOfOrderError):
        backend.train_step(3, make_batch(backend, ROWS))
    with pytest.raises(CheckpointError):
        backend.policy_path(3)


def test_a_new_backend_resumes_with_the_same_weights_and_optimizer(
    model_dir: Path, tmp_path: Path
) -> None:
    backend = backend_at(model_dir, tmp_path / "run")
    backend.train_step(1, make_batch(backend, ROWS))
    resumed = backend_at(model_dir, tmp_path / "run")
    assert resumed.latest_step() == 1
    assert_same_weights(weights(resumed), weights(backend))
    assert backend.optimizer is not None and resumed.optimizer is not None
    saved, loaded = backend.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    assert saved["state"].keys() == loaded["state"].keys()
    for index, state in saved["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(loaded["state"][index][key], value, rtol=0, atol=0)


def test_a_resumed_backend_trains_the_next_step_as_the_first_would(
    model_dir: Path, tmp_path: Path
) -> None:
    backend = backend_at(model_dir, tmp_path / "run")
    backend.train_step(1, make_batch(backend, ROWS))
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    shutil.copytree(tmp_path / "run", tmp_path / "no-optimizer")
    for name in (OPTIMIZER_JSON, OPTIMIZER_TENSORS):
        (tmp_path / "no-optimizer" / "step-000001" / name).unlink()
    batch = make_batch(backend, ROWS)
    backend.train_step(2, batch)
    resumed = backend_at(model_dir, tmp_path / "copy")
    resumed.train_step(2, batch)
    assert_same_weights(weights(resumed), weights(backend))
    # AdamW's moments matter, so the check above can fail: without them the step differs.
    amnesic = backend_at(model_dir, tmp_path / "no-optimizer")
    amnesic.train_step(2, batch)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(weights(amnesic).values(), weights(backend).values(), strict=True)
    )


def test_a_positive_advantage_raises_the_responses_log_prob(
    model_dir: Path, tmp_path: Path
) -> None:
    backend = backend_at(model_dir, tmp_path, ppo_epochs=1, ppo_mini_batch_size=64, lr=3e-3)
    rows = [("41=", "41", 1.0, "g"), ("41=", "7", 0.0, "g")]
    batch = make_batch(backend, rows)
    before = batch.batch["old_log_probs"].sum(-1)
    backend.train_step(1, batch)
    after = response_log_probs(backend, dict(batch.batch.items())).sum(-1)
    assert after[0] > before[0] + 1e-3
    assert after[1] < before[1] - 1e-3


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus"])
def test_other_estimators_and_the_kl_loss_train(
    model_dir: Path, tmp_path: Path, estimator: str
) -> None:
    backend = backend_at(
        model_dir,
        tmp_path,
        adv_estimator=estimator,
        use_kl_loss=True,
        ppo_epochs=1,
        ppo_mini_batch_size=len(ROWS),
    )
    first = backend.train_step(1, make_batch(backend, ROWS), StepOverrides(lr=1e-3))
    second = backend.train_step(2, make_batch(backend, ROWS), StepOverrides(kl_loss_coef=0.5))
    assert first.metrics["actor/lr"] == 1e-3
    # One mini-batch: step 1 trains the reference itself, step 2 a model that moved away.
    assert first.metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert second.metrics["actor/kl_loss"] > 0


def test_an_unusable_batch_is_refused_before_training(model_dir: Path, tmp_path: Path) -> None:
    backend = backend_at(model_dir, tmp_path)
    batch = make_batch(backend, ROWS)
    batch.batch["response_mask"] = torch.zeros_like(batch.batch["response_mask"])
    with pytest.raises(BatchError):
        backend.train_step(1, batch)
    no_uid = make_batch(backend, ROWS)
    no_uid.non_tensor_batch.pop("uid")
    with pytest.raises(BatchError):
        backend.train_step(1, no_uid)
    assert backend.checkpoint_steps() == [0]


def test_heartbeats_come_between_mini_batches(model_dir: Path, tmp_path: Path) -> None:
    backend = backend_at(model_dir, tmp_path)
    beats: list[int] = []
    backend.train_step(1, make_batch(backend, ROWS), heartbeat=lambda: beats.append(1))
    assert len(beats) == SETTINGS.ppo_epochs * len(ROWS) // SETTINGS.ppo_mini_batch_size


def test_an_outcome_with_non_finite_metrics_reads_back(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    outcome = StepOutcome(
        step=4, metrics={"actor/grad_norm": math.inf, "x": math.nan}, checkpoint=tmp_path, seconds=1
    )
    assert store.publish(4, lambda folder: store.write_outcome(folder, outcome))
    again = store.read_outcome(4)
    assert again.metrics["actor/grad_norm"] == math.inf and math.isnan(again.metrics["x"])
    assert not store.publish(4, lambda folder: store.write_outcome(folder, outcome))


def test_a_half_written_checkpoint_is_never_a_step(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / ".tmp-step-000001-deadbeef").mkdir(parents=True)
    backend = backend_at(model_dir, tmp_path)
    assert backend.checkpoint_steps() == [0]
    assert not (tmp_path / ".tmp-step-000001-deadbeef").exists()
    backend.train_step(1, make_batch(backend, ROWS))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000", "step-000001"]


async def test_a_checkpoint_loads_in_the_policy_server(model_dir: Path, tmp_path: Path) -> None:
    backend = backend_at(model_dir, tmp_path)
    backend.train_step(1, make_batch(backend, ROWS))
    path = backend.policy_path(1)
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= {
        p.name for p in path.iterdir()
    }
    server = PolicyServer(model_dir)
    server.engine.start()
    try:
        await server.reload_weights(path, version=1)
    finally:
        await asyncio.to_thread(server.engine.stop)
    assert server.policy_version == 1
    served = server.engine.model.state_dict()
    for key, value in weights(backend).items():
        torch.testing.assert_close(served[key], value, rtol=0, atol=0, msg=key)
    model, tokenizer = load_model_dir(path)
    assert len(tokenizer) == model.config.vocab_size == len(server.tokenizer)


def test_a_step_that_fails_midway_is_retried_from_the_saved_state(
    model_dir: Path, tmp_path: Path
) -> None:
    clean = backend_at(model_dir, tmp_path / "clean")
    batch = make_batch(clean, ROWS)
    clean.train_step(1, batch)
    backend = backend_at(model_dir, tmp_path / "failing")

    def cancelled() -> None:
        raise TimeoutError("the activity was cancelled")

    with pytest.raises(TimeoutError):
        backend.train_step(1, batch, heartbeat=cancelled)  # after one optimizer step
    assert backend.checkpoint_steps() == [0]
    backend.train_step(1, batch)
    assert_same_weights(weights(backend), weights(clean))


def sample(
    backend: ReferenceBackend, prompts: list[str], max_tokens: int, generator: torch.Generator
) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """Temperature-1 sampling as serving/generation.py does it (EOS ends and is kept)."""
    model, tokenizer = backend.model, backend.tokenizer
    assert model is not None and tokenizer is not None
    eos = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    responses: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        for _ in range(max_tokens):
            live = [i for i, r in enumerate(responses) if not r or r[-1] not in eos]
            if not live:
                break
            for i in live:
                ids = torch.tensor([prompt_ids[i] + responses[i]])
                logits = model(input_ids=ids).logits[0, -1]
                token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
                responses[i].append(int(token))
    texts = [
        tokenizer.decode([t for t in r if t not in eos], skip_special_tokens=True)
        for r in responses
    ]
    return prompt_ids, responses, texts


def test_the_test_recipe_learns_the_digits_task(tmp_path: Path) -> None:
    recipe = digits_task.TEST
    model_dir = create_model_dir(tmp_path / "model", MODEL_PRESETS[recipe.model_preset])
    backend = ReferenceBackend(
        model_dir, tmp_path / "run", ReferenceTrainerSettings(**recipe.trainer)
    )
    backend.initialize()
    generator = torch.Generator().manual_seed(0)
    rewards: list[list[float]] = []
    for step in range(1, recipe.steps + 1):
        tasks = [
            task
            for task in digits_task.make_tasks(
                recipe.groups_per_step, seed=step, max_tokens=recipe.max_tokens
            )
            for _ in range(recipe.group_size)
        ]
        prompt_ids, responses, texts = sample(
            backend, [t["prompt"] for t in tasks], recipe.max_tokens, generator
        )
        scores = [digits_task.digits_reward(t, a, None) for t, a in zip(tasks, texts, strict=True)]
        rewards.append(scores)
        uids = [t["id"] for t in tasks]
        backend.train_step(step, batch_of(backend, prompt_ids, responses, scores, uids))
    first, last = np.array(rewards[0] + rewards[1]), np.array(rewards[-2] + rewards[-1])
    standard_error = np.sqrt(first.var(ddof=1) / first.size + last.var(ddof=1) / last.size)
    assert last.mean() - first.mean() > 5 * standard_error, (first.mean(), last.mean())
