"""SWE-smith's procedural bug modifiers for Python source. Each finds the places in a
function it can change and makes one small textual edit there, so a bug's diff is the few
characters it changed: the file is never re-printed from its syntax tree."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """A file with one injected bug."""

    path: str  # relative to the repository root
    function: str  # qualified name of the function changed, e.g. "Ledger.post"
    modifier: str  # SWE-smith's modifier name, e.g. "func_pm_op_change"
    source: str  # the whole file, with the bug


@dataclass(frozen=True)
class _Edit:
    start: int  # character offsets into the file
    end: int
    text: str


FLIPPED: dict[type[ast.AST], tuple[type[ast.AST], str, str]] = {
    # operator type -> (flipped type, its text in source, the flipped text)
    ast.Eq: (ast.NotEq, r"==", "!="),
    ast.NotEq: (ast.Eq, r"!=", "=="),
    ast.Lt: (ast.GtE, r"<", ">="),
    ast.LtE: (ast.Gt, r"<=", ">"),
    ast.Gt: (ast.LtE, r">", "<="),
    ast.GtE: (ast.Lt, r">=", "<"),
    ast.In: (ast.NotIn, r"\bin\b", "not in"),
    ast.NotIn: (ast.In, r"\bnot\s+in\b", "in"),
    ast.Is: (ast.IsNot, r"\bis\b", "is not"),
    ast.IsNot: (ast.Is, r"\bis\s+not\b", "is"),
}
# Boundary slips: the comparison that includes (or excludes) its end.
BOUNDARY = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">"}
ARITHMETIC = {
    ast.Add: ("+", ["-"]),
    ast.Sub: ("-", ["+"]),
    ast.Mult: ("*", ["/"]),
    ast.Div: ("/", ["*", "//"]),
    ast.FloorDiv: ("//", ["/", "%"]),
    ast.Mod: ("%", ["//"]),
    ast.Pow: ("**", ["*"]),
}
_ATOMS = (ast.Name, ast.Constant, ast.Call, ast.Attribute, ast.Subscript, ast.List, ast.Tuple)


class _Source:
    """A file's text, with AST positions (UTF-8 byte columns) turned into offsets."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode()[:col].decode())

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (
            self.offset(node.lineno, node.col_offset),  # type: ignore[attr-defined]
            self.offset(node.end_lineno, node.end_col_offset),  # type: ignore[attr-defined]
        )

    def segment(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]

    def between(self, left: ast.AST, right: ast.AST, pattern: str, text: str) -> _Edit | None:
        """The operator `pattern` in the gap between two operands, replaced by `text`."""
        gap_start, gap_end = self.span(left)[1], self.span(right)[0]
        found = re.search(pattern, self.text[gap_start:gap_end])
        if found is None:
            return None
        return _Edit(gap_start + found.start(), gap_start + found.end(), text)

    def lines_of(self, first: ast.stmt, last: ast.stmt) -> tuple[int, int] | None:
        """The whole lines from `first` to `last`, when nothing else shares them."""
        start, end = self.span(first)[0], self.span(last)[1]
        line_start = self.starts[first.lineno - 1]
        line_end = self.starts[last.end_lineno]  # type: ignore[index]
        before, after = self.text[line_start:start], self.text[end:line_end]
        if before.strip() or (after.strip() and not after.strip().startswith("#")):
            return None
        return line_start, line_end

    def with_comments_above(self, stmt: ast.stmt, start: int) -> int:
        """`start` moved up over the comment lines right above a statement (its comment)."""
        lineno = stmt.lineno - 1
        while lineno >= 1 and self.lines[lineno - 1].lstrip().startswith("#"):
            lineno -= 1
        return min(start, self.starts[lineno])


