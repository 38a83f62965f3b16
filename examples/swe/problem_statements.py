"""Issues as a user files them, written from a failing test: a REPL session that reproduces
it (the test's set-up and the call it failed on), what came back, and what was expected.
Only the test and its outcome are read, never the fix."""

from __future__ import annotations

import ast
import builtins
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# By what went wrong: a wrong value, an error raised, an error not raised.
TITLES = {
    "value": (
        "`{subject}` returns a wrong result",
        "Wrong result from `{subject}`",
        "`{subject}` gives unexpected output",
        "Unexpected value from `{subject}`",
    ),
    "error": (
        "`{subject}` raises `{error}`",
        "`{error}` from `{subject}`",
        "`{subject}` fails with `{error}`",
        "Unexpected `{error}` in `{subject}`",
    ),
    "message": (
        "Wrong error message from `{subject}`",
        "`{subject}` raises `{error}` with an unexpected message",
        "Misleading `{error}` message in `{subject}`",
        "`{error}` from `{subject}` has the wrong message",
    ),
    "no_error": (
        "`{subject}` does not raise `{error}`",
        "No `{error}` from `{subject}`",
        "`{subject}` accepts what it should reject",
        "`{subject}` should raise `{error}`",
    ),
}
INTROS = (
    "I ran into this with {package} {version}:",
    "Here is a small reproduction ({package} {version}):",
    "To reproduce ({package} {version}):",
    "Minimal example, on {package} {version}:",
)


@dataclass(frozen=True)
class Failure:
    """What the outcome plugin recorded for one failed test."""

    line: int | None
    error: str
    message: str  # its first line
    compared: list[str] | None  # [op, repr of the left value, repr of the right value]
    details: tuple[str, ...] = ()  # the message's next lines, stripped

    @classmethod
    def of(cls, record: dict[str, Any]) -> Failure:
        details = tuple(record.get("details", ()))
        return cls(
            record.get("line"), record["error"], record["message"], record.get("compared"), details
        )

    def detail(self, label: str) -> str | None:
        """A `label: 'value'` line of pytest's message, its value unquoted."""
        for line in self.details:
            if line.startswith(f"{label}: "):
                text = line.removeprefix(f"{label}: ")
                try:
                    return str(ast.literal_eval(text))
                except (ValueError, SyntaxError):
                    return text
        return None


@dataclass(frozen=True)
class _Shown:
    """The last REPL line and what follows it, and the sentence that closes the issue."""

    expression: str
    output: str | None
    closing: str
    kind: str  # a key of TITLES
    error: str = ""


def reproduction_lines(test_source: str, test_name: str, failure: Failure) -> int:
    """How long the reproduction of a failure is (a shorter one makes a better issue)."""
    return len(_session(test_source, test_name, failure)[0])


def problem_statement(
    test_source: str, test_name: str, failure: Failure, *, package: str, version: str, seed: int
) -> str:
    lines, subject, shown = _session(test_source, test_name, failure)
    titles = TITLES[shown.kind]
    title = titles[seed % len(titles)].format(subject=subject, error=shown.error)
    intro = INTROS[seed // len(titles) % len(INTROS)].format(package=package, version=version)
    session = "\n".join(lines)
    return f"{title}\n\n{intro}\n\n```python\n{session}\n```\n\n{shown.closing}\n"


def _session(test_source: str, test_name: str, failure: Failure) -> tuple[list[str], str, _Shown]:
    module = ast.parse(test_source)
    test = next(
        node
        for node in module.body
        if isinstance(node, ast.FunctionDef) and node.name == test_name.split("[")[0]
    )
    failing = next(
        (
            s
            for s in test.body
            if failure.line is not None and s.lineno <= failure.line <= (s.end_lineno or 0)
        ),
        test.body[-1],
    )
    set_up = [s for s in test.body[: test.body.index(failing)] if not isinstance(s, ast.Assert)]
    prompts = [line for s in set_up for line in _prompted(_text(test_source, s), s)]
    classes = _classes_of_variables(set_up)
    shown, called = _shown(test_source, failing, failure)
    if isinstance(failing, ast.With):
        prompts += [line for s in failing.body for line in _prompted(_text(test_source, s), s)]
    else:
        prompts += _prompted(shown.expression, None)
    if shown.output is not None:
        prompts.append(shown.output)
    # The call that failed, else the last one of the set-up (`parse(...)` before `.line`).
    subject = (
        _subject(called, classes)
        or _subject(set_up[::-1], classes)
        or _class_read(called, classes)
        or shown.expression
    )
    imports = _imports(module, "\n".join(prompts))
    return imports + prompts, subject, shown


def _shown(source: str, failing: ast.stmt, failure: Failure) -> tuple[_Shown, list[ast.AST]]:
    """The failing statement as the session's last line, its output and the closing
    sentence; and the nodes holding the call the user made."""
    raised = failure.error not in ("AssertionError", "Failed")
    traceback = f"Traceback (most recent call last):\n  ...\n{failure.error}: {failure.message}"
    if isinstance(failing, ast.With) and _is_raises(failing):
        error = _text(source, failing.items[0].context_expr.args[0])  # type: ignore[attr-defined]
        body: list[ast.AST] = list(failing.body)
        if raised:
            closing = f"I expected a `{error}` here, not a `{failure.error}`."
            return _Shown("", traceback, closing, "error", failure.error), body
        actual, pattern = failure.detail("Actual message"), failure.detail("Expected regex")
        if actual is not None and pattern is not None:
            closing = f"I expected the message to match `{pattern}`."
            wrong = f"Traceback (most recent call last):\n  ...\n{error}: {actual}"
            return _Shown("", wrong, closing, "message", error), body
        closing = f"I expected this to raise `{error}`, but no error is raised."
        return _Shown("", None, closing, "no_error", error), body
    if not isinstance(failing, ast.Assert):
        closing = "I expected this to work without an error."
        return _Shown(_text(source, failing), traceback, closing, "error", failure.error), [failing]
    test = failing.test
    compared = failure.compared
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq | ast.Is)
        and not (compared and compared[1] == compared[2])  # then `==` itself is wrong
    ):
        last: ast.expr = test.left
        expected = _expected(source, test.comparators[0])
        output = compared[1] if compared else None
    elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        last, expected = test.operand, "`False`"
        output = failure.message.removeprefix("assert not ")
    else:
        last, expected = test, "`True`"
        # pytest explains a failed comparison, not its value: a single one was False.
        output = (
            "False" if isinstance(test, ast.Compare) else failure.message.removeprefix("assert ")
        )
    if raised:
        closing = f"I expected {expected}, not an error."
        return _Shown(_text(source, last), traceback, closing, "error", failure.error), [last]
    return _Shown(_text(source, last), output, f"I expected {expected}.", "value"), [last]


