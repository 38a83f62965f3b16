"""DARL installs as one namespace: the wheel holds `darl.workflows`, `darl.gateway`, ... and
nothing top-level beside `darl`, so an installed DARL never shadows another project's modules
(Agent Lightning's agents import their own `examples.*`). Built from this checkout with pip,
no index, no build isolation."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[2]
FOLDERS = [
    "workflows",
    "activities",
    "gateway",
    "serving",
    "trainer",
    "deploy",
    "viewer",
    "examples",
    "files",
    "temporal_agents",
]


def test_the_wheel_installs_every_folder_under_darl_and_nothing_else(tmp_path: Path):
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    source = tmp_path / "src"
    source.mkdir()
    for name in ["pyproject.toml", "README.md"]:
        shutil.copy(ROOT / name, source / name)
    for folder in FOLDERS:
        shutil.copytree(
            ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--wheel-dir",
            str(tmp_path),
            str(source),
        ],
        check=True,
        cwd=tmp_path,
        timeout=240,
    )
    [wheel] = tmp_path.glob("darl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"darl", "darl-0.1.0.dist-info"}
    for folder in FOLDERS:
        sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*.py")}
        sources = {s for s in sources if "__pycache__" not in s}
        # The coding-agent tasks' repositories are data that must not be installed
        # (pyproject.toml's package-data says why).
        sources = {s for s in sources if not s.startswith("examples/swe/repos/")}
        assert {f"darl/{s}" for s in sources} <= set(names), folder
    # What the demo and the examples read at run time.
    for data in [
        "examples/digits/train.yaml",
        "examples/digits/tasks.jsonl",
        "viewer/templates/rollout.html",
        "viewer/static/viewer.js",
    ]:
        assert f"darl/{data}" in names
    assert not [n for n in names if n.startswith("darl/examples/swe/repos/")]
    assert "darl/examples/swe/tasks.jsonl" not in names
    entry_points = zipfile.ZipFile(wheel).read("darl-0.1.0.dist-info/entry_points.txt").decode()
    assert "darl = darl.deploy.cli:main" in entry_points
