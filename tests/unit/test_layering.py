"""The layering of docs/architecture.md is checked, not just written: every import of every
module of DARL's folders must be an arrow its "may import" column allows, and inside the gateway
nothing below `app.py` imports the app or a route (the package reads top-down)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
ROW = re.compile(r"^\| `(?P<folder>[a-z]+)/` \|.*\| (?P<may>[^|]*) \|$")


def allowed_arrows(text: str) -> dict[str, set[str]]:
    """Folder -> the folders its row's "may import" column names (in backticks)."""
    table: dict[str, set[str]] = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            table[match["folder"]] = set(re.findall(r"`([a-z]+)`", match["may"]))
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
    }
    assert folders | {"examples"} <= set(table), table
    assert table["workflows"] == set()
    assert table["files"] == set()


def test_every_import_is_an_arrow_the_table_allows() -> None:
    table = allowed_arrows(ARCHITECTURE.read_text())
    assert forbidden_arrows(ROOT, table) == []


def test_the_gateway_reads_top_down() -> None:
    assert gateway_upward_imports(ROOT) == []


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
