"""The verl backend: verl's config built through verl's config classes, DARL's batch through
the backend's layout and verl's own advantage and worker-loss code, and verl's real FSDP actor
worker (through Ray, on trainer/verl_cpu_platform.py) training the tiny model, with checkpoints
that the reference backend, the reference policy server and verl read from each other."""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor
from torch.distributed.tensor import DTensor
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.utils import tensordict_utils as tu
from verl.workers.config.actor import FSDPActorConfig
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from darl.serving.policy_app import create_policy_app
from darl.serving.policy_server import PolicyServer
from darl.serving.tiny_model import MODEL_PRESETS, create_model_dir, load_model_dir
from darl.trainer.aggregation import AggregationSettings, TrainingRow, to_data_proto
from darl.trainer.backend import (
    BatchError,
    CheckpointError,
    StepOutOfOrderError,
    StepOverrides,
    TrainerBackend,
)
from darl.trainer.reference_backend import (
    OPTIMIZER_TENSORS,
    ReferenceBackend,
    ReferenceTrainerSettings,
)
from darl.trainer.verl_backend import ACTOR_DIR, VerlBackend
from darl.trainer.verl_batch import PADDING_UID, prepare_batch, worker_input
from darl.trainer.verl_config import VerlConfigError, VerlSettings, build_verl_config
from tests.serving import served

# Small batches, float32 compute (FSDP's mixed precision is bf16 unless told), a Ray of our own.
CPU_RUN = {
    "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2,
    "actor_rollout_ref.actor.optim.lr": 5e-3,
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision": {
        "param_dtype": "fp32",
        "reduce_dtype": "fp32",
        "buffer_dtype": "fp32",
    },
    "data.train_batch_size": 8,
    "ray_kwargs.ray_init.num_cpus": 4,
    "+ray_kwargs.ray_init.include_dashboard": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model_dir(tmp_path_factory.mktemp("tiny"), MODEL_PRESETS["tiny"])


def cpu_settings(model_dir: Path, **overrides: object) -> VerlSettings:
    return build_verl_config(model_dir, {**CPU_RUN, **overrides}, device="cpu")


# --- verl's config ---------------------------------------------------------------------------


def test_overrides_land_in_verls_config_dataclasses(model_dir: Path) -> None:
    settings = build_verl_config(
        model_dir,
        {
            "actor_rollout_ref.actor.optim.lr": 3e-6,
            "algorithm.adv_estimator": "rloo",
            "algorithm.norm_adv_by_std_in_grpo": False,
            "actor_rollout_ref.actor.use_kl_loss": True,
            "actor_rollout_ref.actor.kl_loss_coef": 0.01,
            "actor_rollout_ref.actor.clip_ratio_high": 0.28,
            "actor_rollout_ref.model.override_config.attn_implementation": "eager",
        },
    )
    assert isinstance(settings.actor, FSDPActorConfig)
    assert isinstance(settings.algorithm, AlgoConfig)
    assert settings.actor.optim.lr == 3e-6
    assert (settings.actor.kl_loss_coef, settings.actor.clip_ratio_high) == (0.01, 0.28)
    assert settings.algorithm.adv_estimator == "rloo"
    assert settings.algorithm.norm_adv_by_std_in_grpo is False
    assert settings.use_reference and not settings.bypass_mode
    model = settings.config.actor_rollout_ref.model
    assert (model.path, model.override_config.attn_implementation) == (str(model_dir), "eager")
    # verl's defaults stay where nothing is said; DARL's differ only where it needs them.
    assert settings.actor.ppo_epochs == 1 and settings.actor.optim.weight_decay == 0.01
    assert "hf_model" in settings.actor.checkpoint.save_contents
    assert settings.device == "cuda" and settings.actor.strategy == "fsdp"


def test_cpu_defaults_give_way_to_the_users_settings(model_dir: Path) -> None:
    settings = build_verl_config(
        model_dir, {"actor_rollout_ref.actor.fsdp_config.use_torch_compile": True}, device="cpu"
    )
    assert settings.device == "cpu" and settings.actor.strategy == "fsdp2"
    assert settings.config.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    assert settings.actor.fsdp_config.use_torch_compile is True


