"""The reference trainer's step with each group's shared prefix run once, against every row
run whole (trainer/shared_prefix.py). Prints figures; asserts nothing.

In process, on the tiny model the demo builds: batches of branching groups (G members that
share a prefix of P tokens, then a continuation of C tokens each), one train step each way with
the relay task's trainer settings, repeated, and the forward and backward pass of one
mini-batch's log-probs each way; the fastest of the repeats (the machine's other load only
adds time) and the largest difference between the two ways' log-probs of the rows.

    .venv/bin/python -m bench.shared_prefix_bench [--groups 8] [--group-size 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from verl import DataProto

from darl.serving.tiny_model import MODEL_PRESETS, create_model_dir, load_model_dir
from darl.trainer.aggregation import AggregationSettings, TrainingRow, to_data_proto
from darl.trainer.backend import StepOverrides
from darl.trainer.reference_backend import ReferenceBackend, ReferenceTrainerSettings
from darl.trainer.shared_prefix import per_row_log_probs, shared_prefix_log_probs

# (shared prefix, continuation) tokens: the relay's branching rows (its call 2's prompt, then
# its last answer), then episodes whose replayed prefix is ever longer against what follows.
SHAPES = ((8, 4), (64, 16), (256, 32), (1024, 64))
# The relay task's trainer settings (examples/relay/train.yaml).
SETTINGS = ReferenceTrainerSettings(
    lr=3e-3, ppo_epochs=4, ppo_mini_batch_size=32, shuffle=True, clip_ratio_high=0.28
)


def batch(groups: int, size: int, prefix: int, continuation: int, seed: int) -> DataProto:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randint(1, 11) for _ in range(n)]

    rows = []
    for g in range(groups):
        shared = tokens(prefix)
        for k in range(size):
            response = tokens(rng.randint(continuation // 2, continuation))
            rows.append(
                TrainingRow(
                    prompt_ids=[*shared, *tokens(1)],
                    response_ids=response,
                    response_mask=[1] * len(response),
                    rollout_logprobs=[-2.0] * len(response),
                    reward=rng.random(),
                    uid=f"g{g}",
                    rollout_id=f"g{g}.{k}",
                )
            )
    return to_data_proto(rows, AggregationSettings(pad_token_id=12))


def step_seconds(model_dir: Path, root: Path, data: DataProto, min_tokens: int | None) -> float:
    """Seconds of one train step, the checkpoint's writing included."""
    settings = SETTINGS.model_copy(update={"shared_prefix_min_tokens": min_tokens})
    backend = ReferenceBackend(model_dir, root, settings)
    backend.initialize()
    started = time.perf_counter()
    backend.train_step(1, data, StepOverrides(), lambda: None)
    return time.perf_counter() - started


def pass_seconds(model_dir: Path, data: DataProto, shared: bool, repeats: int) -> float:
    """Seconds of the forward and backward pass of one mini-batch's log-probs (32 rows drawn
    at random, as a shuffled step draws them), the fastest of `repeats`."""
    model, _ = load_model_dir(model_dir)
    model.train()
    index = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))[:32]
    fastest = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        if shared:
            log_probs, entropy = shared_prefix_log_probs(model, data, index, True, min_tokens=2)
        else:
            log_probs, entropy = per_row_log_probs(model, data, index, True)
        (log_probs.sum() + (entropy if entropy is not None else 0).sum()).backward()
        fastest = min(fastest, time.perf_counter() - started)
    return fastest


def largest_difference(model_dir: Path, data: DataProto) -> float:
    model, _ = load_model_dir(model_dir)
    index = torch.arange(len(data))
    mask = data.batch["response_mask"].bool()
    with torch.no_grad():
        rows, _ = per_row_log_probs(model, data, index, False)
        shared, _ = shared_prefix_log_probs(model, data, index, False, min_tokens=2)
    return float((rows - shared)[mask].abs().max())


def main(groups: int, size: int, repeats: int) -> None:
    table = Table(
        title=f"reference train step, {groups} groups of {size}, the relay's settings "
        f"(4 epochs, mini-batches of 32 rows, shuffled); fastest of {repeats}"
    )
    for column in (
        "prefix",
        "continuation",
        "step s: rows whole / prefix once",
        "step speed-up",
        "mini-batch pass ms: whole / once",
        "pass speed-up",
        "max |Δ logprob|",
    ):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory(prefix="darl-shared-prefix-") as tmp:
        root = Path(tmp)
        model_dir = create_model_dir(root / "digits", MODEL_PRESETS["digits"])
        # torch's first passes (kernel choice, allocations) are no one's cost: an untimed step.
        warm = batch(groups, size, *SHAPES[0], seed=0)
        for name, min_tokens in (("rows", None), ("shared", 2)):
            step_seconds(model_dir, root / f"warm-{name}", warm, min_tokens)
        for prefix, continuation in SHAPES:
            data = batch(groups, size, prefix, continuation, seed=prefix)
            times: dict[str, list[float]] = {"rows": [], "shared": []}
            for r in range(repeats):
                # Interleaved, so the machine's load falls on both ways alike.
                for name, min_tokens in (("rows", None), ("shared", 2)):
                    folder = root / f"{name}-{prefix}-{r}"
                    times[name].append(step_seconds(model_dir, folder, data, min_tokens))
            # The fastest of the repeats: the machine's other load only ever adds time.
            whole, once = min(times["rows"]), min(times["shared"])
            rows_pass = pass_seconds(model_dir, data, False, repeats + 2)
            shared_pass = pass_seconds(model_dir, data, True, repeats + 2)
            table.add_row(
                str(prefix),
                str(continuation),
                f"{whole:.2f} / {once:.2f}",
                f"{whole / once:.2f}x",
                f"{rows_pass * 1000:.0f} / {shared_pass * 1000:.0f}",
                f"{rows_pass / shared_pass:.2f}x",
                f"{largest_difference(model_dir, data):.1e}",
            )
    Console(width=140).print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    main(args.groups, args.group_size, args.repeats)
