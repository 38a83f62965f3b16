"""SWE-smith-style task instances from the small repositories in examples/swe/repos, made by
SWE-smith's method: inject a bug into a function the tests cover; the tests that now fail are
FAIL_TO_PASS. The test files holding them are left out of the instance's base commit, as
SWE-bench's base commits lack the tests of their `test_patch`.

    python -m darl.examples.swe.make_tasks tasks --out examples/swe/tasks.jsonl
    python -m darl.examples.swe.make_tasks mirrors --out .darl/swe/repos

`tasks` runs each candidate bug's tests (a minute or so), picks a spread of bugs across
functions and modifiers, and checks every instance as a grader would before writing it.
`mirrors` rebuilds, in seconds and without running tests, the git repositories the tasks'
`base_commit`s live in (SandboxSpec.repos_dir)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from darl.examples.swe.instances import load_instances, mirror_name
from darl.examples.swe.mirrors import (
    BUG_MESSAGE,
    OWNER,
    REPOS,
    MirrorError,
    build_mirrors,
    commit,
    diff,
    git_environment,
    init_mirror,
    repository_files,
)
from darl.examples.swe.mutations import Mutant, mutants
from darl.examples.swe.problem_statements import Failure, problem_statement, reproduction_lines
from darl.examples.swe.pytest_runs import PytestServer, PytestServerError, PytestServers
from darl.files import write_atomically

TASKS = Path(__file__).parent / "tasks.jsonl"
CREATED_AT = "2026-01-01T00:00:00Z"
# A bug that breaks more tests than this is too blunt to make a task of.
MAX_FAILING = 8
# CPU seconds: a run takes a fraction of one; a candidate past this loops.
CANDIDATE_CPU_SECONDS = 3
TEST_CPU_SECONDS = 30
# SWE-smith samples its candidates; here at most this many per function and modifier.
PER_FUNCTION_AND_MODIFIER = 3
T = TypeVar("T")
R = TypeVar("R")


class TaskError(RuntimeError):
    """The repositories or an instance made from them are not what a task needs."""


@dataclass(frozen=True)
class Repository:
    name: str
    version: str
    files: dict[str, bytes]
    tests: list[str] = field(default_factory=list)  # every test id, all passing on clean code

    @property
    def repo(self) -> str:
        return f"{OWNER}/{self.name}"

    def sources(self) -> list[str]:
        """The code bugs go into: Python files outside tests/, but the re-exporting __init__."""
        return [
            p
            for p in self.files
            if p.endswith(".py") and not p.startswith("tests/") and not p.endswith("__init__.py")
        ]


@dataclass(frozen=True)
class Candidate:
    repository: Repository
    mutant: Mutant
    outcomes: dict[str, dict[str, Any]]
    failing: list[str]

    @property
    def digest(self) -> str:
        content = f"{self.mutant.path}\n{self.mutant.source}".encode()
        return hashlib.sha256(content).hexdigest()[:8]

    @property
    def instance_id(self) -> str:
        # SWE-smith's shape: "<owner>__<repo>.<modifier>__<hash>".
        return f"{mirror_name(self.repository.repo)}.{self.mutant.modifier}__{self.digest}"

    @property
    def hidden(self) -> list[str]:
        return sorted({test.split("::")[0] for test in self.failing})


def write_files(files: dict[str, bytes], into: Path) -> None:
    for path, data in files.items():
        target = into / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def load_repository(root: Path, server: PytestServer) -> Repository:
    """The repository's files and version, with its test ids, every test passing."""
    files = repository_files(root)
    try:
        version = tomllib.loads(files["pyproject.toml"].decode())["project"]["version"]
    except (KeyError, tomllib.TOMLDecodeError) as err:
        raise TaskError(f"{root}/pyproject.toml must give [project] version: {err!r}") from err
    with tempfile.TemporaryDirectory(prefix=f"darl-swe-{root.name}-") as work:
        write_files(files, Path(work))
        outcomes = server.run(Path(work))
    broken = [t for t, r in (outcomes or {}).items() if r.get("outcome") != "passed"]
    if not outcomes or broken:
        raise TaskError(f"the tests of {root} must pass on its clean code: {broken or 'timeout'}")
    return Repository(root.name, version, files, sorted(outcomes))


def sampled_mutants(repository: Repository) -> list[Mutant]:
    """The repository's distinct mutants, at most PER_FUNCTION_AND_MODIFIER of each function
    and modifier, picked by the hash of their code (a fixed sample)."""
    groups: dict[tuple[str, str, str], dict[str, Mutant]] = {}
    for path in repository.sources():
        for mutant in mutants(path, repository.files[path].decode()):
            key = (mutant.path, mutant.function, mutant.modifier)
            digest = hashlib.sha256(mutant.source.encode()).hexdigest()
            groups.setdefault(key, {})[digest] = mutant
    sampled, seen = [], set()
    for _, group in sorted(groups.items()):
        for digest in sorted(group)[:PER_FUNCTION_AND_MODIFIER]:
            if group[digest].source not in seen:
                seen.add(group[digest].source)
                sampled.append(group[digest])
    return sampled