def test_bypass_mode_sets_verls_bypass_policy_loss(model_dir: Path) -> None:
    settings = build_verl_config(model_dir, {"algorithm.rollout_correction.bypass_mode": True})
    assert settings.bypass_mode
    assert settings.actor.policy_loss.loss_mode == "bypass_mode"
    assert settings.actor.policy_loss.rollout_correction["bypass_mode"] is True


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"actor_rollout_ref.actor.optim.lrr": 1e-6},
            "did you mean 'actor_rollout_ref.actor.optim.lr'",
        ),
        ({"actor_rollout_ref.actor.ppo_epochs": "2"}, "ppo_epochs must be an int"),
        ({"actor_rollout_ref.actor.use_kl_loss": 1}, "use_kl_loss must be a bool"),
        ({"actor_rollout_ref.actor.loss_agg_mode": "mean"}, "Invalid loss_agg_mode: mean"),
        ({"algorithm.adv_estimator": "nope"}, "Unknown advantage estimator"),
        ({"actor_rollout_ref.actor.policy_loss.loss_mode": "x"}, "Unsupported loss mode"),
        ({"actor_rollout_ref.actor.ppo_mini_batch_size": 4096}, "train_batch_size"),
        ({"algorithm.adv_estimator": "gae"}, "needs a critic"),
        ({"algorithm.use_kl_in_reward": True}, "use_kl_in_reward is not supported"),
        ({"actor_rollout_ref.model.path": "/elsewhere"}, "set by DARL"),
        ({"+actor_rollout_ref.actor.ppo_epochs": 2}, "exists"),
        ({"+no_such_section.key": 1}, "no parent section"),
        ({"trainer.device": "cpu", "actor_rollout_ref.actor.use_kl_loss": True}, "pin_memory"),
    ],
)
def test_unknown_keys_and_bad_values_are_clear_errors(
    model_dir: Path, overrides: dict, message: str
) -> None:
    with pytest.raises(VerlConfigError, match=message.replace("(", r"\(")):
        build_verl_config(model_dir, overrides)


# --- DARL's batch through verl's code ----------------------------------------------------------


def rows_of(
    groups: dict[str, list[tuple[list[int], list[int], list[int], float]]],
) -> list[TrainingRow]:
    """TrainingRows from {uid: [(prompt ids, response ids, response mask, reward)]}, with
    made-up rollout log-probs (trainer/aggregation.py puts 0.0 where the mask is 0)."""
    rows = []
    for uid, members in groups.items():
        for i, (prompt, response, mask, reward) in enumerate(members):
            logprobs = [-0.5 - 0.1 * k if m else 0.0 for k, m in enumerate(mask)]
            rows.append(TrainingRow(prompt, response, mask, logprobs, reward, uid, f"{uid}-{i}"))
    return rows


GROUPS = {
    "a": [([5, 6, 7], [8, 9, 3], [1, 1, 1], 1.0), ([5, 6, 7], [4], [1], 0.0)],
    "b": [([11], [12, 13, 14, 15], [1, 0, 1, 1], 0.5), ([11], [2, 2], [1, 1], 0.0)],
    "c": [([21, 22], [23, 24], [1, 1], 0.7)],
}


@pytest.mark.parametrize(("micro", "length"), [(2, 6), (4, 12)])
def test_the_layout_pads_whole_micro_batches_and_keeps_every_row_once(
    model_dir: Path, micro: int, length: int
) -> None:
    """5 rows in mini-batches of 2 rows: 3 mini-batches, each of whole micro-batches (2 or 4
    rows), each holding real rows (padding at the end would leave one of padding only)."""
    batch = to_data_proto(rows_of(GROUPS), AggregationSettings())
    micro_sizes = {
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": micro,
    }
    settings = cpu_settings(model_dir, **micro_sizes)
    prepared = prepare_batch(batch, settings, vocab_size=200)
    data, real = prepared.data, torch.from_numpy(prepared.real)
    assert prepared.rows == 5 and prepared.mini_batch_rows == micro
    assert len(data) == length and settings.rows_granule == micro
    for start in range(0, len(data), prepared.mini_batch_rows):
        assert real[start : start + prepared.mini_batch_rows].any()  # no mini-batch of padding
    for key in ("input_ids", "response_mask", "token_level_rewards", "old_log_probs"):
        assert torch.equal(data.batch[key][real], batch.batch[key])
    assert list(data.non_tensor_batch["uid"][prepared.real]) == list(batch.non_tensor_batch["uid"])
    padding = ~real
    assert data.batch["response_mask"][padding].sum() == 0
    assert data.batch["token_level_rewards"][padding].sum() == 0
    assert all(u.startswith(PADDING_UID) for u in data.non_tensor_batch["uid"][prepared.real == 0])
    shuffled = prepare_batch(
        batch, cpu_settings(model_dir, **{"actor_rollout_ref.actor.shuffle": True}), 200, seed=3
    )
    assert sorted(shuffled.data.non_tensor_batch["uid"][shuffled.real]) == sorted("aabbc")


