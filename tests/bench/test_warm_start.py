"""bench/warm_start.py's pieces at toy sizes: the v1 -> v2 pair, when a run counts as having
reached the target, the cost on paper and the section it renders (not the figures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.report import render
from bench.warm_start import IMAGENET_IMAGES, nightly_cost, reached, write_versions


def test_v2_adds_images_and_one_class(tmp_path: Path) -> None:
    v1, v2 = write_versions(tmp_path)

    def count(root: Path, split: str) -> dict[str, int]:
        return {d.name: len(list(d.iterdir())) for d in sorted((root / split).iterdir())}

    assert set(count(v2, "train")) - set(count(v1, "train")) == {"digit_9"}
    assert len(count(v1, "train")) == 9
    for name, n in count(v1, "train").items():
        assert n == (count(v2, "train")[name] + 1) // 2  # half of v2's images of the class
    for version in (v1, v2):
        assert count(version, "val") == count(version, "test")


def test_reached_is_the_first_epoch_at_the_target() -> None:
    run = {"accuracy": [0.5, 0.9, 0.95, 0.94], "cpu_seconds": [3.0, 6.0, 9.0, 12.0]}
    assert reached(run, 0.95) == (3, 9.0)
    assert reached(run, 0.96) == (None, None)


def test_the_cost_on_paper_scales_with_the_share_of_epochs() -> None:
    rows = {(r["size"], r["start"]): r for r in nightly_cost(0.25, {})}
    nd = rows[("ND96isr H100 v5", "scratch")]
    assert nd["hours"] == pytest.approx(IMAGENET_IMAGES * 90 / (5419 * 8 * 0.9) / 3600)
    assert rows[("ND96isr H100 v5", "warm")]["cost"] == pytest.approx(nd["cost"] / 4)
    assert rows[("NC40ads H100 v5", "warm")]["epochs"] == 22.5


def test_the_section_renders_from_a_result(tmp_path: Path) -> None:
    import json

    run = {"accuracy": [0.8, 0.96], "cpu_seconds": [4.0, 8.0], "reached_epoch": 2}
    result = {
        "benchmark": "warm_start",
        "machine": "x86_64, 2 cores",
        "method": "toy",
        "default_variant": "warm-up",
        "epoch_share": 0.5,
        "seeds": [
            {
                "seed": 0,
                "v1_accuracy": 0.9,
                "v1_cpu_seconds": 5.0,
                "target": 0.95,
                "runs": {
                    "scratch": {**run, "reached_cpu_seconds": 8.0},
                    "warm-up": {**run, "reached_epoch": None, "reached_cpu_seconds": None},
                },
            }
        ],
        "cost": {
            "rows": nightly_cost(0.5, {}),
            "h100_images_per_sec": 5419,
            "scaling": 0.9,
            "images": IMAGENET_IMAGES,
            "price_source": "a list",
        },
    }
    (tmp_path / "warm_start.json").write_text(json.dumps(result))
    page = render(tmp_path)
    assert "## Warm start against from scratch (`bench/warm_start.py`)" in page
    assert "| scratch | 1/1 | 2 | 8 | +0.010 |" in page
    assert "| warm-up | 0.800 0.960 | not reached | 8 |" in page
    assert "Prices: a list." in page


def test_the_photo_versions_add_a_texture_and_the_other_half(tmp_path: Path) -> None:
    """Real photographs (scikit-image's brick, grass, gravel), cropped: v1 two textures and
    half the training crops, v2 all three; no split's crop overlaps another's rows."""
    from bench.warm_start_flow import write_dataset

    v1, v2 = write_dataset("textures", tmp_path, seed=0)

    def count(root: Path, split: str) -> dict[str, int]:
        return {d.name: len(list(d.iterdir())) for d in sorted((root / split).iterdir())}

    assert count(v2, "train") == {"brick": 120, "grass": 120, "gravel": 120}
    assert count(v2, "val") == count(v2, "test") == {"brick": 30, "grass": 30, "gravel": 30}
    assert count(v1, "train") == {"brick": 60, "grass": 60}
    assert count(v1, "test") == {"brick": 30, "grass": 30}
    from PIL import Image

    sides = {Image.open(p).size for p in (v2 / "train" / "gravel").iterdir()}
    assert all(w == h and 48 <= w <= 96 for w, h in sides) and len(sides) > 10


def test_the_flow_section_renders_from_a_result(tmp_path: Path) -> None:
    import json

    def run(epochs: int, accuracy: float) -> dict[str, object]:
        return {"epochs_trained": epochs, "kept_epoch": epochs, "test_accuracy": accuracy}

    result = {
        "benchmark": "warm_start_flow",
        "flow": {
            "runs": [
                {
                    "dataset": "textures",
                    "seed": 0,
                    "v1": run(20, 1.0),
                    "warm": run(7, 0.99),
                    "scratch": {**run(21, 0.98), "input_size": 64},
                    "epoch_share": 1 / 3,
                    "reached": True,
                }
            ],
            "max_epoch_share": 1 / 3,
            "reached": 1,
        },
    }
    (tmp_path / "warm_start_flow.json").write_text(json.dumps(result))
    page = render(tmp_path)
    assert "| textures | 0 | 64 | 1.000 | 21 (21), 0.980 | 7 (7), 0.990 | 0.33 | yes |" in page
    assert "Largest share of scratch's epochs a warm run took: 0.33" in page
