"""The `darl` command line: one Typer app, `app`, on which each module of this package
registers its group of commands as it is imported."""

# isort: off
# In the order `darl --help` lists their commands.
from darl.deploy.cli import components, stack, rollout, training, vllm, viewer  # noqa: F401

# isort: on
from darl.deploy.cli.support import app

__all__ = ["app", "main"]


def main() -> None:
    app()