def test_bypass_mode_trains_on_the_rollout_log_probs(model_dir: Path) -> None:
    batch = to_data_proto(rows_of(GROUPS), AggregationSettings())
    batch.batch["old_log_probs"] = torch.zeros_like(batch.batch["old_log_probs"])
    bypass = cpu_settings(model_dir, **{"algorithm.rollout_correction.bypass_mode": True})
    prepared = prepare_batch(batch, bypass, vocab_size=200)
    real = torch.from_numpy(prepared.real)
    old = prepared.data.batch["old_log_probs"][real]
    assert torch.equal(old, batch.batch["rollout_log_probs"])
    recompute = prepare_batch(batch, cpu_settings(model_dir), vocab_size=200)
    assert torch.equal(recompute.data.batch["old_log_probs"][real], batch.batch["old_log_probs"])


def test_a_row_without_prompt_or_group_is_refused(model_dir: Path) -> None:
    batch = to_data_proto(rows_of(GROUPS), AggregationSettings())
    settings = cpu_settings(model_dir)
    with pytest.raises(BatchError, match="token ids must lie"):
        prepare_batch(batch, settings, vocab_size=10)
    no_prompt = to_data_proto(
        rows_of({"a": [([], [3, 4], [1, 1], 1.0), ([5], [6], [1], 0.0)]}), AggregationSettings()
    )
    with pytest.raises(BatchError, match="prompt token"):
        prepare_batch(no_prompt, settings, vocab_size=200)
    batch.non_tensor_batch.pop("uid")
    with pytest.raises(BatchError, match="uid"):
        prepare_batch(batch, settings, vocab_size=200)


def as_model_output(response_values: torch.Tensor, sent: tu.TensorDict) -> torch.Tensor:
    """Per-response-token values laid out as the FSDP engine returns them: one flat sequence
    per row, the value for response token t at position t-1 (the inverse of verl's
    no_padding_2_padding)."""
    attention = sent["attention_mask"]
    prompt_width = sent["prompts"].shape[1]
    prompt_lens = attention[:, :prompt_width].sum(1)
    response_lens = attention[:, prompt_width:].sum(1)
    pieces = []
    for i, (p, r) in enumerate(zip(prompt_lens.tolist(), response_lens.tolist(), strict=True)):
        row = torch.zeros(p + r)
        row[p - 1 : p + r - 1] = response_values[i, :r]
        pieces.append(row)
    flat = torch.cat(pieces)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), (prompt_lens + response_lens).cumsum(0)])
    return torch.nested.nested_tensor_from_jagged(flat, offsets=offsets)


def test_the_laid_out_batch_goes_through_verls_advantage_and_worker_loss(model_dir: Path) -> None:
    """What test_aggregation checks with core_algos, here through the backend's layout, verl's
    left_right_2_no_padding, verl's compute_advantage and the loss verl's actor worker runs
    (verl/workers/utils/losses.py): padding changes neither the advantages nor the loss."""
    batch = to_data_proto(rows_of(GROUPS), AggregationSettings())
    settings = cpu_settings(model_dir)
    prepared = prepare_batch(batch, settings, vocab_size=200)
    real = torch.from_numpy(prepared.real)
    algorithm = settings.algorithm

    def advantages_of(data: DataProto) -> torch.Tensor:
        return compute_advantage(
            data,
            adv_estimator=algorithm.adv_estimator,
            num_repeat=1,
            norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
            config=algorithm,
        ).batch["advantages"]

    padded = advantages_of(prepared.data)
    alone = advantages_of(to_data_proto(rows_of(GROUPS), AggregationSettings()))
    torch.testing.assert_close(padded[real], alone)
    assert torch.all(padded[~real] == 0) and padded[real].abs().sum() > 0

    sent = worker_input(prepared.data, temperature=1.0, calculate_entropy=False)
    tu.assign_non_tensor(
        sent,
        dp_size=1,
        global_batch_size=len(prepared.real),
        batch_num_tokens=int(sent["loss_mask"].sum()),
    )
    moved = prepared.data.batch["old_log_probs"] + 0.05 * prepared.data.batch["response_mask"]
    log_probs = torch.nn.Parameter(as_model_output(moved, sent).values())
    nested = torch.nested.nested_tensor_from_jagged(log_probs, offsets=sent["input_ids"].offsets())
    torch.testing.assert_close(no_padding_2_padding(nested, sent), moved)  # the layout above
    loss, metrics = ppo_loss(settings.actor, {"log_probs": nested}, sent)
    loss.backward()
    expected, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=batch.batch["old_log_probs"],
        log_prob=moved[real],
        advantages=alone,
        response_mask=batch.batch["response_mask"].bool(),
        loss_agg_mode="token-mean",
        config=settings.actor,
    )
    torch.testing.assert_close(loss, expected)
    grad = no_padding_2_padding(log_probs.grad, sent)
    assert torch.all(grad[prepared.data.batch["response_mask"] == 0] == 0)  # padding included
    assert grad[real].abs().sum() > 0 and "actor/pg_loss" in metrics