def mutants(path: str, text: str) -> Iterator[Mutant]:
    """Every single-edit bug the modifiers can make in the functions of one file, in file
    order; each parses and differs from the original in its syntax tree."""
    tree = ast.parse(text)
    original = ast.dump(tree)
    source = _Source(text)
    for function, node in _functions(tree.body, ""):
        for modifier, find in MODIFIERS.items():
            for edits in find(source, node):
                changed = _apply(text, edits)
                try:
                    if ast.dump(ast.parse(changed)) == original:
                        continue
                except SyntaxError:
                    continue
                yield Mutant(path, function, modifier, changed)


def _functions(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, ast.FunctionDef]]:
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield from _functions(node.body, f"{prefix}{node.name}.")
        elif isinstance(node, ast.FunctionDef):
            yield f"{prefix}{node.name}", node


def _apply(text: str, edits: list[_Edit]) -> str:
    for edit in sorted(edits, key=lambda e: e.start, reverse=True):
        text = text[: edit.start] + edit.text + text[edit.end :]
    return text


def _nodes(function: ast.FunctionDef) -> Iterator[ast.AST]:
    for statement in function.body:
        yield from ast.walk(statement)


def _blocks(function: ast.FunctionDef) -> Iterator[list[ast.stmt]]:
    """Every list of statements in the function's body, nested ones included."""
    pending: list[list[ast.stmt]] = [function.body]
    while pending:
        block = pending.pop(0)
        yield block
        for statement in block:
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(statement, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    pending.append(inner)
            for handler in getattr(statement, "handlers", []):
                pending.append(handler.body)


def _pairs(node: ast.Compare) -> Iterator[tuple[ast.cmpop, ast.expr, ast.expr]]:
    operands = [node.left, *node.comparators]
    yield from zip(node.ops, operands, operands[1:], strict=False)


def flip_operators(source: _Source, function: ast.FunctionDef) -> Iterator[list[_Edit]]:
    """`<` for `>=`, `==` for `!=`, `in` for `not in`, `and` for `or`; a `not` dropped."""
    for node in _nodes(function):
        if isinstance(node, ast.Compare):
            for op, left, right in _pairs(node):
                _, pattern, text = FLIPPED[type(op)]
                edit = source.between(left, right, pattern, text)
                if edit is not None:
                    yield [edit]
        elif isinstance(node, ast.BoolOp):
            word, other = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            edits = [
                source.between(a, b, rf"\b{word}\b", other)
                for a, b in zip(node.values, node.values[1:], strict=False)
            ]
            if all(edits):
                yield [e for e in edits if e is not None]
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            start, operand_start = source.span(node)[0], source.span(node.operand)[0]
            yield [_Edit(start, operand_start, "")]


def change_operators(source: _Source, function: ast.FunctionDef) -> Iterator[list[_Edit]]:
    """An arithmetic operator for a kindred one; a comparison's boundary moved by one."""
    for node in _nodes(function):
        if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
            symbol, others = ARITHMETIC[type(node.op)]
            for other in others:
                edit = source.between(node.left, node.right, re.escape(symbol), other)
                if edit is not None:
                    yield [edit]
        elif isinstance(node, ast.AugAssign) and type(node.op) in ARITHMETIC:
            symbol, others = ARITHMETIC[type(node.op)]
            for other in others:
                edit = source.between(node.target, node.value, re.escape(symbol + "="), other + "=")
                if edit is not None:
                    yield [edit]
        elif isinstance(node, ast.Compare):
            for op, left, right in _pairs(node):
                if type(op) in BOUNDARY:
                    _, pattern, _ = FLIPPED[type(op)]
                    edit = source.between(left, right, pattern, BOUNDARY[type(op)])
                    if edit is not None:
                        yield [edit]


def swap_operands(source: _Source, function: ast.FunctionDef) -> Iterator[list[_Edit]]:
    """`a - b` as `b - a`; `x < y` as `y < x`."""
    for node in _nodes(function):
        if isinstance(node, ast.BinOp):
            pair = (node.left, node.right)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            pair = (node.left, node.comparators[0])
        else:
            continue
        left, right = (source.segment(side) for side in pair)
        if left == right:
            continue
        moved = [_grouped(text, side) for text, side in zip((right, left), pair[::-1], strict=True)]
        yield [_Edit(*source.span(pair[0]), moved[0]), _Edit(*source.span(pair[1]), moved[1])]


def _grouped(text: str, node: ast.AST) -> str:
    return text if isinstance(node, _ATOMS) else f"({text})"


def change_constants(source: _Source, function: ast.FunctionDef) -> Iterator[list[_Edit]]:
    """An integer constant off by one, either way (indexes, slices, limits, factors)."""
    for node in _nodes(function):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int)
            and not isinstance(node.value, bool)
        ):
            for value in (node.value - 1, node.value + 1):
                yield [_Edit(*source.span(node), str(value))]


