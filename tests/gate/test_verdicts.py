"""The gate's verdict is reused only for the manifest and rules it was reached on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.config import ValidationConfig
from gate.suites import run_expectations
from gate.verdicts import judge, verdict_key
from tests.conftest import ROOT, child_env
from tests.gate_helpers import valid_manifest_rows

RULES = ValidationConfig(min_images_per_class=2, min_side=8, max_side=64)


def _folders(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "verdicts", tmp_path / "run" / "data_docs"


def test_the_same_manifest_and_rules_reuse_the_verdict_and_its_docs(tmp_path: Path) -> None:
    cache, docs = _folders(tmp_path)
    rows = valid_manifest_rows()
    first = judge(rows, RULES, docs, cache)
    assert first.success and not first.reused
    built = (docs / "index.html").read_bytes()

    again_docs = tmp_path / "run2" / "data_docs"
    again = judge(rows, RULES, again_docs, cache)
    assert again.reused and (again.success, again.records) == (first.success, first.records)
    assert (again_docs / "index.html").read_bytes() == built
    # What a fresh run of the suites says on the same rows, record for record.
    fresh = run_expectations(rows, RULES, tmp_path / "fresh")
    assert fresh == (first.success, first.records)


def _changed_row(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**rows[0], "readable": False}, *rows[1:]]


@pytest.mark.parametrize("change", ["one row", "one rule", "one byte count"])
def test_a_change_in_what_decides_it_is_judged_again(tmp_path: Path, change: str) -> None:
    cache, docs = _folders(tmp_path)
    rows = valid_manifest_rows()
    first = judge(rows, RULES, docs, cache)
    rules = RULES
    if change == "one row":
        rows = _changed_row(rows)
    elif change == "one rule":
        rules = RULES.model_copy(update={"min_images_per_class": 4})
    else:  # a change no expectation looks at still is another manifest
        rows = [*rows[:-1], {**rows[-1], "bytes": 101}]
    second = judge(rows, rules, tmp_path / "run2" / "data_docs", cache)
    assert not second.reused
    assert judge(rows, rules, tmp_path / "run3" / "data_docs", cache).reused  # stored beside
    if change == "one byte count":
        assert second.success and first.success
    else:
        assert first.success and not second.success  # a change the suites catch


@pytest.mark.parametrize("damage", ["cut verdict", "not an object", "no docs", "a file"])
def test_a_damaged_stored_verdict_is_judged_again(tmp_path: Path, damage: str) -> None:
    cache, docs = _folders(tmp_path)
    rows = valid_manifest_rows()
    first = judge(rows, RULES, docs, cache)
    stored = cache / verdict_key(rows, RULES)
    if damage == "cut verdict":
        text = (stored / "verdict.json").read_text()
        (stored / "verdict.json").write_text(text[: len(text) // 2])
    elif damage == "not an object":
        (stored / "verdict.json").write_text(json.dumps([True]))
    elif damage == "no docs":
        (stored / "data_docs" / "index.html").unlink()
    else:
        import shutil

        shutil.rmtree(stored)
        stored.write_text("{}")
    again = judge(rows, RULES, tmp_path / "run2" / "data_docs", cache)
    assert not again.reused and (again.success, again.records) == (first.success, first.records)
    assert (tmp_path / "run2" / "data_docs" / "index.html").is_file()
    assert judge(rows, RULES, tmp_path / "run3" / "data_docs", cache).reused  # stored whole again


def test_a_failed_verdict_is_reused_as_failed(tmp_path: Path) -> None:
    cache, docs = _folders(tmp_path)
    rows = _changed_row(valid_manifest_rows())
    first = judge(rows, RULES, docs, cache)
    again = judge(rows, RULES, tmp_path / "run2" / "data_docs", cache)
    assert not first.success and again.reused
    assert (again.success, again.records) == (first.success, first.records)


@pytest.mark.processes
def test_a_reused_verdict_does_not_import_great_expectations(tmp_path: Path) -> None:
    """The saving itself: a process that reuses a verdict never loads Great Expectations."""
    cache, docs = _folders(tmp_path)
    judge(valid_manifest_rows(), RULES, docs, cache)
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
