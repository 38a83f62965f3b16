"""The tiny model's presets (printable ASCII by default, digits for the toy task) and the
digits task they serve: vocabularies, round trips, idempotent model directories, rewards."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from darl.examples.digits.task import DEMO, TEST, TaskSpecError, digits_reward, make_tasks, success
from darl.serving.tiny_model import (
    IM_END,
    MODEL_PRESETS,
    SPEC_FILE,
    SPECIAL_TOKENS,
    ModelSpecError,
    TinyModelSpec,
    build_model,
    build_tokenizer,
    create_model_dir,
    load_model_dir,
)


def test_the_default_preset_is_the_model_it_always_was() -> None:
    spec = MODEL_PRESETS["tiny"]
    assert spec == TinyModelSpec()
    tokenizer = build_tokenizer(spec)
    assert len(tokenizer) == 101
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [98, 99, 100]
    assert tokenizer("Hi!")["input_ids"] == [44, 19, 63]
    # Pinned when the alphabet became configurable: same seed, same weights.
    weights = build_model(spec, tokenizer).model.embed_tokens.weight.detach()
    assert weights[5, :3].tolist() == pytest.approx(
        [-0.02857622317969799, -0.0003178859769832343, -0.05012868717312813]
    )


def test_the_digits_preset_has_a_small_vocabulary_that_round_trips(tmp_path: Path) -> None:
    model, tokenizer = load_model_dir(create_model_dir(tmp_path, MODEL_PRESETS["digits"]))
    assert len(tokenizer) == model.config.vocab_size == 15
    ids = tokenizer("372=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4
    assert tokenizer.decode(ids) == "372="
    assert tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True) == "372="
    assert tokenizer.eos_token == IM_END
    assert tokenizer.decode(tokenizer("a7", add_special_tokens=False)["input_ids"]) == "<|unk|>7"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "5="}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")
    logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, 4, 15)


def test_a_model_directory_is_rebuilt_only_for_another_spec(tmp_path: Path) -> None:
    spec = MODEL_PRESETS["digits"]
    create_model_dir(tmp_path, spec)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"trained weights")  # stands for a directory someone changed
    create_model_dir(tmp_path, spec)
    assert weights.read_bytes() == b"trained weights"
    create_model_dir(tmp_path, TinyModelSpec(alphabet="01="))
    assert weights.read_bytes() != b"trained weights"
    assert json.loads((tmp_path / SPEC_FILE).read_text())["alphabet"] == "01="
    assert len(load_model_dir(tmp_path)[1]) == 7


@pytest.mark.parametrize("alphabet", ["", "00="])
def test_an_alphabet_needs_distinct_characters(alphabet: str) -> None:
    with pytest.raises(ModelSpecError):
        build_tokenizer(TinyModelSpec(alphabet=alphabet))


def test_digits_tasks_are_reproducible_and_fit_the_digits_vocabulary() -> None:
    tasks = make_tasks(50, seed=7, min_digits=1, max_digits=3)
    assert tasks == make_tasks(50, seed=7, min_digits=1, max_digits=3)
    assert tasks != make_tasks(50, seed=8, min_digits=1, max_digits=3)
    alphabet = set(MODEL_PRESETS["digits"].characters)
    for task in tasks:
        assert task["prompt"] == task["answer"] + "="
        assert 1 <= len(task["answer"]) <= 3
        assert set(task["prompt"]) <= alphabet
        assert task["max_tokens"] > len(task["answer"])
    assert {len(t["answer"]) for t in make_tasks(20, seed=0)} == {1}
    with pytest.raises(TaskSpecError):
        make_tasks(1, seed=0, min_digits=3, max_digits=2)
    for recipe in (DEMO, TEST):
        assert recipe.model_preset in MODEL_PRESETS
        assert recipe.max_tokens > recipe.max_digits
    assert TEST.answers <= 600 and DEMO.answers <= 4000


@pytest.mark.parametrize(
    ("answer", "reward"),
    [("372", 1.0), ("37", 0.5), ("3721", 0.75), ("972", 0.75), ("", 0.0), (None, 0.0)],
)
def test_the_digits_reward_gives_partial_credit(answer: str | None, reward: float) -> None:
    task = {"prompt": "372=", "answer": "372"}
    assert digits_reward(task, answer, None) == pytest.approx(reward)
    assert success(task, answer) == (answer == "372")


def test_the_digits_reward_stays_in_the_unit_interval() -> None:
    rng = random.Random(0)
    for task in make_tasks(200, seed=1, min_digits=1, max_digits=3):
        answer = "".join(rng.choice("0123456789=") for _ in range(rng.randint(0, 5)))
        assert 0.0 <= digits_reward(task, answer, None) <= 1.0
        assert digits_reward(task, task["answer"], None) == 1.0