def _expected(source: str, node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return f"it to equal `{node.id}`"
    return f"`{_value(source, node)}`"


def _value(source: str, node: ast.expr) -> str:
    """An expected value as the REPL would show it when it is a literal, else as written."""
    try:
        return repr(ast.literal_eval(node))
    except ValueError:
        return _text(source, node)


def _is_raises(node: ast.With) -> bool:
    call = node.items[0].context_expr
    return (
        isinstance(call, ast.Call) and ast.unparse(call.func) == "pytest.raises" and bool(call.args)
    )


def _classes_of_variables(set_up: list[ast.stmt]) -> dict[str, str]:
    """`book = Ledger()` -> {"book": "Ledger"}: so an issue names `Ledger.balance`."""
    classes = {}
    for statement in set_up:
        if (
            isinstance(statement, ast.Assign)
            and isinstance(statement.value, ast.Call)
            and isinstance(statement.value.func, ast.Name | ast.Attribute)
        ):
            function = statement.value.func
            owner = function.id if isinstance(function, ast.Name) else ast.unparse(function.value)
            if owner[:1].isupper():
                for target in statement.targets:
                    if isinstance(target, ast.Name):
                        classes[target.id] = owner
    return classes


def _subject(nodes: Sequence[ast.AST], classes: dict[str, str]) -> str | None:
    """The API the user called, as they would name it: `slugify`, `Money.parse`,
    `Interval.overlaps`, `Ledger.balance` (for `book.balance`), `Interval.length`."""
    for node in (n for root in nodes for n in ast.walk(root)):
        owner = node.value if isinstance(node, ast.Attribute) else None
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name):
            return f"{owner.func.id}.{node.attr}"  # type: ignore[attr-defined]  # a property
        if not isinstance(node, ast.Call) or ast.unparse(node.func).startswith("pytest."):
            continue
        function = node.func
        if isinstance(function, ast.Name) and not hasattr(builtins, function.id):
            return function.id
        if isinstance(function, ast.Attribute):
            owner = function.value
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name):
                return f"{owner.func.id}.{function.attr}"
            if isinstance(owner, ast.Name):
                return f"{classes.get(owner.id, owner.id)}.{function.attr}"
            return function.attr
    return None


def _class_read(nodes: Sequence[ast.AST], classes: dict[str, str]) -> str | None:
    """The class of a variable the nodes read (`list(numbers)` -> `IntervalSet`)."""
    for node in (n for root in nodes for n in ast.walk(root)):
        if isinstance(node, ast.Name) and node.id in classes:
            return classes[node.id]
    return None


def _text(source: str, node: ast.AST) -> str:
    """A node's source, dedented when it spans lines."""
    segment = ast.get_source_segment(source, node, padded=True) or ""
    return textwrap.dedent(segment).strip()


def _prompted(text: str, statement: ast.stmt | None) -> list[str]:
    lines = text.splitlines()
    prompted = [f">>> {lines[0]}", *(f"... {line}" for line in lines[1:])]
    if isinstance(statement, ast.With | ast.For | ast.If | ast.While):
        prompted.append("...")
    return prompted


def _imports(module: ast.Module, session: str) -> list[str]:
    """The test module's imports of the names the session uses, each name once."""
    used = {n.id for n in ast.walk(_parsed(session)) if isinstance(n, ast.Name)}
    lines = []
    for node in module.body:
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names if (a.asname or a.name) in used]
            if names:
                lines.append(f">>> from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            lines += [f">>> import {a.name}" for a in node.names if a.name in used]
    return lines


def _parsed(session: str) -> ast.Module:
    code = [line[4:] for line in session.splitlines() if line.startswith((">>> ", "... "))]
    return ast.parse("\n".join(code))