def evaluate(
    server: PytestServer, repository: Repository, mutant: Mutant, *, detailed: bool = False
) -> Candidate | None:
    """The mutant as a candidate when 1..MAX_FAILING tests fail on it and the rest pass."""
    with tempfile.TemporaryDirectory(prefix=f"darl-swe-{repository.name}-") as work:
        write_files({**repository.files, mutant.path: mutant.source.encode()}, Path(work))
        limit = TEST_CPU_SECONDS if detailed else CANDIDATE_CPU_SECONDS
        outcomes = server.run(Path(work), detailed=detailed, cpu_seconds=limit)
    if outcomes is None:
        return None
    failing = [t for t in repository.tests if outcomes.get(t, {}).get("outcome") != "passed"]
    if not 1 <= len(failing) <= MAX_FAILING:
        return None
    return Candidate(repository, mutant, outcomes, failing)


def explained(server: PytestServer, candidate: Candidate) -> Candidate:
    again = evaluate(server, candidate.repository, candidate.mutant, detailed=True)
    if again is None or again.failing != candidate.failing:
        raise TaskError(f"{candidate.instance_id}: its tests fail differently when run again")
    return again


def select(candidates: list[Candidate], count: int) -> list[Candidate]:
    """`count` candidates spread evenly over the repositories. Within one, each pick is the
    bug that fails tests no earlier pick fails, in the function picked least, with the
    modifier used least, hiding fewest test files (then by hash, so the choice is fixed)."""
    names = sorted({c.repository.name for c in candidates})
    chosen: list[Candidate] = []
    for place, name in enumerate(names):
        quota = count // len(names) + (place < count % len(names))
        pool = [c for c in candidates if c.repository.name == name]
        functions: Counter[str] = Counter()
        modifiers: Counter[str] = Counter()
        failing_sets: set[tuple[str, ...]] = set()
        for _ in range(min(quota, len(pool))):
            best = min(
                pool,
                key=lambda c: (
                    tuple(c.failing) in failing_sets,
                    functions[f"{c.mutant.path}:{c.mutant.function}"],
                    modifiers[c.mutant.modifier],
                    len(c.hidden),
                    c.digest,
                ),
            )
            pool.remove(best)
            functions[f"{best.mutant.path}:{best.mutant.function}"] += 1
            modifiers[best.mutant.modifier] += 1
            failing_sets.add(tuple(best.failing))
            chosen.append(best)
    return chosen


def statement(candidate: Candidate) -> str:
    """The issue, written from the failing test with the shortest reproduction."""
    repository = candidate.repository

    def parts(test: str) -> tuple[str, str, Failure]:
        path, name = test.split("::")
        return repository.files[path].decode(), name, Failure.of(candidate.outcomes[test])

    test = min(candidate.failing, key=lambda t: (reproduction_lines(*parts(t)), t))
    return problem_statement(
        *parts(test),
        package=repository.name,
        version=repository.version,
        seed=int(candidate.digest, 16),
    )


def instances(chosen: list[Candidate], scratch: Path) -> list[dict[str, Any]]:
    """SWE-bench/SWE-smith rows; base commits, patches and test patches made with git."""
    rows = []
    roots: dict[str, str] = {}
    for candidate in chosen:
        repository, mutant = candidate.repository, candidate.mutant
        git_dir = scratch / mirror_name(repository.repo)
        if repository.name not in roots:
            roots[repository.name] = init_mirror(git_dir, repository.files)
        root = roots[repository.name]
        base = commit(
            git_dir,
            root,
            {mutant.path: mutant.source.encode()},
            candidate.hidden,
            f"refs/heads/{candidate.instance_id}",
            BUG_MESSAGE,
        )
        rows.append(
            {
                "instance_id": candidate.instance_id,
                "repo": repository.repo,
                "base_commit": base,
                "patch": diff(git_dir, base, root, [mutant.path]),
                "test_patch": diff(git_dir, base, root, candidate.hidden),
                "problem_statement": statement(candidate),
                "hints_text": "",
                "created_at": CREATED_AT,
                "version": repository.version,
                "FAIL_TO_PASS": candidate.failing,
                "PASS_TO_PASS": [t for t in repository.tests if t not in candidate.failing],
                # One image per instance, its tag the instance id after the repository (see
                # the docs): SWE-bench's eval images are per instance as well.
                "image_name": f"{repository.repo}:{candidate.instance_id.split('.', 1)[1]}",
            }
        )
    return sorted(rows, key=lambda row: row["instance_id"])


