"""SWE-style coding tasks: SWE-bench/SWE-smith instances (`instances`), a small set made by
SWE-smith's method from the repositories under `repos/` (`make_tasks`, `tasks.jsonl`), and the
git mirrors their base commits live in (`mirrors`)."""