def break_chains(source: _Source, function: ast.FunctionDef) -> Iterator[list[_Edit]]:
    """`a + b + c` cut to `a + c` or `a + b`: a term of a chain dropped."""
    for node in _nodes(function):
        if isinstance(node, ast.BinOp) and isinstance(node.left, ast.BinOp):
            start, end = source.span(node)
            first, middle = source.segment(node.left.left), source.segment(node.left)
            operator_gap = source.text[source.span(node.left)[1] : source.span(node.right)[0]]
            yield [_Edit(start, end, f"{first}{operator_gap}{source.segment(node.right)}")]
            yield [_Edit(start, end, middle)]


def _removals(
    source: _Source, function: ast.FunctionDef, kinds: tuple[type[ast.stmt], ...]
) -> Iterator[list[_Edit]]:
    for block in _blocks(function):
        if len(block) < 2:
            continue  # an empty block would not parse
        for statement in block:
            if not isinstance(statement, kinds) or getattr(statement, "orelse", None):
                continue
            lines = source.lines_of(statement, statement)
            if lines is not None:
                start = source.with_comments_above(statement, lines[0])
                yield [_Edit(start, lines[1], "")]


def remove_assignments(source: _Source, function: ast.FunctionDef) -> Iterator[list[_Edit]]:
    yield from _removals(source, function, (ast.Assign, ast.AugAssign, ast.AnnAssign))


def remove_conditionals(source: _Source, function: ast.FunctionDef) -> Iterator[list[_Edit]]:
    """An `if` without `else` dropped: a guard, a special case, an early return."""
    yield from _removals(source, function, (ast.If,))


def remove_loops(source: _Source, function: ast.FunctionDef) -> Iterator[list[_Edit]]:
    yield from _removals(source, function, (ast.For, ast.While))


def invert_if(source: _Source, function: ast.FunctionDef) -> Iterator[list[_Edit]]:
    """The bodies of an `if` and its `else` swapped, the condition kept."""
    for node in _nodes(function):
        if not isinstance(node, ast.If) or not node.orelse:
            continue
        else_line = source.lines[node.orelse[0].lineno - 1].lstrip()
        if else_line.startswith("elif"):
            continue
        body = source.lines_of(node.body[0], node.body[-1])
        orelse = source.lines_of(node.orelse[0], node.orelse[-1])
        if body is None or orelse is None or node.body[0].lineno == node.lineno:
            continue
        body_text, orelse_text = (source.text[a:b] for a, b in (body, orelse))
        yield [_Edit(*body, orelse_text), _Edit(*orelse, body_text)]


Finder = Callable[[_Source, ast.FunctionDef], Iterator[list[_Edit]]]
# SWE-smith's names (swesmith/bug_gen/procedural/base.py, CommonPMs), which its instance ids
# carry: "<repo>.<modifier>__<hash>".
MODIFIERS: dict[str, Finder] = {
    "func_pm_flip_operators": flip_operators,
    "func_pm_op_change": change_operators,
    "func_pm_op_swap": swap_operands,
    "func_pm_op_change_const": change_constants,
    "func_pm_op_break_chains": break_chains,
    "func_pm_remove_assign": remove_assignments,
    "func_pm_remove_cond": remove_conditionals,
    "func_pm_remove_loop": remove_loops,
    "func_pm_ctrl_invert_if": invert_if,
}