# --- verl's real actor worker on CPU, through Ray ---------------------------------------------

STEP_ROWS = [
    ("372=", "372", 1.0, "a"),
    ("372=", "9", 0.0, "a"),
    ("372=", "37", 0.5, "a"),
    ("5=", "5", 1.0, "b"),
    ("5=", "0", 0.0, "b"),
]


def hf_log_probs(model_dir: Path, batch: DataProto) -> torch.Tensor:
    """The response tokens' log-probs under the HF model in `model_dir` (masked)."""
    model, _ = load_model_dir(model_dir)
    b = batch.batch
    width_p, width_r = b["prompts"].shape[1], b["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=b["input_ids"],
            attention_mask=b["attention_mask"],
            position_ids=b["position_ids"],
        ).logits[:, width_p - 1 : width_p + width_r - 1]
    chosen = torch.log_softmax(logits.float(), -1).gather(-1, b["responses"][..., None])[..., 0]
    return chosen * b["response_mask"]


def rollout_batch(model_dir: Path) -> DataProto:
    """STEP_ROWS as trainer/aggregation.py lays them out, sampled (as far as the log-probs
    go) by the model in `model_dir`."""
    _, tokenizer = load_model_dir(model_dir)
    rows = []
    for i, (prompt, response, reward, uid) in enumerate(STEP_ROWS):
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        response_ids.append(tokenizer.eos_token_id)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ones = [1] * len(response_ids)
        rows.append(
            TrainingRow(prompt_ids, response_ids, ones, [0.0] * len(ones), reward, uid, f"r{i}")
        )
    batch = to_data_proto(rows, AggregationSettings(pad_token_id=tokenizer.pad_token_id))
    batch.batch["rollout_log_probs"] = hf_log_probs(model_dir, batch)
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"].clone()
    return batch


