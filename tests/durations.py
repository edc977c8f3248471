"""Each test file's time in a whole run, so ``make test`` starts the longest files first.

Why: ``make test`` hands whole files to its worker processes (``--dist loadfile``), and the run
ends when the last file does. Handed out longest first, no long file starts near the end while
the other workers sit idle; pytest-xdist's own order (most tests first) started a 173 s
one-test file late. Replayed through three workers, the times of one run gave 1,155 s for the
busiest worker in xdist's order and 1,063 s longest first.

The table is read at collection and refreshed from a run's JUnit report, which `make test`
writes to .work/junit.xml: ``python -m tests.durations .work/junit.xml``. A file not in it
(a new one) counts as the table's median; the table changes only the order, never a verdict.
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).with_name("durations.json")


def file_times(junit: Path) -> dict[str, float]:
    """Seconds per test file (``tests/x/test_y.py``) in a JUnit report."""
    times: dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(junit).iter("testcase"):
        module = case.get("classname") or ""
        times[module.replace(".", "/") + ".py"] += float(case.get("time") or 0)
    return {name: round(seconds, 1) for name, seconds in sorted(times.items())}


def load() -> dict[str, float]:
    try:
        table = json.loads(TABLE.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in table.items()} if isinstance(table, dict) else {}


def longest_first(paths: list[str], table: dict[str, float]) -> list[int]:
    """The indices of ``paths`` (one per test, in collection order) with the tests of the
    longest files first; a file's tests keep their order."""
    typical = statistics.median(table.values()) if table else 0.0
    first: dict[str, int] = {}
    for i, path in enumerate(paths):
        first.setdefault(path, i)
    return sorted(
        range(len(paths)), key=lambda i: (-table.get(paths[i], typical), first[paths[i]], i)
    )


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.durations JUNIT_XML")
    TABLE.write_text(json.dumps(file_times(Path(sys.argv[1])), indent=1) + "\n")
    print(f"{TABLE}: {len(load())} files")


if __name__ == "__main__":
    main()
