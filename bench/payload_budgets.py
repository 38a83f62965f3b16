"""The budgets table of docs/architecture.md: each Temporal payload DARL makes, its budget, and
its worst case as `tests/unit/test_payload_budgets.py` builds it (every field at its bound,
ids and paths at their longest, counts at their caps), serialised by DARL's data converter.

    .venv/bin/python -m bench.payload_budgets
"""

from __future__ import annotations

from tests.unit.test_payload_budgets import CASES, PAYLOAD_LIMIT, payload_bytes


def main() -> None:
    print(f"Temporal's limit on one payload: {PAYLOAD_LIMIT:,} bytes\n")
    print("| payload | budget | worst case |")
    print("|---|---:|---:|")
    for case in CASES:
        size = payload_bytes(case.build())
        print(f"| {case.name} | {case.budget:,} | {size:,} |")


if __name__ == "__main__":
    main()
