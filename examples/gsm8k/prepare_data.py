"""GSM8K task files for DARL from the parquet files you already have (Hugging Face
`openai/gsm8k`, config `main`: columns `question` and `answer`, the answer ending in
`#### <number>`). Nothing is downloaded.

    python -m darl.examples.gsm8k.prepare_data \\
        --train gsm8k/main/train-00000-of-00001.parquet \\
        --test gsm8k/main/test-00000-of-00001.parquet --out .darl/data/gsm8k

writes `train.jsonl` and `test.jsonl`: a task per row with the question as written and the
ground truth extracted as verl's own preprocessing (`examples/data_preprocess/gsm8k.py`) does,
so the reward compares the same strings verl compares. The instruction to end with "####"
belongs to the agent's prompt, not to the task.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import pyarrow as pa
import pyarrow.parquet as pq
import typer

from darl.files import write_atomically

COLUMNS = ("question", "answer")
# verl's examples/data_preprocess/gsm8k.py: the first "#### <number>", commas dropped.
_GROUND_TRUTH = re.compile(r"#### (\-?[0-9\.\,]+)")


class GSM8KDataError(ValueError):
    """A GSM8K parquet file that is missing, unreadable or not GSM8K's schema."""


def ground_truth(answer: str) -> str:
    """The final number of a GSM8K worked answer, as verl extracts it ("1,600" -> "1600")."""
    found = _GROUND_TRUTH.search(answer)
    if found is None:
        raise GSM8KDataError(f"no '#### <number>' in the answer {answer[-80:]!r}")
    return found.group(1).replace(",", "")


def read_split(path: Path) -> pa.Table:
    """The `question` and `answer` columns of one GSM8K parquet file."""
    if not path.is_file():
        raise GSM8KDataError(
            f"{path} does not exist: give the parquet file of openai/gsm8k (config 'main') "
            "that you downloaded"
        )
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as err:
        raise GSM8KDataError(f"{path} is not a readable parquet file: {err}") from err
    missing = [c for c in COLUMNS if c not in schema.names]
    if missing:
        raise GSM8KDataError(
            f"{path} has no column {', '.join(map(repr, missing))} (it has "
            f"{', '.join(map(repr, schema.names))}); GSM8K's 'main' config has "
            f"{', '.join(map(repr, COLUMNS))}"
        )
    return pq.read_table(path, columns=list(COLUMNS))


def tasks(table: pa.Table, split: str) -> list[dict[str, Any]]:
    """DARL task rows (what `trainer/datasets.py` reads and the agent gets as DARL_TASK)."""
    rows = []
    for index, row in enumerate(table.to_pylist()):
        question, answer = row["question"], row["answer"]
        if not isinstance(question, str) or not isinstance(answer, str):
            raise GSM8KDataError(f"{split} row {index}: question and answer must be text")
        try:
            truth = ground_truth(answer)
        except GSM8KDataError as err:
            raise GSM8KDataError(f"{split} row {index}: {err}") from err
        rows.append(
            {
                "id": f"gsm8k-{split}-{index:05d}",
                "question": question,
                "ground_truth": truth,
                "split": split,
                "index": index,
            }
        )
    if not rows:
        raise GSM8KDataError(f"the {split} file has no rows")
    return rows


def write_tasks(rows: list[dict[str, Any]], path: Path) -> None:
    """JSON lines, written whole, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def prepare(train: Path, test: Path, out: Path) -> dict[str, int]:
    """Both splits read and checked before either is written; returns the rows per split."""
    splits = {"train": tasks(read_split(train), "train"), "test": tasks(read_split(test), "test")}
    for split, rows in splits.items():
        write_tasks(rows, out / f"{split}.jsonl")
    return {split: len(rows) for split, rows in splits.items()}


app = typer.Typer(add_completion=False)


@app.command()
def main(
    train: Annotated[Path, typer.Option(help="GSM8K train parquet (columns question, answer).")],
    test: Annotated[Path, typer.Option(help="GSM8K test parquet (validation tasks).")],
    out: Annotated[Path, typer.Option(help="Where train.jsonl and test.jsonl go.")] = Path(
        ".darl/data/gsm8k"
    ),
) -> None:
    """Write DARL's GSM8K task files from your local GSM8K parquet files."""
    try:
        counts = prepare(train, test, out)
    except GSM8KDataError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from err
    for split, count in counts.items():
        typer.echo(f"{out / f'{split}.jsonl'}: {count} tasks")


if __name__ == "__main__":
    app()
