"""The shared prefix computed once (trainer/shared_prefix.py): log-probs, entropy, the loss and
its gradients equal the per-row computation's within float tolerance, on rows laid out by the
aggregation; the prefix is run once per group; a reference step trains the same weights
either way."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from verl import DataProto

from darl.serving.tiny_model import MODEL_PRESETS, create_model_dir, load_model_dir
from darl.trainer.aggregation import AggregationSettings, TrainingRow, to_data_proto
from darl.trainer.backend import StepOverrides
from darl.trainer.reference_backend import ReferenceBackend, ReferenceTrainerSettings
from darl.trainer.shared_prefix import per_row_log_probs, shared_prefix_log_probs

ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model_dir(tmp_path_factory.mktemp("digits"), MODEL_PRESETS["digits"])


def row(prompt: list[int], response: list[int], uid: str, reward: float) -> TrainingRow:
    # Tokens between calls (mask 0) inside the response, as a merged trajectory row has.
    mask = [0 if i % 4 == 3 else 1 for i in range(len(response))]
    return TrainingRow(
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask,
        rollout_logprobs=[-1.0 * m for m in mask],
        reward=reward,
        uid=uid,
        rollout_id=f"{uid}-{len(response)}-{reward}",
    )


def branching_batch(seed: int = 0) -> DataProto:
    """Group `a`: 4 members of one 12-token replayed prefix, their prompts then differing in
    length; group `b`: 3 members of one 5-token prompt; `c`: a row alone; `d`: two rows that
    share only their first token (under the sharing threshold)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randint(1, 11) for _ in range(n)]

    prefix, short = tokens(12), tokens(5)
    # The token after a shared prefix differs by construction, whatever the draws.
    rows = [
        row([*prefix, 1 + i, *tokens(k - 1)], tokens(r), "a", rng.random())
        for i, (k, r) in enumerate(((1, 6), (3, 2), (1, 9), (2, 4)))
    ]
    rows += [row(short, tokens(r), "b", rng.random()) for r in (3, 7, 1)]
    rows += [row(tokens(6), tokens(5), "c", 0.5)]
    first = tokens(1)
    rows += [
        row([*first, 1, *tokens(3)], tokens(4), "d", 0.1),
        row([*first, 2, *tokens(5)], tokens(2), "d", 0.9),
    ]
    order = list(range(len(rows)))
    rng.shuffle(order)  # a mini-batch's rows of one group need not be adjacent
    return to_data_proto([rows[i] for i in order], AggregationSettings(pad_token_id=12))


def loss_and_grads(model, data: DataProto, shared: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    index = torch.arange(len(data))
    model.zero_grad(set_to_none=True)
    if shared:
        log_probs, entropy = shared_prefix_log_probs(model, data, index, True, min_tokens=2)
    else:
        log_probs, entropy = per_row_log_probs(model, data, index, True)
    assert entropy is not None
    mask = data.batch["response_mask"].float()
    advantages = torch.linspace(-1, 1, len(data))[:, None]
    loss = -((log_probs * advantages + 0.01 * entropy) * mask).sum() / mask.sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return log_probs.detach() * mask, loss.detach(), grads


def test_log_probs_loss_and_gradients_equal_the_per_row_computation(model_dir: Path) -> None:
    model, _ = load_model_dir(model_dir)
    model.train()
    data = branching_batch()
    shared_lp, shared_loss, shared_grads = loss_and_grads(model, data, shared=True)
    row_lp, row_loss, row_grads = loss_and_grads(model, data, shared=False)
    torch.testing.assert_close(shared_lp, row_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(shared_loss, row_loss, atol=ATOL, rtol=0)
    assert shared_grads.keys() == row_grads.keys() and row_grads
    for name, grad in row_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=ATOL, rtol=1e-4, msg=name)


def test_each_groups_prefix_is_run_once(model_dir: Path) -> None:
    model, _ = load_model_dir(model_dir)
    data = branching_batch()
    shapes: list[tuple[int, ...]] = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda _module, args, _out: shapes.append(tuple(args[0].shape))
    )
    index = torch.arange(len(data))
    with torch.no_grad():
        per_row_log_probs(model, data, index, False)
        per_row = sum(rows * width for rows, width in shapes)
        shapes.clear()
        shared_prefix_log_probs(model, data, index, False, min_tokens=2)
    hook.remove()
    # One pass over the prefixes of groups a (12 tokens) and b (4 of its 5), one over their 7
    # members' continuations, one over the rows of c and d (d shares 1 token, under 2).
    assert shapes[0] == (2, 12)
    assert [rows for rows, _ in shapes[1:]] == [7, 3]
    assert sum(rows * width for rows, width in shapes) < per_row


def test_a_reference_step_trains_the_same_weights_either_way(
    model_dir: Path, tmp_path: Path
) -> None:
    data = branching_batch(seed=1)
    settings = ReferenceTrainerSettings(lr=1e-2, ppo_mini_batch_size=11, ppo_epochs=2)
    weights = []
    for name, min_tokens in (("rows", None), ("shared", 2)):
        backend = ReferenceBackend(
            model_dir,
            tmp_path / name,
            settings.model_copy(update={"shared_prefix_min_tokens": min_tokens}),
        )
        backend.initialize()
        # In float64: AdamW's first steps move a weight by about lr * g / (|g| + eps), so a
        # gradient near 0 (1e-9) turns rounding, which differs by CPU, into a share of lr: in
        # float32 up to 1% of lr here; in float64 (only the log-softmax stays float32, as
        # verl's) 0.02%, checked to 0.5%. The parameters stay the optimizer's.
        assert backend.model is not None
        backend.model.double()
        backend.train_step(1, data, StepOverrides(), lambda: None)
        weights.append({k: v.detach().clone() for k, v in backend.model.state_dict().items()})
    initial = load_model_dir(model_dir)[0].double().state_dict()
    changed = False
    for key, value in weights[0].items():
        assert value.dtype == torch.float64, key
        torch.testing.assert_close(weights[1][key], value, atol=5e-3 * settings.lr, rtol=0, msg=key)
        changed |= not torch.equal(value, initial[key])
    assert changed
