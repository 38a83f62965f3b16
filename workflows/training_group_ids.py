"""The ids a training run gives its groups and rollouts, and what an id says back: a train
group is `<run>.e<epoch>.t<position>`, a step's validation `<run>.v<step>` with a group
`<run>.v<step>.t<position>` for each of its tasks, and a rollout its group's id and `.<k>`."""

from __future__ import annotations

POSITION_MARK = ".t"


def train_group_id(run_id: str, epoch: int, position: int) -> str:
    return f"{run_id}.e{epoch}{POSITION_MARK}{position}"


def validation_id(run_id: str, step: int) -> str:
    return f"{run_id}.v{step}"


def validation_group_id(validation: str, position: int) -> str:
    return f"{validation}{POSITION_MARK}{position}"


def rollout_id(group_id: str, k: int) -> str:
    return f"{group_id}.{k}"


def closed_group(group_id: str, *, run_id: str, epoch: int, cursor: int, step: int) -> bool:
    """Whether run `run_id`, at dataset place (`epoch`, `cursor`) and step `step`, opened
    `group_id` and has closed it since (trained, dropped or validated), read off the id: a
    train group's place in the dataset is behind the cursor, a validation group's step is
    done."""
    prefix = f"{run_id}."
    if not group_id.startswith(prefix):
        return False
    where, mark, position = group_id[len(prefix) :].partition(POSITION_MARK)
    kind, number = where[:1], where[1:]
    if not (mark and position.isdigit() and number.isdigit()):
        return False
    if kind == "e":
        return (int(number), int(position)) < (epoch, cursor)
    return kind == "v" and int(number) <= step
