"""Canary tests: proof, in every grading, that the test outcomes are honest.

The code under test runs in the pytest process that records the outcomes, so it can write
any record. Before the run the grader plants two tests drawn fresh for this grading (names
made like the listed tests' own, bodies from random values) in one of the listed test files:
one that must pass and one that must fail. A run that records the failing one as passed, or
does not record the passing one as passed, was tampered with (or cut short), and grades 0
whatever it recorded of the listed tests. The canaries run last (their file is last on the
command line, and they are at its end), so tampering done by any test before them meets them.

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
_PARAMETRIZED = re.compile(r"\[.*\]$")


@dataclass(frozen=True)
class Canaries:
    """The two canaries planted in `file` (relative to the tree), by node id."""

    file: str
    must_pass: str
    must_fail: str


def plant(tree: Path, tests: list[str], rng: random.Random | None = None) -> Canaries:
    """Append the two canaries to one of the listed tests' Python files in `tree` (one with
    no module-wide marks, which would apply to them too), or to a new file beside the first
    listed one when there is none."""
    rng = rng or random.SystemRandom()
    by_file: dict[str, list[str]] = {}
    for test in tests:
        path, _, name = test.partition("::")
        by_file.setdefault(path, []).append(_PARAMETRIZED.sub("", name.rsplit("::", 1)[-1]))
    hosts = [f for f in by_file if f.endswith(".py") and _can_host(tree / f)]
    if hosts:
        file = rng.choice(sorted(hosts))
        source = (tree / file).read_text(encoding="utf-8")
    else:
        first = next(iter(by_file))
        folder = first.rpartition("/")[0]
        file = f"{folder}/" if folder else ""
        file += f"test_{rng.choice(WORDS)}_{rng.choice(WORDS)}_{rng.randrange(10**6)}.py"
        source = ""
    taken = set(re.findall(r"\b\w+\b", source))
    names = []
    for _ in range(2):
        name = _name_like(rng.choice(by_file.get(file) or ["test_it"]), rng, taken)
        taken.add(name)
        names.append(name)
    reference = _imported_name(source, rng)
    body = [_function(names[0], rng, reference, passes=True)]
    body.append(_function(names[1], rng, reference, passes=False))
    separator = "" if not source or source.endswith("\n") else "\n"
    text = source + separator + "".join(f"\n\n{f}" for f in body)
    (tree / file).parent.mkdir(parents=True, exist_ok=True)
    (tree / file).write_text(text, encoding="utf-8")
    return Canaries(file, f"{file}::{names[0]}", f"{file}::{names[1]}")


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


def _imported_name(source: str, rng: random.Random) -> str | None:
    """A name the module imports at its top (what its tests use), if any but pytest."""
    try:
        module = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
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
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        return f"{a} + {b}", a + b
    if kind == 1:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return f"{a} * {b}", a * b
    if kind == 2:
        items = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
        return f"sorted({items!r})", sorted(items)
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 9)))
    return f"{word!r}.upper()", word.upper()


def _wrong(value: object, rng: random.Random) -> object:
    if isinstance(value, int):
        return value + rng.randint(1, 9)
    if isinstance(value, list):
        return [*value, rng.randint(0, 99)]
    return str(value).lower() + rng.choice(string.ascii_lowercase)
