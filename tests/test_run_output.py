"""What a run prints in a person's terminal: its own lines, not the libraries' chatter.

Each test runs the real component (the Great Expectations gate, Azurite, the command line's
Prefect settings) and reads what it wrote where a person would see it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import ValidationConfig


def _rows() -> list[dict[str, object]]:
    """A valid manifest: two classes, three train and one test image each."""
    return [
        {
            "path": f"{split}/c{c}/{split}{i}.png",
            "split": split,
            "label": f"c{c}",
            "width": 8,
            "height": 8,
            "channels": 1,
            "bytes": 100,
            "md5": f"{split}{c}{i}",
            "readable": True,
            "leak": False,
        }
        for c in range(2)
        for split, n in (("train", 3), ("test", 1))
        for i in range(n)
    ]


def test_gate_draws_no_progress_bars(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from gate.suites import run_expectations

    rules = ValidationConfig(min_images_per_class=2, min_side=8, max_side=64)
    passed, records = run_expectations(_rows(), rules, tmp_path / "docs")
    out, err = capfd.readouterr()
    assert passed, [r for r in records if not r["success"]]
    assert "Calculating Metrics" not in out + err  # GX's tqdm bars, one set per metrics pass
    assert (tmp_path / "docs" / "index.html").is_file()  # the run's Data Docs still built
