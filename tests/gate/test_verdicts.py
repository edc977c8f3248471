"""The gate's verdict is reused only for the manifest and rules it was reached on.

Great Expectations runs once for the module's first verdict (``judged``); each test starts
from a copy of that cache, so the suites run only where a test needs a new verdict."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.config import ValidationConfig
from gate import verdicts
from gate.suites import run_expectations
from gate.verdicts import Verdict, judge, verdict_key
from tests.conftest import ROOT, child_env
from tests.gate_helpers import valid_manifest_rows

RULES = ValidationConfig(min_images_per_class=2, min_side=8, max_side=64)


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Verdict, bytes]:
    """The first verdict on a valid manifest: its cache folder, the verdict, its Data Docs'
    index page."""
    root = tmp_path_factory.mktemp("judged")
    first = judge(valid_manifest_rows(), RULES, root / "run" / "data_docs", root / "verdicts")
    return root / "verdicts", first, (root / "run" / "data_docs" / "index.html").read_bytes()


@pytest.fixture
def cache(judged: tuple[Path, Verdict, bytes], tmp_path: Path) -> Path:
    """A copy of the cache holding the first verdict, the test's own."""
    return Path(shutil.copytree(judged[0], tmp_path / "verdicts"))


def test_the_same_manifest_and_rules_reuse_the_verdict_and_its_docs(
    judged: tuple[Path, Verdict, bytes], cache: Path, tmp_path: Path
) -> None:
    _, first, index = judged
    assert first.success and not first.reused
    docs = tmp_path / "run2" / "data_docs"
    again = judge(valid_manifest_rows(), RULES, docs, cache)
    assert again.reused and (again.success, again.records) == (first.success, first.records)
    assert (docs / "index.html").read_bytes() == index
    # What a fresh run of the suites says on the same rows, record for record.
    fresh = run_expectations(valid_manifest_rows(), RULES, tmp_path / "fresh")
    assert fresh == (first.success, first.records)


def _changed_row(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**rows[0], "readable": False}, *rows[1:]]


@pytest.mark.parametrize("change", ["one row", "one rule", "one byte count"])
def test_a_change_in_what_decides_it_is_judged_again(
    cache: Path, tmp_path: Path, change: str
) -> None:
    rows, rules = valid_manifest_rows(), RULES
    if change == "one row":
        rows = _changed_row(rows)
    elif change == "one rule":
        rules = RULES.model_copy(update={"min_images_per_class": 4})
    else:  # a change no expectation looks at still is another manifest
        rows = [*rows[:-1], {**rows[-1], "bytes": 101}]
    second = judge(rows, rules, tmp_path / "run2" / "data_docs", cache)
    assert not second.reused
    assert second.success is (change == "one byte count")  # the others are changes it catches
    assert judge(rows, rules, tmp_path / "run3" / "data_docs", cache).reused  # stored beside
    assert judge(valid_manifest_rows(), RULES, tmp_path / "run4" / "data_docs", cache).reused


def test_new_code_or_an_upgrade_is_another_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What decides the verdict besides the data: the suites' code and the modules they read
    (whole files, ``DECIDING_SOURCES``), and the versions of Great Expectations, pandas and
    numpy. Another key is a verdict not stored yet: the suites run (the tests above)."""
    rows = valid_manifest_rows()
    assert {p.name for p in verdicts.DECIDING_SOURCES} >= {"suites.py", "manifest.py", "images.py"}
    code = tmp_path / "suites_copy.py"
    code.write_text("RULE = 1\n")
    monkeypatch.setattr(verdicts, "DECIDING_SOURCES", (*verdicts.DECIDING_SOURCES, code))
    before = verdict_key(rows, RULES)
    assert verdict_key(rows, RULES) == before
    code.write_text("RULE = 2\n")
    changed_code = verdict_key(rows, RULES)
    installed = verdicts.metadata.version
    for package in verdicts.DECIDING_PACKAGES:
        monkeypatch.setattr(
            verdicts.metadata,
            "version",
            lambda name, p=package: "0.0.0-upgraded" if name == p else installed(name),
        )
        assert verdict_key(rows, RULES) not in (before, changed_code), package
    assert changed_code != before


def test_only_the_newest_verdicts_are_kept(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verdicts, "KEEP", 2)
    (first,) = cache.iterdir()
    second = cache / ("0" * 64)  # another manifest's verdict, used after the first
    shutil.copytree(first, second)
    os.utime(first, (1, 1))
    # A half-written verdict a killed gate left: gone once stale, kept while it may be written.
    (cache / ".verdict-killed").mkdir()
    os.utime(cache / ".verdict-killed", (1, 1))
    (cache / ".verdict-writing").mkdir()
    rows = [*valid_manifest_rows()[:-1], {**valid_manifest_rows()[-1], "bytes": 300}]
    judge(rows, RULES, tmp_path / "run2" / "data_docs", cache)  # a third verdict stored
    assert {p.name for p in cache.iterdir()} == {
        second.name,
        verdict_key(rows, RULES),
        ".verdict-writing",
    }


@pytest.mark.parametrize("damage", ["cut verdict", "not an object", "no docs", "a file"])
def test_a_damaged_stored_verdict_is_judged_again(
    judged: tuple[Path, Verdict, bytes], cache: Path, tmp_path: Path, damage: str
) -> None:
    stored = cache / verdict_key(valid_manifest_rows(), RULES)
    if damage == "cut verdict":
        text = (stored / "verdict.json").read_text()
        (stored / "verdict.json").write_text(text[: len(text) // 2])
    elif damage == "not an object":
        (stored / "verdict.json").write_text(json.dumps([True]))
    elif damage == "no docs":
        (stored / "data_docs" / "index.html").unlink()
    else:
        shutil.rmtree(stored)
        stored.write_text("{}")
    first = judged[1]
    again = judge(valid_manifest_rows(), RULES, tmp_path / "run2" / "data_docs", cache)
    assert not again.reused and (again.success, again.records) == (first.success, first.records)
    assert (tmp_path / "run2" / "data_docs" / "index.html").is_file()
    reused = judge(valid_manifest_rows(), RULES, tmp_path / "run3" / "data_docs", cache)
    assert reused.reused  # stored whole again


def test_a_failed_verdict_is_reused_as_failed(cache: Path, tmp_path: Path) -> None:
    rows = _changed_row(valid_manifest_rows())
    first = judge(rows, RULES, tmp_path / "run1" / "data_docs", cache)
    again = judge(rows, RULES, tmp_path / "run2" / "data_docs", cache)
    assert not first.success and again.reused
    assert (again.success, again.records) == (first.success, first.records)


@pytest.mark.processes
def test_a_reused_verdict_does_not_import_great_expectations(cache: Path, tmp_path: Path) -> None:
    """The saving itself: a process that reuses a verdict never loads Great Expectations."""
    script = (
        "import sys; from pathlib import Path\n"
        "from core.config import ValidationConfig\n"
        "from gate.verdicts import judge\n"
        "from tests.gate_helpers import valid_manifest_rows\n"
        f"v = judge(valid_manifest_rows(), ValidationConfig(min_images_per_class=2, min_side=8,"
        f" max_side=64), Path({str(tmp_path / 'run2')!r}), Path({str(cache)!r}))\n"
        "print(v.reused, 'great_expectations' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.split() == ["True", "False"], done.stdout + done.stderr
