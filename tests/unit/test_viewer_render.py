"""What the viewer draws from a rollout's records: token text only as the model that served the
calls decodes it (a digits call and a tiny-model prompt, each against the other's tokenizer),
and charts whose axis labels stand clear of the data."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from darl.gateway.store.record import CallRecord
from darl.serving.tiny_model import MODEL_PRESETS, create_model_dir
from darl.viewer.charts import CURVES, LEFT, chart
from darl.viewer.render import ids_text
from darl.viewer.trajectory import TokenText
from darl.workflows.contracts import HttpAgentSpec
from darl.workflows.training_config import (
    BackendSpec,
    DatasetSpec,
    RolloutSettings,
    TrainingConfig,
    WeightSyncSettings,
)
from tests.unit.test_training_cli import record as step_record


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: create_model_dir(root / name, MODEL_PRESETS[name]) for name in ("tiny", "digits")}


def tokenizer_of(model_dir: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(model_dir)


def call(model_dir: Path, prompt: str, completion: str) -> CallRecord:
    """A call as that model's policy server answers it: ids and the token strings it returns."""
    tokenizer = tokenizer_of(model_dir)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    content = [{"token": tokenizer.decode([i]), "logprob": -0.5} for i in ids]
    return CallRecord(
        call_id="c",
        rollout_id="r",
        attempt=1,
        sequence=0,
        endpoint="chat.completions",
        upstream="http://policy",
        policy_version=0,
        created_at=0.0,
        latency_ms=1.0,
        retry_count=0,
        streamed=False,
        request={"messages": [{"role": "user", "content": prompt}]},
        response={
            "choices": [{"index": 0, "token_ids": ids, "logprobs": {"content": content}}],
            "prompt_token_ids": prompt_ids,
        },
        prompt_token_ids=prompt_ids,
    )


def config_with(model_dir: Path) -> TrainingConfig:
    return TrainingConfig(
        run_id="r",
        dataset=DatasetSpec(path="tasks.jsonl"),
        rollout=RolloutSettings(agent=HttpAgentSpec(url="http://a")),
        backend=BackendSpec(model_dir=str(model_dir)),
        weight_sync=WeightSyncSettings(gateway_admin_url="http://g", policy_servers=["http://p"]),
    )


def served_by(model_dir: Path, ids: list[int]) -> dict[int, str]:
    """What that model's policy server's /detokenize answers, id by id."""
    tokenizer = tokenizer_of(model_dir)
    return {i: tokenizer.decode([i]) for i in ids}


def test_a_tiny_model_prompt_reads_as_its_own_tokenizer_decodes_it(
    models: dict[str, Path],
) -> None:
    record = call(models["tiny"], "object properties, assistant", "ok")
    ids = [*record.prompt_token_ids, *record.completion_token_ids()]
    # The run's model directory is the digits model's (another model): it does not decode
    # the completion as the server did, so it is not used; the server that answered is.
    tokens = TokenText([record], served_by(models["tiny"], ids), config_with(models["digits"]))
    assert tokens.source == "the policy server that answered the calls"
    assert ids_text(record.prompt_token_ids, tokens) == "object properties, assistant"
    # Without the server (gone), the wrong tokenizer is still refused: a prompt token shows
    # its id, unless the server returned its text with the completion (then that text).
    alone = TokenText([record], None, config_with(models["digits"]))
    assert alone.source is None
    tiny = tokenizer_of(models["tiny"])
    answered = set(record.completion_token_ids())
    assert ids_text(record.prompt_token_ids, alone) == "".join(
        tiny.decode([i]) if i in answered else f"⟨{i}⟩" for i in record.prompt_token_ids
    )
    assert ids_text(record.completion_token_ids(), alone) == "ok"


def test_a_digits_call_reads_as_the_digits_model_decodes_it(models: dict[str, Path]) -> None:
    record = call(models["digits"], "5=", "5")
    tokens = TokenText([record], None, config_with(models["digits"]))
    assert tokens.source is not None and "model directory" in tokens.source
    assert ids_text(record.completion_token_ids(), tokens) == "5"
    assert ids_text(record.prompt_token_ids, tokens) == "5="
    # The tiny model's tokenizer reads the completion's digit alike but "=" as "a": it does
    # not read the prompt the agent sent, so it is refused.
    wrong = TokenText([record], served_by(models["tiny"], record.prompt_token_ids), None)
    assert wrong.source is None
    assert ids_text(record.prompt_token_ids, wrong) == "5⟨11⟩"


def test_chart_labels_stand_left_of_the_data() -> None:
    # Values wide enough that a label at the plot's edge would run into the data.
    records = [step_record(s).model_copy(update={"reward_mean": 1234.5 * s}) for s in range(1, 6)]
    svg = str(chart(CURVES[0], records))
    xs = [float(x) for x in re.findall(r'<circle class="pt" cx="([\d.]+)"', svg)]
    assert xs and min(xs) >= LEFT
    labels = re.findall(r'<text x="([\d.]+)" y="[\d.]+" class="axis" text-anchor="end">', svg)
    assert [float(x) for x in labels[1:]] == [LEFT - 6, LEFT - 6]
