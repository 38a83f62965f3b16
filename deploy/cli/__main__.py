"""`python -m darl.deploy.cli`: the `darl` command, as the dev stack starts its components."""

from darl.deploy.cli import main

main()
