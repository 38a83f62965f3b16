"""Running DARL: the `darl` CLI, the embedded dev stack and the process plumbing behind it."""
