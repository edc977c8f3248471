"""label-images against hostile names (docs/reliability.md, "Adversarial inputs"): whoever can
upload the images to label names them, and the names reach a CSV people open in spreadsheets,
the run's Markdown artifacts and the worker's disk. Through the flow, on Azurite and a real
Prefect server."""

from __future__ import annotations

import csv
import io
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.blob import container_client
from core.config import BlobLocation
from tests.conftest import run_trainer
from tests.pipeline_helpers import make_config
from tests.reliability import report

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A model trained for one epoch on synthetic classes, and those images."""
    from imagedata.make_images import write_synthetic

    root = tmp_path_factory.mktemp("hostile-labels")
    write_synthetic(root / "data", classes=3, per_class=16, size=32, test_fraction=0.3, seed=2)
    result = run_trainer(1, root / "data", root / "out", "--epochs", "1", "--batch-size", "8")
    assert result.returncode == 0, result.output
    return root / "out" / "model.pt", root / "data"


def _config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, azurite: str) -> tuple[Any, Path]:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return config, path


FORMULAS = [
    "=cmd|' -C calc'!A0.png",
    '=HYPERLINK("http:evil.example","open").png',
    "@SUM(1+1).png",
    "-2+3.png",
]
# Not a PNG at all (Pillow's reason names the file it read), named to close a code span and
# open a link and an image behind it.
MARKDOWN = "a` [sign in](https:evil.example) ![x](https:tracker.example/p.png) `b.png"


def test_hostile_names_reach_the_csv_and_the_artifacts_as_text(
    model: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, azurite: str
) -> None:
    """Before: the names went into predictions.csv as they are (a spreadsheet ran them as
    formulas); the skipped images' artifact put each in a code span that a backtick closed (the
    link and the image after it rendered) and showed the worker's temporary path; and one blob
    named with '//' failed the whole run."""
    from markdown_it import MarkdownIt

    from flows.label import label
    from registry.champion import Champion, champion_for, replace_champion
    from tests.pipeline_helpers import task_runs_and_artifacts

    model_path, data = model
    config, config_path = _config(tmp_path, monkeypatch, azurite)
    outputs = container_client(config.output, create=True)
    outputs.upload_blob("runs/r1/model.pt", model_path.read_bytes(), overwrite=True)
    root = config.data.root
    champion = Champion("r1", "accuracy", 0.9, "runs/r1/model.pt", None, "2026-11-25T00:00:00Z")
    replace_champion(outputs, "", root, champion, champion_for(outputs, "", root))
    incoming = BlobLocation(container=f"incoming-{uuid.uuid4().hex[:8]}")
    images = container_client(incoming, create=True)
    png = next((data / "test").rglob("*.png")).read_bytes()
    for name in [*FORMULAS, "fine.png", "a//b.png"]:  # at the container's root: no prefix
        images.upload_blob(name, png)
    images.upload_blob(MARKDOWN, b"not an image")

    state = label(container=incoming.container, config_path=str(config_path), return_state=True)

    assert state.is_completed(), state.message
    result = state.result()
    assert result["labelled"] == len(FORMULAS) + 1
    text = outputs.download_blob(result["predictions"]).readall().decode()
    assert all(line.startswith('"') for line in text.splitlines())
    cells = sorted(row["image"] for row in csv.DictReader(io.StringIO(text)))
    assert cells == sorted([*(f"'{n}" for n in FORMULAS), "fine.png"])
    skipped = sorted(result["skipped"])
    assert skipped[0].startswith("a//b.png: not a name a file can have")
    assert skipped[1].startswith(f"{MARKDOWN}: unreadable image")
    assert "/tmp" not in "".join(skipped) and "label-" not in "".join(skipped)
    _, artifacts = task_runs_and_artifacts(state.state_details.flow_run_id)
    (page,) = [a.data for a in artifacts if a.key == "labels-skipped"]
    rendered = MarkdownIt("commonmark").render(page)
    assert "<a " not in rendered and "<img" not in rendered, rendered
    assert "/tmp" not in page and "label-" not in page
    assert "sign in" in rendered and "a//b.png" in rendered
    report.record(
        "adversarial",
        "label-images: names =cmd|..., =HYPERLINK(...), @SUM, -2+3; a name with a backtick, a "
        "link and an image; a blob named a//b.png",
        "CSV cells quoted, formulas prefixed with ' (OWASP); the artifact shows the names as "
        "text with no temporary path; a//b.png skipped, the rest labelled",
    )