def check_instance(server: PytestServer, row: dict[str, Any], mirrors: Path) -> None:
    """The instance graded as SWE-bench grades: at base_commit the hidden test files are
    absent; with `test_patch` FAIL_TO_PASS fail and PASS_TO_PASS pass; with `patch` all pass."""
    name, tests = row["instance_id"], [*row["FAIL_TO_PASS"], *row["PASS_TO_PASS"]]
    with tempfile.TemporaryDirectory(prefix="darl-swe-check-") as scratch:
        work = Path(scratch) / "testbed"
        git_dir = mirrors / mirror_name(row["repo"])

        def git(*args: str, stdin: str = "") -> None:
            done = subprocess.run(
                ["git", *args],
                cwd=work if work.exists() else scratch,
                input=stdin.encode(),
                env=git_environment(),
                capture_output=True,
                timeout=60,
            )
            if done.returncode != 0:
                error = done.stderr.decode(errors="replace").strip()
                raise TaskError(f"{name}: git {' '.join(args[:2])} failed: {error}")

        git("clone", "--quiet", str(git_dir), str(work))
        git("checkout", "--quiet", "--detach", row["base_commit"])
        hidden = sorted({t.split("::")[0] for t in row["FAIL_TO_PASS"]})
        if any((work / path).exists() for path in hidden):
            raise TaskError(f"{name}: its base commit holds the hidden tests {hidden}")
        git("apply", "-", stdin=row["test_patch"])
        before = server.run(work, tests) or {}
        git("apply", "-", stdin=row["patch"])
        after = server.run(work, tests) or {}

    def outcome(run: dict[str, dict[str, Any]], test: str) -> str:
        return run.get(test, {}).get("outcome", "missing")

    wrong = [t for t in row["FAIL_TO_PASS"] if outcome(before, t) != "failed"]
    wrong += [t for t in row["PASS_TO_PASS"] if outcome(before, t) != "passed"]
    wrong += [t for t in tests if outcome(after, t) != "passed"]
    if wrong:
        raise TaskError(f"{name}: these tests do not grade it as its fields say: {wrong}")


def parallel(function: Callable[[T], R], items: list[T]) -> list[R]:
    """`function` over the items on a thread per CPU (the work is in subprocesses), the
    results in the items' order."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        return list(pool.map(function, items))


def make_tasks(count: int, repos: Path = REPOS) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The instances, every one checked; and how many candidate bugs each repository had."""
    if not repos.is_dir():
        raise TaskError(f"{repos} does not exist: run this from a DARL checkout")
    with PytestServers() as servers, tempfile.TemporaryDirectory(prefix="darl-swe-") as scratch:
        roots = sorted(p for p in repos.iterdir() if p.is_dir())
        repositories = parallel(lambda root: load_repository(root, servers.get()), roots)
        work = [(r, mutant) for r in repositories for mutant in sampled_mutants(r)]
        results = parallel(lambda job: evaluate(servers.get(), *job), work)
        candidates = [c for c in results if c is not None]
        chosen = select(candidates, count)
        if len(chosen) < count:
            raise TaskError(f"only {len(chosen)} usable bugs for {count} tasks: add tests or code")
        # Again with pytest's assert explanations, which the issues are written from.
        chosen = parallel(lambda c: explained(servers.get(), c), chosen)
        rows = instances(chosen, Path(scratch) / "made")
        mirrors = Path(scratch) / "rebuilt"
        build_mirrors(rows, mirrors, repos)
        parallel(lambda row: check_instance(servers.get(), row, mirrors), rows)
    found = Counter(c.repository.name for c in candidates)
    return rows, {r.name: found[r.name] for r in repositories}


def write_tasks(rows: list[dict[str, Any]], path: Path) -> None:
    """JSON lines, written whole, so a reader never sees half a file."""
    write_atomically(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


app = typer.Typer(
    add_completion=False,
    help="SWE-smith-style tasks from examples/swe/repos: `tasks` makes and checks them, "
    "`mirrors` builds the git repositories their base commits live in.",
)


@app.command("tasks")
def tasks_command(
    out: Annotated[Path, typer.Option(help="The JSONL file to write.")] = TASKS,
    count: Annotated[int, typer.Option(min=1, help="How many instances.")] = 60,
) -> None:
    """Generate, check and write the task instances."""
    started = time.monotonic()
    try:
        rows, candidates = make_tasks(count)
    except (TaskError, MirrorError, PytestServerError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from err
    write_tasks(rows, out)
    per_repo = Counter(row["repo"] for row in rows)
    for name, found in candidates.items():
        made = per_repo[f"{OWNER}/{name}"]
        typer.echo(f"{OWNER}/{name}: {made} instances from {found} candidate bugs")
    typer.echo(f"{out}: {len(rows)} instances in {time.monotonic() - started:.1f}s")


@app.command("mirrors")
def mirrors_command(
    out: Annotated[Path, typer.Option(help="Where the bare repositories go.")],
    tasks: Annotated[Path, typer.Option(help="The instances whose commits to build.")] = TASKS,
) -> None:
    """Build the git mirrors of the repositories, a branch per instance."""
    started = time.monotonic()
    try:
        rows = load_instances(tasks)
        build_mirrors(rows, out)
    except (MirrorError, ValueError, OSError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from err
    seconds = time.monotonic() - started
    repos = len({row["repo"] for row in rows})
    typer.echo(f"{out}: {repos} mirrors, {len(rows)} instance branches in {seconds:.1f}s")


if __name__ == "__main__":
    app()
