"""The docs site's nav: it names every page under docs/ exactly once, and every page it names
exists. `mkdocs build --strict` refuses a page left out of the nav, but not one named twice,
and it runs only in `make test`; this says which page is wrong, in a second."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


class _ConfigLoader(yaml.SafeLoader):
    """A safe loader that reads mkdocs.yml's Python tags as plain values, importing nothing."""


def _tag_as_text(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> str:
    return suffix


def _relative(loader: yaml.SafeLoader, node: yaml.Node) -> str:
    assert isinstance(node, yaml.ScalarNode)
    return str(loader.construct_scalar(node))


_ConfigLoader.add_multi_constructor("tag:yaml.org,2002:python/name:", _tag_as_text)
_ConfigLoader.add_constructor("!relative", _relative)


def _nav_files(entries: Any) -> Iterator[str]:
    """Every page the nav names, in order: a nav is a list of pages, `{title: page}` and
    `{title: [section entries]}`; external links are not pages."""
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            yield from _nav_files(value)
        elif "://" not in value:
            yield value


def nav_problems(config_path: Path) -> list[str]:
    """What is wrong with the nav of the config at `config_path`, one line each."""
    config = yaml.load(config_path.read_text(), Loader=_ConfigLoader)  # a SafeLoader
    docs = config_path.parent / config.get("docs_dir", "docs")
    named = list(_nav_files(config["nav"]))
    pages = {path.relative_to(docs).as_posix() for path in docs.rglob("*.md")}
    problems = [f"{page}: in the nav {n} times" for page, n in Counter(named).items() if n > 1]
    problems += [f"{page}: in the nav, not in {docs.name}/" for page in named if page not in pages]
    problems += [f"{page}: not in the nav" for page in sorted(pages - set(named))]
    return problems


def test_the_nav_names_every_page_once_and_only_pages_that_exist() -> None:
    assert nav_problems(REPO / "mkdocs.yml") == []


def _site_copy(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    return tmp_path / "mkdocs.yml"


def test_a_page_left_out_of_the_nav_is_named(tmp_path: Path) -> None:
    config = _site_copy(tmp_path)
    (tmp_path / "docs" / "planted.md").write_text("# Planted\n")
    (tmp_path / "docs" / "reference" / "planted.md").write_text("# Planted too\n")
    assert nav_problems(config) == [
        "planted.md: not in the nav",
        "reference/planted.md: not in the nav",
    ]


def test_a_missing_page_and_a_page_named_twice_are_named(tmp_path: Path) -> None:
    config = _site_copy(tmp_path)
    (tmp_path / "docs" / "glossary.md").unlink()
    text = config.read_text().replace(
        "  - Home: index.md\n", "  - Home: index.md\n  - Home again: index.md\n"
    )
    config.write_text(text)
    assert nav_problems(config) == [
        "index.md: in the nav 2 times",
        "glossary.md: in the nav, not in docs/",
    ]
