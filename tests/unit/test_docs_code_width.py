"""Every line of a fenced code block in the docs fits the page: a line over `MAX_WIDTH` characters
makes the reader scroll sideways (Material draws code blocks ~100 characters wide on a laptop).

Files included by `--8<--` snippets (pymdownx.snippets, read from the repository root) count as
the page: included inside a fence, each of their lines is a code line; included as Markdown, their
own fences count. Mermaid blocks are drawn, not shown as text, so they are exempt."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_WIDTH = 100

# `--8<-- "path"`, `--8<-- "path:start"`, `--8<-- "path:start:end"` on a line of its own.
SNIPPET = re.compile(r'^(?P<indent>\s*)--8<--\s+"(?P<spec>[^"]+)"\s*$')
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
EXEMPT = {"mermaid"}
# Files whose wide lines are still to wrap, and how many each has: a new wide line fails, and so
# does a count that is now too high (lower it). Each is outside docs/, but for the tutorial's
# agent command, which test_tutorial runs and so must stay one `$ ` line. The SWE rollouts' long
# lines are one JSON string each (a task's problem statement): their page would include a range.
STILL_WIDE: dict[str, int] = {
    "deploy/k8s/examples/swe/job-template.yaml": 1,
    "docs/tutorials/your-own-agent.md": 1,
    "examples/agents_sdk_calculator/rollout.json": 1,
    "examples/gsm8k/README.md": 4,
    "examples/swe/mini.yaml": 1,
    "examples/swe/rollout-mini.json": 4,
    "examples/swe/rollout.json": 3,
    "examples/swe/train-gpu.yaml": 1,
}


@dataclass(frozen=True)
class Line:
    """A line of a page as MkDocs renders it, and where it comes from."""

    text: str
    path: Path
    number: int
    # For a line of an included file: the page's line that included it.
    via: str | None = None


def _included(spec: str, root: Path) -> tuple[Path, int, int | None]:
    """The file a snippet names and its 1-based line range (end inclusive, None: to the end)."""
    path, _, lines = spec.partition(":")
    start, _, end = lines.partition(":")
    return root / path, int(start) if start else 1, int(end) if end else None


def expanded(path: Path, root: Path, indent: str = "", depth: int = 0) -> list[Line]:
    """The lines of `path` with each snippet replaced by the file it names, as pymdownx.snippets
    does (the snippet line's indentation kept); a file that does not exist fails the build
    elsewhere, so it is left out here."""
    if depth > 8 or not path.is_file():
        return []
    out: list[Line] = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        snippet = SNIPPET.match(text)
        if snippet is None:
            out.append(Line(indent + text, path, number))
            continue
        included, start, end = _included(snippet["spec"], root)
        via = f"{_shown(path, root)}:{number}"
        lines = expanded(included, root, indent + snippet["indent"], depth + 1)
        out.extend(
            Line(line.text, line.path, line.number, line.via or via)
            for line in lines
            if _within(line, included, start, end)
        )
    return out


def _within(line: Line, included: Path, start: int, end: int | None) -> bool:
    if line.path != included:
        return True  # a line of a file the included one includes in turn
    return line.number >= start and (end is None or line.number <= end)


def wide_code_lines(page: Path, root: Path, width: int = MAX_WIDTH) -> list[str]:
    """`path:line: N characters` for each code line of `page` wider than `width`, counted
    without the indentation of its fence (a code block in a list is drawn without it)."""
    found: list[str] = []
    fence: re.Match[str] | None = None
    for line in expanded(page, root):
        opened = FENCE.match(line.text)
        if fence is None:
            if opened is not None:
                fence = opened
            continue
        if (
            opened is not None
            and not opened["info"].strip()
            and opened["fence"][0] == fence["fence"][0]
            and len(opened["fence"]) >= len(fence["fence"])
        ):
            fence = None
            continue
        info = fence["info"].strip().split()
        if info and info[0] in EXEMPT:
            continue
        indent = len(fence["indent"])
        text = line.text[indent:] if line.text[:indent].isspace() else line.text.lstrip()
        if len(text) > width:
            where = f"{_shown(line.path, root)}:{line.number}: {len(text)} characters"
            found.append(where if line.via is None else f"{where} (included by {line.via})")
    return found


def _shown(path: Path, root: Path) -> str:
    return str(path.relative_to(root) if path.is_relative_to(root) else path)


def test_a_wide_line_in_a_block_or_an_included_file_is_found(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    wide = "x" * (MAX_WIDTH + 1)
    (tmp_path / "example.yaml").write_text(f"key: value\nwide: {wide}\n")
    (tmp_path / "README.md").write_text(f"# An example\n\n```bash\necho {wide}\n```\n")
    (docs / "page.md").write_text(
        f"A prose line may be as long as it likes: {wide}\n\n"
        f"```python\nfits = 1\ntoo_wide = '{wide}'\n```\n\n"
        "```mermaid\n" + f"flowchart LR\n    a[{wide}] --> b\n" + "```\n\n"
        '- a list item\n\n    ```yaml\n    --8<-- "example.yaml"\n    ```\n\n'
        '--8<-- "README.md"\n\n'
        '```yaml\n--8<-- "example.yaml:1:1"\n```\n'
        f"````markdown\n```\n{wide}\n````\n"
    )
    assert wide_code_lines(docs / "page.md", tmp_path) == [
        f"docs/page.md:5: {len(wide) + 13} characters",
        f"example.yaml:2: {len(wide) + 6} characters (included by docs/page.md:16)",
        f"README.md:4: {len(wide) + 5} characters (included by docs/page.md:19)",
        f"docs/page.md:26: {len(wide)} characters",
    ]


def test_no_code_line_in_the_docs_is_wider_than_the_page() -> None:
    wide = [
        line
        for page in sorted((REPO / "docs").rglob("*.md"))
        for line in wide_code_lines(page, REPO)
    ]
    # Each finding starts with its file's path.
    counted = Counter(found.split(":", 1)[0] for found in wide)
    left = [
        found
        for found in wide
        if counted[found.split(":", 1)[0]] > STILL_WIDE.get(found.split(":", 1)[0], 0)
    ]
    assert not left, (
        f"code lines over {MAX_WIDTH} characters (wrap them, or shorten a comment):\n"
        + "\n".join(left)
    )
    narrower = {path: n for path, n in STILL_WIDE.items() if counted.get(path, 0) < n}
    assert not narrower, f"fewer wide lines now: lower (or drop) STILL_WIDE's {narrower}"
