"""The label-images flow (flows/label.py): a folder of new images in Blob storage labelled by the
champion's model, on Azurite and a real Prefect server."""

from __future__ import annotations

import csv
import io
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from PIL import Image

from backends.blob import container_client, upload_directory
from core.config import BlobLocation
from tests.conftest import run_trainer
from tests.pipeline_helpers import make_config

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A model trained for one epoch on synthetic classes, and those images."""
    from imagedata.make_images import write_synthetic

    root = tmp_path_factory.mktemp("label")
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


def test_new_images_are_labelled_by_the_champion_and_damaged_ones_named(
    model: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, azurite: str
) -> None:
    from core.data_versions import DataRoot
    from flows.label import label
    from registry.champion import Champion, champion_for, replace_champion
    from training.predict import predict

    model_path, data = model
    config, config_path = _config(tmp_path, monkeypatch, azurite)
    outputs = container_client(config.output, create=True)
    outputs.upload_blob("runs/r1/model.pt", model_path.read_bytes())
    outputs.upload_blob("runs/r2/model.pt", model_path.read_bytes())
    root = config.data.root
    champion = Champion("r1", "accuracy", 0.9, "runs/r1/model.pt", None, "2026-11-25T00:00:00Z")
    replace_champion(outputs, "", root, champion, champion_for(outputs, "", root))
    # Another dataset's champion, under the same output prefix: not the one that labels.
    faces = DataRoot(root.container, "faces")
    other = Champion("r2", "accuracy", 0.8, "runs/r2/model.pt", None, "2026-11-25T00:00:00Z")
    replace_champion(outputs, "", faces, other, champion_for(outputs, "", faces))

    new = tmp_path / "new"
    (new / "flat").mkdir(parents=True)
    for image in sorted((data / "test").rglob("*.png")):  # the labels' folders dropped
        shutil.copyfile(image, new / "flat" / f"{image.parent.name}-{image.name}")
    Image.new("RGB", (50, 30), (10, 200, 10)).save(new / "photo.jpg")
    (new / "damaged.png").write_bytes(b"\x89PNG\r\n\x1a\n cut short")
    incoming = BlobLocation(container=config.data.container)
    upload_directory(container_client(incoming, create=True), new, "2026-11-25")

    result = label(
        container=config.data.container, prefix="2026-11-25", config_path=str(config_path)
    )

    images = [*sorted(new.rglob("*.png")), new / "photo.jpg"]
    assert result["labelled"] == len(images) - 1 and result["model"] == "runs/r1/model.pt"
    assert result["chosen"] == f"the champion of data root {root.where} (run r1)"
    assert len(result["skipped"]) == 1
    assert result["skipped"][0].startswith("2026-11-25/damaged.png: unreadable image")
    rows = list(
        csv.DictReader(io.StringIO(outputs.download_blob(result["predictions"]).readall().decode()))
    )
    assert result["predictions"].startswith("labels/") and result["predictions"].endswith(
        "/predictions.csv"
    )
    # The same labels as the model gives those files here, named by their blobs.
    local, _ = predict(model_path, images, top_k=3)
    expected = {
        f"2026-11-25/{Path(p.image).relative_to(new).as_posix()}": p.top[0][0] for p in local
    }
    assert {r["image"]: r["label_1"] for r in rows} == expected
    assert result["link"].startswith(config.output.links_url)
    # The run names the dataset whose champion labels (each data root has its own).
    with_faces = label(
        container=config.data.container,
        prefix="2026-11-25",
        config_path=str(config_path),
        data_prefix="faces",
    )
    assert with_faces["model"] == "runs/r2/model.pt"
    assert with_faces["chosen"] == f"the champion of data root {faces.where} (run r2)"


def test_without_a_champion_the_run_fails_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, azurite: str
) -> None:
    from flows.label import label

    config, config_path = _config(tmp_path, monkeypatch, azurite)
    container_client(config.output, create=True)
    state = label(container=config.data.container, config_path=str(config_path), return_state=True)
    assert state.is_failed()
    assert f"there is no champion of data root {config.data.root.where} yet" in str(state.message)
