"""The layering of docs/architecture.md is checked, not just written: every import of every
module of DARL's folders must be an arrow its "may import" column allows, inside the gateway
nothing below `app.py` imports the app or a route (the package reads top-down), no modules
import each other in a circle (at any depth: a circle hidden in a function is still one), and
no module of the code's folders grows past 450 lines (one idea per file)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# The folders of DARL's code, held to one idea per file (not examples/, nor files/).
CODE_FOLDERS = [
    "workflows",
    "activities",
    "gateway",
    "trainer",
    "deploy",
    "serving",
    "viewer",
    "temporal_agents",
]
MAX_LINES = 450
ROW = re.compile(r"^\| `(?P<folder>[a-z_]+)/` \|.*\| (?P<may>[^|]*) \|$")


def allowed_arrows(text: str) -> dict[str, set[str]]:
    """Folder -> the folders its row's "may import" column names (in backticks)."""
    table: dict[str, set[str]] = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            table[match["folder"]] = set(re.findall(r"`([a-z_]+)`", match["may"]))
    return table


def imports_of(path: Path) -> Iterator[tuple[int, str]]:
    """Every module a file imports, at any depth (in functions, under TYPE_CHECKING)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def forbidden_arrows(root: Path, table: dict[str, set[str]]) -> list[str]:
    found = []
    for folder, may in sorted(table.items()):
        for path in sorted((root / folder).rglob("*.py")):
            for line, module in imports_of(path):
                parts = module.split(".")
                if parts[0] != "darl" or len(parts) < 2 or parts[1] in (folder, *may):
                    continue
                where = path.relative_to(root)
                found.append(f"{where}:{line} imports darl.{parts[1]} ({folder}/ may not)")
    return sorted(set(found))


def gateway_upward_imports(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "gateway").rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name == "gateway/app.py" or name.startswith("gateway/routes/"):
            continue
        for line, module in imports_of(path):
            if module == "darl.gateway.app" or module.startswith("darl.gateway.routes"):
                found.append(f"{name}:{line} imports {module}")
    return found


def module_graph(root: Path, folders: Iterable[str]) -> dict[str, set[str]]:
    """`darl.<folder>.<module>` -> the modules of the same tree it imports (`from a import b`
    counts as importing `a.b` when that is a module, else `a`)."""
    modules = {}
    for folder in folders:
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(("darl", *parts[: -1 if parts[-1] == "__init__" else None]))
            modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for module in targets:
                while module and module not in modules:
                    module = module.rpartition(".")[0]
                if module:
                    graph[name].add(module)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one importing itself
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = stack[stack.index(node) :]
                    del stack[stack.index(node) :]
                    if len(component) > 1 or node in graph[node]:
                        circles.append(sorted(component))
    return circles


def test_the_table_names_every_folder() -> None:
    table = allowed_arrows(ARCHITECTURE.read_text())
    folders = {
        "workflows",
        "activities",
        "gateway",
        "serving",
        "trainer",
        "viewer",
        "deploy",
        "files",
        "temporal_agents",
    }
    assert folders | {"examples"} <= set(table), table
    assert table["workflows"] == set()
    assert table["files"] == set()
    assert table["temporal_agents"] == {"workflows"}


def test_the_plugin_for_workflow_agents_imports_only_names_of_darl() -> None:
    """darl.temporal_agents runs on a user's worker in a venv without DARL's dependencies: of
    DARL, only `darl.workflows.names` (constants, no pydantic models) may be imported."""
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / "temporal_agents").rglob("*.py"))
        for line, module in imports_of(path)
        if module.startswith("darl.workflows") and not module.startswith("darl.workflows.names")
    ]
    assert found == []


def test_every_import_is_an_arrow_the_table_allows() -> None:
    table = allowed_arrows(ARCHITECTURE.read_text())
    assert forbidden_arrows(ROOT, table) == []


def test_the_gateway_reads_top_down() -> None:
    assert gateway_upward_imports(ROOT) == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    folders = allowed_arrows(ARCHITECTURE.read_text())
    assert import_circles(module_graph(ROOT, folders)) == []


def test_no_module_of_the_code_is_over_450_lines() -> None:
    long = {
        path.relative_to(ROOT).as_posix(): lines
        for folder in CODE_FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_a_planted_circle_is_found(tmp_path: Path) -> None:
    """Two modules that import each other, one of them only inside a function, and a third
    that imports one of them without being imported back."""
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "stream.py").write_text("from darl.gateway.translation import T\n")
    (tmp_path / "gateway" / "translation.py").write_text(
        "def f():\n    from darl.gateway import stream\n"
    )
    (tmp_path / "gateway" / "app.py").write_text("import darl.gateway.stream\n")
    graph = module_graph(tmp_path, ["gateway"])
    assert graph["darl.gateway.app"] == {"darl.gateway.stream"}
    assert import_circles(graph) == [["darl.gateway.stream", "darl.gateway.translation"]]


def test_a_planted_arrow_is_found(tmp_path: Path) -> None:
    """The check fails on an import the table does not allow (a copy of two folders, one of
    them given a new arrow)."""
    for folder in ("workflows", "gateway"):
        (tmp_path / folder).mkdir()
    (tmp_path / "workflows" / "names.py").write_text("from darl.gateway.errors import APIError\n")
    (tmp_path / "gateway" / "errors.py").write_text("import darl.workflows.errors\n")
    table = {"workflows": set(), "gateway": {"workflows"}}
    assert forbidden_arrows(tmp_path, table) == [
        "workflows/names.py:1 imports darl.gateway (workflows/ may not)"
    ]
    (tmp_path / "gateway" / "calls.py").write_text("def f():\n    from darl.gateway.app import x\n")
    assert gateway_upward_imports(tmp_path) == ["gateway/calls.py:2 imports darl.gateway.app"]