def weights_of(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


# One mini-batch of the 5 rows (padded to 6 for micro-batches of 2), as the reference backend's.
ONE_MINI_BATCH = {"actor_rollout_ref.actor.ppo_mini_batch_size": 8}
SECOND_KNOBS = StepOverrides(entropy_coeff=0.5)


@pytest.fixture(scope="module")
def reference_start(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """One step of the reference backend: its checkpoint is the verl run's model path."""
    root = tmp_path_factory.mktemp("reference-run")
    reference = ReferenceBackend(model_dir, root, ReferenceTrainerSettings(lr=1e-2))
    reference.initialize()
    reference.train_step(1, rollout_batch(model_dir))
    return reference.policy_path(1)


@pytest.fixture(scope="module")
def verl_run(
    tmp_path_factory: pytest.TempPathFactory, reference_start: Path
) -> Iterator[tuple[VerlBackend, Path]]:
    """verl's actor trained two steps from the reference backend's checkpoint (Ray started by
    the backend); yields it and a copy of its checkpoints as they were after step 2."""
    root = tmp_path_factory.mktemp("verl-run")
    settings = cpu_settings(reference_start, **ONE_MINI_BATCH)
    backend = VerlBackend(reference_start, root / "run", settings)
    try:
        backend.initialize()
        backend.train_step(1, rollout_batch(reference_start), StepOverrides(lr=1e-3))
        backend.train_step(2, rollout_batch(backend.policy_path(1)), SECOND_KNOBS)
        shutil.copytree(root / "run", root / "after-step-2")
        yield backend, root / "after-step-2"
    finally:
        backend.close()


def test_verls_worker_trains_a_step_once_from_a_reference_checkpoint(
    verl_run: tuple[VerlBackend, Path], reference_start: Path
) -> None:
    backend, _ = verl_run
    assert isinstance(backend, TrainerBackend)
    assert backend.checkpoint_steps()[:3] == [0, 1, 2]
    outcome = backend.train_step(1, rollout_batch(reference_start))  # saved: no training
    assert outcome == backend.store.read_outcome(1) and outcome.step == 1
    start, first = weights_of(backend.policy_path(0)), weights_of(backend.policy_path(1))
    assert start.keys() == weights_of(reference_start).keys()
    for key in start:  # verl's step 0 is the reference checkpoint it started from
        torch.testing.assert_close(start[key], weights_of(reference_start)[key], rtol=0, atol=0)
    assert any(not torch.equal(start[k], first[k]) for k in start)
    m = outcome.metrics
    assert m["actor/lr"] == pytest.approx(1e-3) and m["training/rows"] == len(STEP_ROWS)
    assert m["training/padding_rows"] == 1
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/advantages/mean"):
        assert math.isfinite(m[key]), key
    # verl's recomputed old log-probs are the HF model's: the rollout's agree to float error.
    assert m["training/rollout_probs_diff_max"] < 1e-6
    with pytest.raises(StepOutOfOrderError):
        backend.train_step(9, rollout_batch(reference_start))
    with pytest.raises(CheckpointError):
        backend.policy_path(9)


# verl's FSDP checkpoint holds the optimizer's state one file per rank; world size 1 here.
VERL_OPTIMIZER = "optim_world_size_1_rank_0.pt"
# Each step's learning rate: step 1's knob (the configured one is 5e-3), then the configured one.
STEP_LRS = {1: 1e-3, 2: 5e-3}
EPS32 = torch.finfo(torch.float32).eps


def verl_moments(backend: VerlBackend, step: int, names: list[str]) -> dict[str, list[Tensor]]:
    """AdamW's [exp_avg, exp_avg_sq] after `step`, as verl's checkpoint holds them: by parameter
    index in the HF model's order, as DTensors (whole tensors on one rank)."""
    saved = torch.load(
        backend.store.step_dir(step) / ACTOR_DIR / VERL_OPTIMIZER, weights_only=False
    )
    assert len(saved["state"]) == len(names)
    return {
        name: [
            t.to_local() if isinstance(t, DTensor) else t
            for t in (saved["state"][i]["exp_avg"], saved["state"][i]["exp_avg_sq"])
        ]
        for i, name in enumerate(names)
    }


def reference_moments(reference: ReferenceBackend, step: int) -> dict[str, list[Tensor]]:
    saved = load_file(reference.policy_path(step) / OPTIMIZER_TENSORS)
    assert reference.model is not None
    return {
        name: [saved[f"{name}.exp_avg"], saved[f"{name}.exp_avg_sq"]]
        for name, _ in reference.model.named_parameters()
    }


def adamw_direction(moments: list[Tensor], step: int, group: dict) -> Tensor:
    """How far AdamW moves each weight against its gradient per unit of learning rate, from the
    moments after optimizer step `step` (torch's _single_tensor_adam, before weight decay)."""
    (beta1, beta2), (m, v) = group["betas"], moments
    return m / (1 - beta1**step) / (v.sqrt() / math.sqrt(1 - beta2**step) + group["eps"])


def test_verls_step_is_the_reference_backends_step(
    verl_run: tuple[VerlBackend, Path], reference_start: Path, tmp_path: Path
) -> None:
    """Same start, batches, settings, knobs and verl math: the same step, in two parts. The
    same loss and gradients: AdamW's moments (running means of the gradients and of their
    squares) agree to float noise. The same AdamW step from them, learning rate and weight
    decay included: the weights' moves agree element-wise, to what AdamW makes of the two
    backends' float noise. The knobs reached verl's worker: without step 1's learning rate
    the moves differ, without step 2's entropy bonus its gradients do. (The reference
    backend's tests check the step's direction.)"""
    backend, _ = verl_run
    batch = rollout_batch(reference_start)
    reference = ReferenceBackend(
        reference_start, tmp_path, ReferenceTrainerSettings(lr=5e-3, ppo_mini_batch_size=8)
    )
    reference.initialize()
    reference.train_step(1, batch, StepOverrides(lr=1e-3))
    reference.train_step(2, rollout_batch(backend.policy_path(1)), SECOND_KNOBS)
    assert reference.model is not None and reference.optimizer is not None
    names = [name for name, _ in reference.model.named_parameters()]
    group = reference.optimizer.param_groups[0]  # betas, eps and weight decay: verl's defaults
    backends = (backend, reference)
    for step, lr in STEP_LRS.items():
        # The same loss, and gradient norm before clipping (the moments and AdamW ignore scale).
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            ours, theirs = (b.store.read_outcome(step).metrics[key] for b in backends)
            assert ours == pytest.approx(theirs, rel=1e-5), key
        moments = verl_moments(backend, step, names), reference_moments(reference, step)
        old = [weights_of(b.policy_path(step - 1)) for b in backends]
        new = [weights_of(b.policy_path(step)) for b in backends]
        assert new[0].keys() == new[1].keys() == set(names)
        for name in names:
            # Running means of the gradients and of their squares: float noise, not amplified.
            for ours, theirs in zip(moments[0][name], moments[1][name], strict=True):
                assert (ours - theirs).norm() <= 1e-4 * theirs.norm(), name
            # AdamW's step is w*(1 - lr*wd) - lr*m/(sqrt(v)+eps): about ±lr whatever a gradient's
            # size, so where one is within float noise of 0 (a few eps), the noise moves the
            # weight by up to ±lr and an element-wise atol passes by luck. The two moves may
            # differ, element by element, by lr times the gap between the directions each
            # backend's own moments give, plus rounding (units in the last place of the weight
            # and of the move).
            decay = 1 - lr * group["weight_decay"]
            moves = [n[name] - o[name] * decay for n, o in zip(new, old, strict=True)]
            directions = [adamw_direction(m[name], step, group) for m in moments]
            rounding = sum(
                4 * EPS32 * (o[name].abs() + lr * d.abs())
                for o, d in zip(old, directions, strict=True)
            )
            bound = lr * (directions[0] - directions[1]).abs() + rounding
            assert torch.all((moves[0] - moves[1]).abs() <= bound), name
            # ... and that bound is a small part of the move (about 1e-3 of it, measured).
            assert bound.norm() <= 1e-2 * moves[1].norm(), name
    before = hf_log_probs(reference_start, batch).sum(-1)
    after = hf_log_probs(backend.policy_path(1), batch).sum(-1)
    assert after[0] > before[0] and after[1] < before[1]  # rewards 1 and 0 in group "a"


def test_a_new_backend_resumes_verls_checkpoint_with_its_optimizer(
    verl_run: tuple[VerlBackend, Path], reference_start: Path
) -> None:
    backend, saved = verl_run
    batch = rollout_batch(backend.policy_path(2))
    if 3 not in backend.checkpoint_steps():
        backend.train_step(3, batch)
    resumed = VerlBackend(reference_start, saved, cpu_settings(reference_start, **ONE_MINI_BATCH))
    try:
        assert resumed.initialize().step == 2
        resumed.train_step(3, batch)
        ours, theirs = weights_of(resumed.policy_path(3)), weights_of(backend.policy_path(3))
        for key in ours:  # from step 0's weights, or without AdamW's moments, these differ
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-7, msg=key)
    finally:
        resumed.close()


def test_verls_checkpoint_loads_into_the_reference_backend(
    verl_run: tuple[VerlBackend, Path], tmp_path: Path
) -> None:
    backend, _ = verl_run
    reference = ReferenceBackend(backend.policy_path(2), tmp_path, ReferenceTrainerSettings())
    reference.initialize()
    assert reference.model is not None
    saved = weights_of(backend.policy_path(2))
    loaded = reference.model.state_dict()
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
    outcome = reference.train_step(1, rollout_batch(backend.policy_path(2)))
    assert math.isfinite(outcome.metrics["actor/pg_loss"])


async def test_verls_checkpoint_serves_and_reloads_in_the_policy_server(
    verl_run: tuple[VerlBackend, Path], tmp_path: Path
) -> None:
    backend, _ = verl_run
    policy = PolicyServer(backend.policy_path(1), max_batch=4)
    policy.engine.start()
    try:
        async with (
            served(create_policy_app(policy), tmp_path, "policy") as url,
            httpx.AsyncClient(base_url=url, timeout=60) as http,
        ):
            chat = {"messages": [{"role": "user", "content": "5="}], "max_tokens": 4}
            answer = await http.post("/v1/chat/completions", json={**chat, "logprobs": True})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["logprobs"]["content"]
            step = {"path": str(backend.policy_path(2)), "version": 2}
            reloaded = await http.post("/reload_weights", json=step)
            assert reloaded.json() == {"policy_version": 2}
        served_weights = policy.engine.model.state_dict()
        for key, value in weights_of(backend.policy_path(2)).items():
            torch.testing.assert_close(served_weights[key], value, rtol=0, atol=0, msg=key)
    finally:
        policy.engine.stop()
