"""The calculator both agents use, as a Temporal activity: a tool that runs on the worker, so a
workflow that calls it keeps its result in its history (Temporal's "tools as activities")."""

from __future__ import annotations

import operator
from typing import Literal

from temporalio import activity

Operation = Literal["add", "sub", "mul"]
OPERATIONS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}


@activity.defn
async def calculator(a: int, b: int, op: Operation) -> str:
    """Compute `a op b` on two integers.

    Args:
        a: the number on the left.
        b: the number on the right.
        op: add, sub or mul.
    """
    return str(OPERATIONS[op](a, b))
