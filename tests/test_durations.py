"""The order `make test` hands files out in: longest first by a table of file times."""

from __future__ import annotations

from pathlib import Path

from tests.durations import file_times, longest_first

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.flows.test_a" name="test_one" time="3.5"/>
<testcase classname="tests.flows.test_a" name="test_two" time="1.0"/>
<testcase classname="tests.test_b" name="test_one" time="0.25"/>
<testcase classname="tests.gate.test_c" name="test_one[x]" time="40"/>
</testsuite></testsuites>"""


def test_file_times_add_each_files_tests_from_a_junit_report(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text(JUNIT)
    assert file_times(tmp_path / "junit.xml") == {
        "tests/flows/test_a.py": 4.5,
        "tests/gate/test_c.py": 40.0,
        "tests/test_b.py": 0.2,
    }


def test_longest_files_first_each_files_tests_in_order_a_new_file_at_the_median() -> None:
    paths = ["a.py", "a.py", "b.py", "new.py", "new.py", "c.py", "a.py"]
    table = {"a.py": 5.0, "b.py": 1.0, "c.py": 60.0, "d.py": 7.0}
    order = [paths[i] + f"#{i}" for i in longest_first(paths, table)]
    assert order == ["c.py#5", "new.py#3", "new.py#4", "a.py#0", "a.py#1", "a.py#6", "b.py#2"]
    assert longest_first(["x.py", "x.py", "y.py"], {}) == [0, 1, 2]  # no table: as collected
