"""Canary tests: proof, in every grading, that the test outcomes are honest.

The code under test runs in the pytest process that records the outcomes, so it can write
any record. Before the run the grader plants, in every listed test file that can hold them,
two tests drawn fresh for this grading (names made like that file's listed tests, bodies
from random values, each put between the file's own tests at a random place): one that must
pass and one that must fail. A run that records a failing one as passed, or does not record
a passing one as passed, was tampered with (or cut short), and grades 0 whatever it recorded
of the listed tests. So tampering that spares a file, a place in the run or a time spares
the canaries there too.

Only a tamperer that tells the canaries from the listed tests escapes them: the listed tests
are hidden from the agent (`GraderSpec.hidden_fields`) and the canaries look like tests of
the same file, referring to what the file imports.
"""

from __future__ import annotations

import ast
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path

# Words the canaries' names are made with, as a test's name reads.
_WORDS = (
    "basic empty nested single default custom invalid missing extra large unicode negative "
    "zero order repeated quoted escaped trailing simple mixed partial reverse sorted cached "
    "strict explicit inline blank long upper mapping value key items pairs range "
    "limit prefix suffix header record field option flag path name text"
)
WORDS = tuple(_WORDS.split())
PARAMETRIZED = re.compile(r"\[.*\]$")


@dataclass(frozen=True)
class Canaries:
    """The two canaries planted in `file` (relative to the tree), by node id."""

    file: str
    must_pass: str
    must_fail: str


def plant(tree: Path, tests: list[str], rng: random.Random | None = None) -> list[Canaries]:
    """Plant a pair of canaries in each listed test file of `tree` that can hold them (a
    Python module with no module-wide marks, which would apply to them too), or in a new
    file beside the first listed one when none can."""
    rng = rng or random.SystemRandom()
    by_file: dict[str, list[str]] = {}
    for test in tests:
        path, _, name = test.partition("::")
        by_file.setdefault(path, []).append(PARAMETRIZED.sub("", name.rsplit("::", 1)[-1]))
    hosts = [f for f in by_file if f.endswith(".py") and _can_host(tree / f)]
    if not hosts:
        first = next(iter(by_file))
        folder = first.rpartition("/")[0]
        new = f"{folder}/" if folder else ""
        new += f"test_{rng.choice(WORDS)}_{rng.choice(WORDS)}_{rng.randrange(10**6)}.py"
        (tree / new).parent.mkdir(parents=True, exist_ok=True)
        (tree / new).write_text("", encoding="utf-8")
        by_file[new], hosts = by_file[first], [new]
    return [_plant_in(tree, file, by_file[file], rng) for file in hosts]


def _plant_in(tree: Path, file: str, models: list[str], rng: random.Random) -> Canaries:
    source = (tree / file).read_text(encoding="utf-8")
    module = ast.parse(source)
    taken = set(re.findall(r"\b\w+\b", source))
    names = []
    for _ in range(2):
        name = _name_like(rng.choice(models), rng, taken)
        taken.add(name)
        names.append(name)
    reference = _imported_name(module, rng)
    lines = source.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    planted = [
        (rng.choice(_places(module, len(lines))), _function(name, rng, reference, passes))
        for name, passes in zip(names, (True, False), strict=True)
    ]
    # From the last place up, so an earlier place's line number still holds.
    for place, function in sorted(planted, key=lambda p: p[0], reverse=True):
        lines[place:place] = ["\n", "\n", *function.splitlines(keepends=True), "\n"]
    (tree / file).write_text("".join(lines), encoding="utf-8")
    return Canaries(file, f"{file}::{names[0]}", f"{file}::{names[1]}")


def _places(module: ast.Module, lines: int) -> list[int]:
    """Where a canary may go (after that many lines): after any top-level statement past the
    module's opening (its docstring and imports, which the canaries may use), or its end."""
    body = module.body
    first = 0
    while first < len(body) and _opening(body[first]):
        first += 1
    places = [stmt.end_lineno or 0 for stmt in body[max(first - 1, 0) :]]
    return places or [lines]


def _can_host(path: Path) -> bool:
    """A readable Python test module whose canaries would run as plain tests: no module-wide
    `pytestmark` (a skip, an xfail or a parametrize would apply to them too)."""
    try:
        module = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return False
    for node in module.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            return False
    return True


def _name_like(model: str, rng: random.Random, taken: set[str]) -> str:
    """A new name made like `model` (a listed test's function name): a word inserted before
    its last part, so a `test_` prefix and a `_test` suffix both stay."""
    head, sep, tail = model.rpartition("_")
    while True:
        word = rng.choice(WORDS)
        name = f"{head}_{word}{sep}{tail}" if head else f"{model}_{word}"
        if name not in taken:
            return name


def _opening(stmt: ast.stmt) -> bool:
    """An import, or a docstring."""
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return True
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)


def _imported_name(module: ast.Module, rng: random.Random) -> str | None:
    """A name the module imports at its top (what its tests use), if any but pytest."""
    names = []
    for node in module.body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            names += [a.asname or a.name for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            names += [(a.asname or a.name).split(".")[0] for a in node.names]
    names = [n for n in names if n != "pytest" and n.isidentifier()]
    return rng.choice(names) if names else None


def _function(name: str, rng: random.Random, reference: str | None, passes: bool) -> str:
    expression, value = _computation(rng)
    expected = value if passes else _wrong(value, rng)
    lines = [f"def {name}():"]
    if reference is not None:
        lines.append(f"    assert {reference} is not None")
    lines.append(f"    result = {expression}")
    lines.append(f"    assert result == {expected!r}")
    return "\n".join(lines) + "\n"


def _computation(rng: random.Random) -> tuple[str, object]:
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        return f"{a} + {b}", a + b
    if kind == 1:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return f"{a} * {b}", a * b
    if kind == 2:
        items = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
        return f"sorted({items!r})", sorted(items)
    if kind == 3:
        items = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
        return f"max({items!r})", max(items)
    if kind == 4:
        parts = [_word(rng) for _ in range(rng.randint(2, 4))]
        separator = rng.choice(["-", ", ", "/", "."])
        return f"{separator!r}.join({parts!r})", separator.join(parts)
    if kind == 5:
        word = _word(rng)
        return f"len({word!r})", len(word)
    word = _word(rng)
    return f"{word!r}.upper()", word.upper()


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9)))


def _wrong(value: object, rng: random.Random) -> object:
    if isinstance(value, int):
        return value + rng.randint(1, 9)
    if isinstance(value, list):
        return [*value, rng.randint(0, 99)]
    return str(value).lower() + rng.choice(string.ascii_lowercase)
